"""The `zero` section of BENCHMARKS.md (prose: templates/zero.md, zero-medium.md)."""
import json
from pathlib import Path

from .common import PATH, render
from .svg import grouped_bars

PLOT = PATH.parent / "docs" / "plots" / "zero-model-state.svg"


def zero(directory, cores):
    d = Path(directory)
    b = json.load(open(d / "bench.json"))
    rows = []
    for r in b["rows"]:
        n, s = r["world"], r["stage"]
        held, formula = r["model_state_bytes_per_rank"], r["model_state_bytes_formula"]
        rows.append(
            f"| {n} | {s} | {r['tokens_per_s']:.0f} | {r['ratio_to_stage0']:.3f} "
            f"| {r['bytes_per_step']:,} | {r['ring_model_bytes_per_step']:,} "
            f"| {r['paper_bytes_per_step']:,.0f} | {held:,} | {formula:,} "
            f"| {held / formula:.3f} | {r['peak_model_state_bytes_per_rank']:,} |"
        )
    mpi_rows = []
    for f in sorted(d.glob("mpi-stage*.json")):
        r = json.load(open(f))
        mpi_rows.append(f"| {r['zero_stage']} | {r['peak_rss_bytes']:,} | "
                        f"{r['model_state_bytes_per_rank']:,} |")
    medium = ""
    runs = {s: d / f"mpi-medium-stage{s}.json" for s in (0, 3)}
    if all(p.exists() for p in runs.values()):
        r0, r3 = (json.load(open(runs[s])) for s in (0, 3))
        psi, n = r0["params"], r0["world"]
        predicted = 16 * psi - 16 * psi / n
        saved = r0["peak_rss_bytes"] - r3["peak_rss_bytes"]
        medium_rows = [
            f"| {r['zero_stage']} | {r['peak_rss_bytes']:,} "
            f"| {r['model_state_bytes_per_rank']:,} "
            f"| {r['peak_model_state_bytes_per_rank']:,} |"
            for r in (r0, r3)
        ]
        medium = "\n\n" + render(
            "zero-medium", params=psi, rows="\n".join(medium_rows), saved=saved,
            predicted=predicted, share=saved / predicted,
        ).rstrip("\n")
    return render(
        "zero", steps=b["steps"], rounds=b["rounds"], cores=cores, model=b["model"],
        params=b["rows"][0]["params"], batch=b["batch"], rows="\n".join(rows),
        mpi_rows="\n".join(mpi_rows), medium=medium,
    )


def zero_plot(directory):
    """The model state per rank at each world size and stage, measured against ZeRO's formula,
    as `docs/plots/zero-model-state.svg` (BENCHMARKS.md and the README show it)."""
    rows = json.load(open(Path(directory) / "bench.json"))["rows"]
    plot_rows(rows)


def plot_rows(rows):
    """[`zero_plot`] from the bench's rows (each with `world`, `stage` and the two byte counts)."""
    grouped_bars(
        PLOT,
        "Model state per rank, GPT small, fp32 (measured against ZeRO's formula)",
        [f"N={r['world']}\nstage {r['stage']}" for r in rows],
        [("measured", [r["model_state_bytes_per_rank"] for r in rows]),
         ("ZeRO formula", [r["model_state_bytes_formula"] for r in rows])],
        "MB per rank",
        scale=1e6,
    )
