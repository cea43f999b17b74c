"""The `zero` section of BENCHMARKS.md."""
import json
from pathlib import Path


def zero(directory, cores):
    d = Path(directory)
    b = json.load(open(d / "bench.json"))
    lines = [
        "## ZeRO stages",
        "",
        f"`bash scripts/bench-zero.sh` (STEPS={b['steps']}, ROUNDS={b['rounds']}) on a machine "
        f"with {cores} CPU cores, Flex backend, fp32, GPT `{b['model']}` "
        f"({b['rows'][0]['params']:,} parameters), global batch {b['batch']} sequences, AdamW, "
        "thread ranks. The stages run interleaved, round by round, in one process; tokens/s "
        "counts every step but the first (warm-up), averaged over the rounds. Ranks beyond the "
        "core count share cores: the ratios measure the engine's overheads, not a speed-up. "
        "Stages 1 and 2 come out faster than stage 0 because each rank steps only its 1/N "
        "slice, with the fused CPU AdamW, where stage 0 runs Burn's AdamW on every tensor. "
        "Stage 3 runs with `stage3_param_persistence_threshold` 0 (every tensor partitioned) "
        "and a prefetch bucket of 5e5 elements; it pays for gathering every weight twice per "
        "micro-batch and for Burn's gradient checkpointing, which recomputes the memory-bound "
        "ops in the backward.",
        "",
        "Every byte and memory figure is labelled: *measured* figures are counted where the "
        "bytes move or are allocated (the transport's copies; the tensors and buffers a rank "
        "holds), *modelled* ones come from a formula applied to the same run.",
        "",
        "| world | stage | tokens/s | over stage 0 | bytes sent per rank per step, measured "
        "| ring model | paper's volume (modelled) | model state per rank, measured (B) "
        "| ZeRO formula (B) | measured / formula | in-step peak, measured (B) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in b["rows"]:
        n, s = r["world"], r["stage"]
        held, formula = r["model_state_bytes_per_rank"], r["model_state_bytes_formula"]
        lines.append(
            f"| {n} | {s} | {r['tokens_per_s']:.0f} | {r['ratio_to_stage0']:.3f} "
            f"| {r['bytes_per_step']:,} | {r['ring_model_bytes_per_step']:,} "
            f"| {r['paper_bytes_per_step']:,.0f} | {held:,} | {formula:,} "
            f"| {held / formula:.3f} | {r['peak_model_state_bytes_per_rank']:,} |"
        )
    lines += [
        "",
        "Measured bytes are what the thread transport copied for rank 0: an all-reduce copies "
        "the whole buffer in and out (n, whatever N), a reduce-scatter the whole input, an "
        "all-gather the rank's chunk. The ring model applies 2(N−1)/N n to the same calls; the "
        "paper's volume is 2(N−1)/N Ψ fp32 values per step for stages 0-2 and 3(N−1)/N Ψ for "
        "stage 3. The ZeRO formula is 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N or 16Ψ/N (fp32 parameters, "
        "gradients, m, v); stage 3 measures a little more because its chunks are padded. The "
        "in-step peak adds the transient buffers (backward's gradient tensors, a reduction "
        "bucket, stage 3's gathered weights) when they are allocated.",
        "",
        "### Peak RSS under `mpirun -n 2` (GPT `small`, 3 steps)",
        "",
        "Activations and the allocator dominate RSS at this size; the model-state column "
        "is what ZeRO partitions. Both are measured.",
        "",
        "| stage | peak RSS per process (B) | model state per rank, measured (B) |",
        "|---|---|---|",
    ]
    for f in sorted(d.glob("mpi-stage*.json")):
        r = json.load(open(f))
        lines.append(f"| {r['zero_stage']} | {r['peak_rss_bytes']:,} | "
                     f"{r['model_state_bytes_per_rank']:,} |")
    runs = {s: d / f"mpi-medium-stage{s}.json" for s in (0, 3)}
    if all(p.exists() for p in runs.values()):
        r0, r3 = (json.load(open(runs[s])) for s in (0, 3))
        psi, n = r0["params"], r0["world"]
        predicted = 16 * psi - 16 * psi / n
        saved = r0["peak_rss_bytes"] - r3["peak_rss_bytes"]
        lines += [
            "",
            f"### Peak RSS under `mpirun -n 2`, GPT `medium` ({psi:,} parameters, 2 steps, "
            "batch 2)",
            "",
            "| stage | peak RSS per process (B) | model state per rank, measured (B) "
            "| in-step peak of model state, measured (B) |",
            "|---|---|---|---|",
        ]
        for r in (r0, r3):
            lines.append(f"| {r['zero_stage']} | {r['peak_rss_bytes']:,} "
                         f"| {r['model_state_bytes_per_rank']:,} "
                         f"| {r['peak_model_state_bytes_per_rank']:,} |")
        lines += [
            "",
            f"Stage 3 saves {saved:,} B of peak RSS per process (measured); the formula "
            f"predicts 16Ψ − 16Ψ/N = {predicted:,.0f} B (modelled), so {saved / predicted:.1%} "
            "of it shows in RSS.",
        ]
    return "\n".join(lines) + "\n"

