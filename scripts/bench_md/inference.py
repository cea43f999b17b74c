"""The `inference` section of BENCHMARKS.md (prose: templates/inference.md)."""
import json
from pathlib import Path

from .common import render


def inference(directory, new, cores):
    d = Path(directory)
    runs = [(f"threads, tp {tp}", json.load(open(d / f"threads-{tp}.json"))) for tp in (1, 2, 4)]
    runs.append(("mpirun -n 2, tp 2", json.load(open(d / "mpi-2.json"))))
    rows = []
    first = runs[0][1]["tokens"]
    for name, r in runs:
        rows.append(
            f"| {name} | {r['prefill_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.0f} "
            f"| {r['recompute_tokens_per_s']:.1f} "
            f"| {r['decode_tokens_per_s'] / r['recompute_tokens_per_s']:.1f} "
            f"| {r['time_to_first_token_s']:.4f} | {r['token_latency_p50_s']:.4f} "
            f"| {r['token_latency_p99_s']:.4f} | {r['weight_bytes_per_rank']:,} "
            f"| {r['cache_bytes_per_rank']:,} | {r['matches_recompute']} |"
        )
    same = all(r["tokens"] == first for _, r in runs)
    return render("inference", new=new, cores=cores, rows="\n".join(rows), same=same)
