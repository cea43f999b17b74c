"""The `learner` section of BENCHMARKS.md (prose: templates/learner.md)."""
import json
from statistics import median
from pathlib import Path

from .common import render


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
    rows = []
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
            rows.append(
                f"| {world} | {label} | {tps:.0f} | {ratio} | {rss:,} | {rss // world:,} "
                f"| {rss_ratio} | {rs[0]['held_out_loss']:.4f} |"
            )
    return render(
        "learner", steps=any_run["steps"], rounds=rounds, cores=cores, model=any_run["model"],
        params=any_run["params"], rows="\n".join(rows),
    )

