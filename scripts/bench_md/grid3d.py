"""The `3d` section of BENCHMARKS.md (prose: templates/grid3d.md)."""
import json

from .common import render


def grid3d(bench, mpi, cores):
    b = json.load(open(bench))
    m = json.load(open(mpi))
    rows = []
    for g in b["grids"]:
        rows.append(
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
    return render("grid3d", b=b, m=m, cores=cores, rows="\n".join(rows), worst=worst,
                  tensor=per("tensor"), pipe=per("pipe"), data=per("data"))
