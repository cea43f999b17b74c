"""The `learner` section of BENCHMARKS.md."""
import json
from statistics import median
from pathlib import Path


def learner(directory, cores):
    runs = {}
    for f in sorted(Path(directory).glob("*.json")):
        r = json.load(open(f))
        name = r["strategy"] if r["stage"] is None else f"DeepSpeedStrategy, stage {r['stage']}"
        runs.setdefault((r["world"], name), []).append(r)
    if not runs:
        raise SystemExit(f"no runs in {directory}")

    any_run = next(iter(runs.values()))[0]
    rounds = max(len(v) for v in runs.values())
    lines = [
        "## Learner strategy beside Burn's `MultiDevice(OptimSharded)`",
        "",
        f"`bash scripts/bench-learner.sh` (STEPS={any_run['steps']}, ROUNDS={rounds}) on a "
        f"machine with {cores} CPU cores, Flex backend, fp32. GPT `{any_run['model']}` "
        f"({any_run['params']:,} parameters), 4 sequences per rank per step, one epoch inside "
        "`SupervisedTraining` with the Learner's AdamW (lr 1e-3). Each run is its own process, "
        "so its peak RSS (`VmHWM`) is its own; every rank or Burn device is a thread of that "
        "process, so the per-rank share is the process's peak over the world size. The "
        "configurations are interleaved round by round; the table gives each one's median. "
        "tokens/s counts training tokens over the whole `launch` (including one validation "
        "batch and the event processing, the same for all).",
        "",
        "Burn's `OptimSharded` steps each parameter on one device (chosen by its id) and keeps "
        "a full replica and full gradients on every device. It adds the devices' gradients "
        "instead of averaging them, so its trajectory (held-out loss) differs; ours equals "
        "stage 0's at every stage.",
        "",
        "Why Burn's is faster here: its devices are threads of one process sharing one "
        "address space, so a parameter's gradients are added and stepped where they lie, "
        "with no copies. Our ranks keep to SPMD as under MPI: gradients go through flat "
        "buffers and the communicator, and at stage 0 every rank steps the whole model with "
        "its own optimizer. Stage 3 holds the least: each rank stores its chunks, and only "
        "the tensor in use is whole.",
        "",
        "| world | strategy | tokens/s | ratio to Burn's | peak RSS (B) | per rank (B) "
        "| RSS ratio to Burn's | held-out loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world in sorted({w for w, _ in runs}):
        base = runs.get((world, "burn-sharded"))
        base_tps = median([r["tokens_per_s"] for r in base]) if base else None
        base_rss = median([r["peak_rss_bytes"] for r in base]) if base else None
        names = sorted((n for w, n in runs if w == world), key=lambda n: (n != "burn-sharded", n))
        for name in names:
            rs = runs[(world, name)]
            tps = median([r["tokens_per_s"] for r in rs])
            rss = int(median([r["peak_rss_bytes"] for r in rs]))
            label = "Burn `MultiDevice(OptimSharded)`" if name == "burn-sharded" else name
            ratio = f"{tps / base_tps:.2f}" if base_tps else "-"
            rss_ratio = f"{rss / base_rss:.2f}" if base_rss else "-"
            lines.append(
                f"| {world} | {label} | {tps:.0f} | {ratio} | {rss:,} | {rss // world:,} "
                f"| {rss_ratio} | {rs[0]['held_out_loss']:.4f} |"
            )
    lines.append("")
    return "\n".join(lines) + "\n"

