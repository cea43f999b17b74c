"""The `overlap` section of BENCHMARKS.md."""
import json
from statistics import median
from pathlib import Path

from .common import paired_rounds


def overlap(directory, cores):
    d = Path(directory)
    t = json.load(open(d / "threads.json"))
    lines = [
        "## `overlap_comm` at ZeRO stage 2",
        "",
        f"`bash scripts/bench-overlap.sh` on a machine with {cores} CPU cores, Flex, fp32: GPT "
        f"`{t['model']}`, {t['ranks']} data-parallel ranks, a global batch of {t['batch']} "
        f"sequences in {t['accumulation']} micro-batches per step, AdamW, buckets of 5e5 "
        "elements. Off, each micro-batch's buckets are reduce-scattered by the rank thread right "
        "after its backward; on, by the rank's communication thread while the rank runs the next "
        "micro-batch (the last one's are waited for at the step). Tokens/s are measured over "
        f"{t['steps'] - 1} steps per run (the first is untimed), medians of {t['rounds']} runs "
        "of each, off and on alternating. `accumulate` is the slowest rank thread's time "
        "handing gradients over, per step (off: staging, reducing and waiting for the other "
        "rank; on: staging only). Both compute the same steps: the loss columns give the "
        "largest difference between them.",
        "",
        "| ranks | MPI polling | overlap_comm | tokens/s | on / off | accumulate (ms/step) "
        "| peak model state per rank (MB) | max loss difference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    off_tps = t["rows"][0]["tokens_per_s"]
    for row in t["rows"]:
        ratio = "1.00" if row["overlap_comm"] == "off" else f"{t['ratio_on_over_off']:.3f}"
        diff = f"{t['max_loss_diff']:.1e}" if row["overlap_comm"] == "on" else ""
        lines.append(
            f"| threads | | {row['overlap_comm']} | {row['tokens_per_s']:.0f} | {ratio} | "
            f"{row['accumulate_ms_per_step']:.1f} | "
            f"{row['peak_model_state_bytes_per_rank'] / 1e6:.1f} | {diff} |"
        )
    seq = 256 if t["model"] == "small" else 128

    def timed(r):
        secs = [s * r["train_batch_size"] for s in r["step_seconds_per_sample"][1:]]
        return len(secs) * r["train_batch_size"] * seq / sum(secs)

    ratios = {}
    for y, polling in [(0, "busy (default)"), (1, "`mpi_yield_when_idle`")]:
        runs = {}
        for ov in ["false", "true"]:
            runs[ov] = [
                json.load(open(f))
                for f in sorted(d.glob(f"mpi-yield{y}-{ov}-*.json"))
                if f.stat().st_size > 0
            ]
        if not runs["false"] or not runs["true"]:
            continue
        # Paired by round: on over off within the same round.
        paired, diff = paired_rounds(runs, timed)
        ratios[polling] = paired
        for ov in ["false", "true"]:
            rs = runs[ov]
            tps = median(timed(r) for r in rs)
            acc = median(
                max(b["accumulate"] for b in r["breakdown_per_rank"]) for r in rs
            )
            name = "on" if ov == "true" else "off"
            ratio = "1.00" if ov == "false" else f"{median(paired):.3f}"
            peak = rs[-1]["peak_model_state_bytes_per_rank"] / 1e6
            lines.append(
                f"| `mpirun -n 2` | {polling} | {name} | {tps:.0f} | {ratio} | {acc:.1f} | "
                f"{peak:.1f} | {'' if ov == 'false' else f'{diff:.1e}'} |"
            )
    lines += [
        "",
        "Under `mpirun` the ratio is the median of the rounds' own on/off ratios "
        + "; ".join(
            f"{k}: " + ", ".join(f"{x:.3f}" for x in v) for k, v in ratios.items()
        )
        + ". Thread ranks, per round: off "
        + ", ".join(f"{x:.0f}" for x in t["rows"][0]["tokens_per_s_rounds"])
        + ", on "
        + ", ".join(f"{x:.0f}" for x in t["rows"][1]["tokens_per_s_rounds"])
        + f" tokens/s (off median {off_tps:.0f}).",
    ]
    return "\n".join(lines) + "\n"



def overlap3(directory, cores):
    d = Path(directory)
    t = json.load(open(d / "threads3.json"))
    seq = 256 if t["model"] == "small" else 128
    lines = [
        "## `overlap_comm` at ZeRO stage 3: parameter prefetch on the communication thread",
        "",
        f"`bash scripts/bench-overlap.sh` on a machine with {cores} CPU cores, Flex, fp32: GPT "
        f"`{t['model']}`, {t['ranks']} data-parallel ranks, a global batch of {t['batch']} "
        f"sequences in {t['accumulation']} micro-batch(es) per step, AdamW, prefetch bundles "
        "of up to 5e5 elements and every tensor partitioned (as "
        "`examples/gpt/configs/zero3.json`, which the `mpirun` rows run). Off, the forward all-gathers a prefetch bundle on the "
        "rank thread when its first tensor is needed; on (DeepSpeed's default at stage 3), the "
        "next bundle is all-gathered on the rank's communication thread while the current "
        "layer computes. The backward's re-gathers and reduce-scatters stay on the rank thread. "
        f"Tokens/s are measured over {t['steps'] - 1} steps per run (the first is untimed), "
        f"medians of {t['rounds']} runs of each, off and on alternating. Both compute the same "
        "steps: the loss column gives the largest difference between them.",
        "",
        "| ranks | overlap_comm | tokens/s | on / off | bundles gathered ahead per run | max loss difference |",
        "|---|---|---|---|---|---|",
    ]
    for row in t["rows"]:
        on = row["overlap_comm"] == "on"
        ratio = f"{t['ratio_on_over_off']:.3f}" if on else "1.00"
        ahead = t.get("gathered_ahead") if on else 0
        diff = f"{t['max_loss_diff']:.1e}" if on else ""
        lines.append(
            f"| threads | {row['overlap_comm']} | {row['tokens_per_s']:.0f} | {ratio} | "
            f"{ahead} | {diff} |"
        )

    def timed(r):
        secs = [x * r["train_batch_size"] for x in r["step_seconds_per_sample"][1:]]
        return len(secs) * r["train_batch_size"] * seq / sum(secs)

    ratios = {}
    for prefix, polling in [("mpi3", "busy (default)"), ("mpi3y", "`mpi_yield_when_idle`")]:
        runs = {
            ov: [
                json.load(open(f))
                for f in sorted(d.glob(f"{prefix}-{ov}-*.json"))
                if f.stat().st_size > 0
            ]
            for ov in ["false", "true"]
        }
        if not runs["false"] or not runs["true"]:
            continue
        paired, diff = paired_rounds(runs, timed)
        ratios[polling] = paired
        for ov in ["false", "true"]:
            rs = runs[ov]
            tps = median(timed(r) for r in rs)
            name = "on" if ov == "true" else "off"
            ratio = "1.00" if ov == "false" else f"{median(paired):.3f}"
            ahead = rs[-1]["gather_stats"]["gathered_ahead"]
            lines.append(
                f"| `mpirun -n 2`, {polling} | {name} | {tps:.0f} | {ratio} | {ahead} | "
                f"{'' if ov == 'false' else f'{diff:.1e}'} |"
            )
    lines += [
        "",
        "Per round, thread ranks: off "
        + ", ".join(f"{x:.0f}" for x in t["rows"][0]["tokens_per_s_rounds"])
        + ", on "
        + ", ".join(f"{x:.0f}" for x in t["rows"][1]["tokens_per_s_rounds"])
        + " tokens/s"
        + "".join(
            f"; `mpirun` ({k}), on/off within each round: " + ", ".join(f"{x:.3f}" for x in v)
            for k, v in ratios.items()
        )
        + ". Under `mpirun` each rank is bound to one core, and OpenMPI's busy polling inside "
        "the communication thread's all-gather takes that core from the forward; with "
        "`mpi_yield_when_idle` the waiting thread yields, as for stage 2's overlap.",
    ]
    return "\n".join(lines) + "\n"

