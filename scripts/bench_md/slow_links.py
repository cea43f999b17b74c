"""The `slow-links` section of BENCHMARKS.md (prose: templates/slow-links.md)."""
import json
from pathlib import Path

from .common import last20, render

# (run, label, the uncompressed baseline its losses and bytes are compared with)
ROWS = [
    ("s3", "stage 3, fp32", None),
    ("s3-fp16", "stage 3, fp16", None),
    ("s3-qwz", "stage 3 + qwZ", "s3"),
    ("s3-hpz", "stage 3 + hpZ (nodes of 2)", "s3"),
    ("s3-qgz", "stage 3 + qgZ", "s3"),
    ("s3-zeropp", "stage 3 + qwZ + hpZ + qgZ", "s3"),
    ("adam", "stage 0, Adam", None),
    ("onebit_adam", "stage 0, 1-bit Adam", "adam"),
    ("zero_one_adam", "stage 0, 0/1 Adam", "adam"),
    ("lamb", "stage 0, LAMB", None),
    ("onebit_lamb", "stage 0, 1-bit LAMB", "lamb"),
]


def slow_links(directory, cores):
    d = Path(directory)
    setup = json.load(open(d / "setup.json"))
    rates = list(setup["rates"].split())
    load = lambda name: json.load(open(d / f"{name}.json"))
    tags = rates + ["one", "loss"]
    # Per tag (a rate, the one-step runs, the loss runs), per row: the summary and the bytes.
    run = [{name: load(f"{tag}-{name}") for name, _, _ in ROWS} for tag in tags]
    moved = [{name: load(f"{tag}-{name}.bytes") for name, _, _ in ROWS} for tag in tags]
    # Per step: the last rate's timed run less the one-step run at the same shaping, which
    # share the start and end of a run, over the steps between them.
    between = setup["steps"] - 1
    timed, one = len(rates) - 1, len(rates)
    per_step = lambda name, where: (moved[timed][name][where] - moved[one][name][where]) / between
    rows = []
    for name, label, base in ROWS:
        cells = [label]
        for i in range(len(rates)):
            s = run[i][name]["tokens_per_s"]
            ratio = f"{s / run[i][base]['tokens_per_s']:.2f}x" if base else ""
            cells += [f"{s:.0f}", ratio]
        links = per_step(name, "links")
        cells.append(f"{links:,.0f}")
        cells.append(f"{per_step(name, 'nodes'):,.0f}")
        cells.append(f"{per_step(base, 'links') / links:.2f}x" if base else "")
        loss = last20(run[-1][name]["losses"])
        if base:
            b = last20(run[-1][base]["losses"])
            cells += [f"{loss:.4f}", f"{(loss - b) / b:+.2%}"]
        else:
            cells += [f"{loss:.4f}", ""]
        rows.append("| " + " | ".join(cells) + " |")
    head_rates = "".join(f" tokens/s at {r} | vs baseline |" for r in rates)
    rule = "|---|" + "---|---|" * len(rates) + "---|---|---|---|---|"
    zeropp, fp16 = per_step("s3-zeropp", "links"), per_step("s3-fp16", "links")
    return render(
        "slow-links", setup=setup, cores=cores, rows="\n".join(rows),
        head=f"| run |{head_rates} bytes/step across nodes | bytes/step inside nodes "
             f"| vs baseline | mean loss, last 20 of {setup['loss_steps']} | vs baseline |",
        rule=rule, zeropp_vs_fp16=fp16 / zeropp,
    )
