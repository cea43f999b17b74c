"""The `offload` section of BENCHMARKS.md."""
import json
from pathlib import Path


def offload(directory, cores):
    d = Path(directory)
    s = json.load(open(d / "swap.json"))
    g = {k: json.load(open(d / f"gpt_{k}.json")) for k in ("none", "nvme")}
    gb = s["state_bytes"] / 1e9
    lines = [
        "## ZeRO-Offload and ZeRO-Infinity",
        "",
        f"`bash scripts/bench-offload.sh` on a machine with {cores} CPU cores; swap files in "
        "the system's temp folder (ext4 on a virtual disk here).",
        "",
        f"### The swapper against the disk, one optimizer state of {gb:.2f} GB "
        f"({s['elements']:,} elements of fp32 masters, m and v, tiles of {s['tile']:,})",
        "",
        "The disk's own bandwidth: one thread writing, then reading, the same number of bytes "
        "sequentially in 8 MiB `O_DIRECT` requests, one at a time (`dd oflag=direct bs=8M`), "
        "measured in the same run. A swap pass reads and writes every tile back (no work on "
        "it), pipelined, with DeepSpeed's `aio` defaults (1 MiB requests, 8 in flight). Its "
        "efficiency is the disk's time to read and write the state at the rates above, over "
        "the pass's wall time: above 1 means that the swapper's requests in flight, and its "
        "reads beside its writes, move bytes faster than one sequential stream does. All data "
        "is incompressible noise, since a virtual disk may store zeros without moving them. "
        f"Median of {s['reps']}.",
        "",
        "| what | engine | seconds | GB/s | efficiency |",
        "|---|---|---|---|---|",
        f"| disk write, `O_DIRECT` 8 MiB | pwrite | {s['state_bytes'] / 1e9 / s['raw_write_gb_per_s']:.2f} "
        f"| {s['raw_write_gb_per_s']:.3f} | |",
        f"| disk read, `O_DIRECT` 8 MiB | pread | {s['state_bytes'] / 1e9 / s['raw_read_gb_per_s']:.2f} "
        f"| {s['raw_read_gb_per_s']:.3f} | |",
    ]
    for p in s["swap_passes"]:
        lines.append(
            f"| swap pass (read + write back) | {p['engine']} | {p['seconds']:.2f} "
            f"| {p['read_write_gb_per_s']:.3f} (read + written) | {p['efficiency']:.2f} |"
        )
    lines += [
        f"| Adam step from the swap file | {s['adam_swapped_engine']} "
        f"| {s['adam_swapped_seconds']:.2f} | | {s['adam_swapped_efficiency']:.2f} |",
        f"| Adam step in memory | | {s['adam_in_memory_seconds']:.2f} | | |",
        "",
        f"### GPT `small` at ZeRO stage 3, {g['none']['world']} thread ranks, "
        f"{g['none']['steps']} steps of {g['none']['train_batch_size']} sequences",
        "",
        "Model state in memory per rank is measured where it is allocated (the largest over "
        "ranks). With `nvme` the optimizer holds only its tile buffers (three tiles of "
        "`sub_group_size` 500,000 elements, pipelined), and the swap file (rank 0's) holds fp32 "
        "masters, m and v. On a model this small, the tile buffers are close to the m and v "
        "they replace, so memory barely drops. Swap GB/s is bytes moved over the time spent "
        "in transfers, which overlap the step. Six steps on a shared 2-core machine: tokens/s "
        "varies by about 10% from run to run.",
        "",
        "| `offload_optimizer` | tokens/s | model state in memory per rank (B) "
        "| swap file (B) | swap read / write GB/s | final loss |",
        "|---|---|---|---|---|---|",
    ]
    for k in ("none", "nvme"):
        r = g[k]
        sw = r.get("swap")
        swap_cols = (
            f"{sw['disk_bytes']:,} | {sw['read_gb_per_s']:.3f} / {sw['write_gb_per_s']:.3f}"
            if sw else " | "
        )
        lines.append(
            f"| {k} | {r['tokens_per_s']:.0f} | {r['model_state_bytes_per_rank']:,} "
            f"| {swap_cols} | {r['losses'][-1]:.4f} |"
        )
    same = g["none"]["losses"] == g["nvme"]["losses"]
    lines += [
        "",
        f"Losses identical with and without offload: {'yes' if same else 'no'}.",
        "",
    ]
    return "\n".join(lines) + "\n"

