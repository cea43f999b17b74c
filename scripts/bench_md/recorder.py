"""The `recorder` section of BENCHMARKS.md (prose: templates/recorder.md)."""
import json
import statistics
from pathlib import Path

from .common import render


def recorder(directory, cores):
    d = Path(directory)
    setup = json.load(open(d / "setup.json"))
    runs = {
        entries: [json.load(open(p)) for p in sorted(d.glob(f"entries{entries}_round*.json"))]
        for entries in (0, 2000)
    }
    speeds = {k: [r["tokens_per_s"] for r in v] for k, v in runs.items()}
    median = {k: statistics.median(v) for k, v in speeds.items()}
    rows = "\n".join(
        f"| {'off' if k == 0 else f'on, {k} entries'} | {median[k]:.0f} "
        f"| {min(speeds[k]):.0f} to {max(speeds[k]):.0f} "
        f"| {median[k] / median[0]:.3f} | {runs[k][0]['losses'][-1]:.4f} |"
        for k in (0, 2000)
    )
    overlap = max(min(v) for v in speeds.values()) <= min(max(v) for v in speeds.values())
    verdict = (
        "the two ranges overlap: the recorder's cost is below this machine's run-to-run spread"
        if overlap else "the ranges do not overlap"
    )
    return render(
        "recorder", setup=setup, cores=cores, rows=rows,
        ratio=median[2000] / median[0], verdict=verdict,
        same="yes" if runs[0][0]["losses"] == runs[2000][0]["losses"] else "no",
    )
