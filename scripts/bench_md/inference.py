"""The `inference` section of BENCHMARKS.md."""
import json
from pathlib import Path


def inference(directory, new, cores):
    d = Path(directory)
    runs = [(f"threads, tp {tp}", json.load(open(d / f"threads-{tp}.json"))) for tp in (1, 2, 4)]
    runs.append(("mpirun -n 2, tp 2", json.load(open(d / "mpi-2.json"))))
    lines = [
        "## Inference: generation from key/value caches",
        "",
        f"`bash scripts/bench-inference.sh` (NEW={new}) on a machine with {cores} CPU cores, Flex "
        f"backend, fp32. GPT `small` (seed-initialized: the speed does not depend on training), "
        f"4 prompts of one byte, {new} new tokens each (the context is 256), greedy. Each run "
        "also generates by full recomputation (the whole sequences again for every token, no "
        "cache) in the same process: the ratio is decode from the caches over that, and the "
        "tokens must be the same. Ranks beyond the core count share the cores.",
        "",
        "| run | prefill tokens/s | decode tokens/s | recompute tokens/s | decode / recompute "
        "| first token (s) | per token p50 (s) | p99 (s) | weight bytes per rank | cache bytes per rank "
        "| same tokens as recompute |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    first = runs[0][1]["tokens"]
    for name, r in runs:
        lines.append(
            f"| {name} | {r['prefill_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.0f} "
            f"| {r['recompute_tokens_per_s']:.1f} "
            f"| {r['decode_tokens_per_s'] / r['recompute_tokens_per_s']:.1f} "
            f"| {r['time_to_first_token_s']:.4f} | {r['token_latency_p50_s']:.4f} "
            f"| {r['token_latency_p99_s']:.4f} | {r['weight_bytes_per_rank']:,} "
            f"| {r['cache_bytes_per_rank']:,} | {r['matches_recompute']} |"
        )
    same = all(r["tokens"] == first for _, r in runs)
    lines += [
        "",
        f"Every run generated the same tokens as tp 1: {same}.",
    ]
    return "\n".join(lines) + "\n"

