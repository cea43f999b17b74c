"""The `pipeline` section of BENCHMARKS.md (prose: templates/pipeline.md)."""
import json

from .common import render


def pipeline(bench, grid_mpi, grid_threads, cores):
    b = json.load(open(bench))
    m = json.load(open(grid_mpi))
    t = json.load(open(grid_threads))
    bubble_rows = []
    for x in b["bubble"]:
        s, mb = x["stages"], x["micro_batches"]
        bound = [min(s - i, mb) for i in range(s)]
        bubble_rows.append(
            f"| {mb} | {x['measured']:.3f} | {x['theory']:.3f} | "
            f"{x['peak_live_activations_per_stage']} | {bound} |"
        )
    worst = max(abs(a - c) / abs(a) for a, c in zip(t["losses"], m["losses"]))
    return render(
        "pipeline", b=b, m=m, t=t, cores=cores,
        dp2_bytes=", ".join(f"{x:,}" for x in b["dp2_comm_bytes_per_rank"]),
        pp2_bytes=", ".join(f"{x:,}" for x in b["pp2_comm_bytes_per_rank"]),
        bubble_rows="\n".join(bubble_rows), worst=worst, steps=len(m["losses"]),
    )
