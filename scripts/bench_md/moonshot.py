"""The `moonshot` section of BENCHMARKS.md."""
import json
import re
from pathlib import Path


def moonshot(directory, cores, mem_bytes):
    d = Path(directory)
    r = json.load(open(d / "xl.last.json"))
    err = open(d / "xl.err").read()
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", err)
    time_rss = int(m.group(1)) * 1024 if m else None
    base = r["disk_baseline"]
    params = r["params"]
    losses = r["losses"]
    steps = len(losses)
    step_secs = [x * r["train_batch_size"] for x in r["step_seconds_per_sample"]]
    opt = r["swap"]
    par = r["param_store"]["swap"]
    gib = 1 << 30
    lines = [
        "## ZeRO-Infinity: a 2-billion-parameter GPT on one machine",
        "",
        f"`bash scripts/moonshot.sh` on a machine with {cores} CPU cores and "
        f"{int(mem_bytes) / gib:.1f} GiB of RAM; swap files in the system's temp folder (ext4 on "
        "a virtual disk here). GPT `xl`: d 2048, 40 layers, 16 heads, context 128, "
        f"{params:,} parameters. Its fp32 model states at ZeRO's 16 bytes per parameter "
        f"(formula, not measured) would be {16 * params / 1e9:.1f} GB, more than the machine's RAM. "
        "ZeRO stage 3 on one rank, AdamW with a linear warm-up (WarmupLR, 1e-6 to 1e-5 over 8 "
        "steps), 2 sequences per step, blocks checkpointed; parameters "
        "(fp32 pieces, read ahead of their gathers) and optimizer state (fp32 masters, m and v, "
        "stepped in tiles of 10M elements, reads and writes pipelined) in swap files through "
        f"{opt['engine']} with `O_DIRECT`.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| optimizer steps | {steps} |",
        f"| loss at each step | {' -> '.join(f'{x:.3f}' for x in losses)} |",
        f"| seconds per step (each step) | {', '.join(f'{x:.0f}' for x in step_secs)} |",
        f"| of which forward + backward (s) | {', '.join(f'{x:.0f}' for x in r['forward_backward_seconds'])} |",
        f"| of which optimizer step (s) | {', '.join(f'{x:.0f}' for x in r['optimizer_seconds'])} |",
        f"| peak RSS, the report (GB) | {r['peak_rss_bytes'] / 1e9:.2f} |",
    ]
    if time_rss:
        lines.append(f"| peak RSS, `time -v` (GB) | {time_rss / 1e9:.2f} |")
    lines += [
        f"| model state in memory (GB): pieces' gradients, tile and read-ahead buffers | "
        f"{r['model_state_bytes_per_rank'] / 1e9:.2f} |",
        f"| parameter swap file (GB) | {par['disk_bytes'] / 1e9:.2f} |",
        f"| optimizer swap file (GB) | {opt['disk_bytes'] / 1e9:.2f} |",
        "",
        f"The disk's own bandwidth, measured by the same run before training (one thread, 8 MiB "
        f"`O_DIRECT` requests, {base['bytes'] / 1e9:.1f} GB of noise): write "
        f"{base['write_gb_per_s']:.3f} GB/s, read {base['read_gb_per_s']:.3f} GB/s. The swap "
        "files' GB/s below are bytes moved over the time spent in their transfers (which "
        "overlap compute, and each other: the optimizer's reads run beside its writes); "
        "the share is that rate over the disk's rate in the same direction.",
        "",
        "| swap file | read GB | read GB/s (share of the disk's) | written GB | write GB/s (share) |",
        "|---|---|---|---|---|",
    ]
    for name, sw in (("parameters", par), ("optimizer", opt)):
        lines.append(
            f"| {name} | {sw['bytes_read'] / 1e9:.1f} | {sw['read_gb_per_s']:.3f} "
            f"({sw['read_gb_per_s'] / base['read_gb_per_s']:.0%}) | {sw['bytes_written'] / 1e9:.1f} "
            f"| {sw['write_gb_per_s']:.3f} ({sw['write_gb_per_s'] / base['write_gb_per_s']:.0%}) |"
        )
    # The optimizer step's wall time against the disk's time to move its bytes at the
    # baseline rates (a step moves the whole state in and out).
    moved = opt["disk_bytes"] / 1e9
    disk_time = moved / base["read_gb_per_s"] + moved / base["write_gb_per_s"]
    steady = r["optimizer_seconds"][1:] or r["optimizer_seconds"]
    lines += [
        "",
        f"Each optimizer step reads and writes the {moved:.1f} GB optimizer state once and "
        f"writes the parameters: at the disk's rates that is {disk_time:.0f} s of transfers for "
        f"the state alone; the step took {min(steady):.0f}-{max(steady):.0f} s "
        f"({disk_time / (sum(steady) / len(steady)):.0%} of the disk's time, the overlap of "
        "reads with writes included).",
        "",
    ]
    return "\n".join(lines) + "\n"

