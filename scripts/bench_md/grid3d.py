"""The `grid3d` section of BENCHMARKS.md."""
import json


def grid3d(bench, mpi, cores):
    b = json.load(open(bench))
    m = json.load(open(mpi))
    lines = [
        "## 3D parallelism: tensor x pipeline x data",
        "",
        f"`bash scripts/bench-3d.sh` (STEPS={b['steps']}, ROUNDS={b['rounds']}) on a machine with "
        f"{cores} CPU cores, Flex backend, fp32. GPT `{b['model']}` ({b['params']:,} parameters), "
        f"{b['ranks']} thread ranks, global batch {b['train_batch_size']} sequences in micro-batches "
        "of 2, AdamW, ZeRO stage 1 on the data axis, every grid through the pipeline engine (one "
        "stage when pp = 1). Eight ranks share the cores, so the tokens/s measure the engine's "
        "overheads and each axis's traffic on a CPU, not the speed-up of dedicated devices.",
        "",
        "Same process, interleaved rounds (median tokens/s of the whole runs), ratios against "
        "tp 1 x pp 1 x dp 8 in the same process. Model state: the largest rank's parameters, "
        "gradients and optimizer state, measured where they are allocated, beside ZeRO stage 1's "
        "formula for its slice of its stage (Ψ_r = the stage's parameters / tp; 4Ψ_r + 4Ψ_r + "
        "8Ψ_r/dp). Traffic: bytes each rank sent per step along each axis, measured by the "
        "communicators, averaged over the ranks. Every grid trains the same losses.",
        "",
        "| tp | pp | dp | tokens/s | vs dp 8 | model state per rank, measured (B) | formula (B) "
        "| tensor axis (B/step) | pipe axis (B/step) | data axis (B/step) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in b["grids"]:
        lines.append(
            f"| {g['tp']} | {g['pp']} | {g['dp']} | {g['tokens_per_s']:.0f} | {g['ratio_to_dp8']:.2f} "
            f"| {g['model_state_bytes_per_rank']:,} | {g['model_state_bytes_formula']:,} "
            f"| {g['tensor_bytes_per_rank_step']:,.0f} | {g['pipe_bytes_per_rank_step']:,.0f} "
            f"| {g['data_bytes_per_rank_step']:,.0f} |"
        )
    first = b["grids"][0]["losses"]
    worst = max(
        abs(x - y) / abs(x) for g in b["grids"] for x, y in zip(first, g["losses"])
    )
    steps = m["steps"]
    axis = m["comm_bytes_per_axis"]
    per = lambda k: sum(a[k] for a in axis) / (len(axis) * steps)
    lines += [
        "",
        f"Largest relative loss difference between grids: {worst:.1e}.",
        "",
        "### (tp, pp, dp) = (2, 2, 2) under `mpirun -n 8` (examples/gpt/configs/3d.json)",
        "",
        "| tokens/s | model state per rank, measured (B) | formula (B) | peak RSS per process (B) "
        "| tensor (B/step) | pipe (B/step) | data (B/step) |",
        "|---|---|---|---|---|---|---|",
        f"| {m['tokens_per_s']:.0f} | {m['model_state_bytes_per_rank']:,} "
        f"| {m['model_state_bytes_formula']:,} | {m['peak_rss_bytes']:,} "
        f"| {per('tensor'):,.0f} | {per('pipe'):,.0f} | {per('data'):,.0f} |",
    ]
    return "\n".join(lines) + "\n"

