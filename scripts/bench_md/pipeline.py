"""The `pipeline` section of BENCHMARKS.md."""
import json


def pipeline(bench, grid_mpi, grid_threads, cores):
    b = json.load(open(bench))
    m = json.load(open(grid_mpi))
    t = json.load(open(grid_threads))
    lines = [
        "## Pipeline parallelism",
        "",
        f"`bash scripts/bench-pipeline.sh` (STEPS={b['steps']}, ROUNDS={b['rounds']}) on a machine "
        f"with {cores} CPU cores, Flex backend, fp32. Ranks beyond the core count share cores, "
        "so these figures measure the engine's overheads on a CPU, not the speed-up of "
        "dedicated devices.",
        "",
        f"### pp = 2 against dp = 2, GPT `{b['model']}` ({b['params']:,} parameters), "
        f"global batch {b['global_batch']} sequences",
        "",
        "Same process, interleaved rounds; dp = 2 runs 8 micro-batches of 2 per rank, pp = 2 "
        "one pipeline of 16 micro-batches of 2.",
        "",
        "| layout | tokens/s | ratio to dp = 2 | model state per rank, measured (B) "
        "| bytes sent per rank, measured |",
        "|---|---|---|---|---|",
        f"| dp = 2 | {b['dp2_tokens_per_s']:.0f} | 1.00 | {b['dp2_model_state_bytes_per_rank']:,} "
        f"| {', '.join(f'{x:,}' for x in b['dp2_comm_bytes_per_rank'])} |",
        f"| pp = 2 | {b['pp2_tokens_per_s']:.0f} | {b['pp2_over_dp2']:.2f} "
        f"| {b['pp2_model_state_bytes_per_rank']:,} "
        f"| {', '.join(f'{x:,}' for x in b['pp2_comm_bytes_per_rank'])} |",
        "",
        f"Measured bubble of the pp = 2 runs: {b['pp2_bubble_fraction']:.3f} "
        f"(schedule: 1/17 = {1/17:.3f}).",
        "",
        "### Bubble of 4 stages (GPT `tiny`, micro-batches of 1 sequence)",
        "",
        "Measured: 1 − (forward + backward time) / (schedule time) per stage, averaged over "
        "stages. Schedule: (S − 1)/(M + S − 1), which counts a backward as long as a forward.",
        f"Four stage ranks on {cores} cores time-share them: a stage's passes stretch while its "
        "neighbours compute and count as busy, and its waits include its neighbours' share of "
        "the cores, so the measured figure is only near the schedule's.",
        "",
        "| M | measured | schedule | peak live activations per stage | bound min(S − s, M) |",
        "|---|---|---|---|---|",
    ]
    for x in b["bubble"]:
        s, mb = x["stages"], x["micro_batches"]
        bound = [min(s - i, mb) for i in range(s)]
        lines.append(
            f"| {mb} | {x['measured']:.3f} | {x['theory']:.3f} | "
            f"{x['peak_live_activations_per_stage']} | {bound} |"
        )
    worst = max(abs(a - c) / abs(a) for a, c in zip(t["losses"], m["losses"]))
    lines += [
        "",
        f"### (pp, dp) = (2, 2) on GPT `small`: `mpirun -n 4` against 4 threads",
        "",
        "| backend | tokens/s | bubble | model state per rank, measured (B) | peak RSS (B) |",
        "|---|---|---|---|---|",
        f"| mpirun -n 4 | {m['tokens_per_s']:.0f} | {m['bubble_fraction']:.3f} | "
        f"{m['model_state_bytes_per_rank']:,} | {m['peak_rss_bytes']:,} |",
        f"| threads, 4 ranks | {t['tokens_per_s']:.0f} | {t['bubble_fraction']:.3f} | "
        f"{t['model_state_bytes_per_rank']:,} | {t['peak_rss_bytes']:,} |",
        "",
        f"Losses of the two backends agree to a maximum relative difference of {worst:.1e} "
        f"over {len(m['losses'])} steps.",
    ]
    return "\n".join(lines) + "\n"

