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
        "slow-links", setup=setup, cores=cores, rows="\n".join(rows), extras=extras(d),
        head=f"| run |{head_rates} bytes/step across nodes | bytes/step inside nodes "
             f"| vs baseline | mean loss, last 20 of {setup['loss_steps']} | vs baseline |",
        rule=rule, zeropp_vs_fp16=fp16 / zeropp,
    )


def extras(d):
    """The extra runs beside the section, when their folders exist: stage 3 on a larger model
    (`<section>-small`: bytes per step at one rate) and longer loss runs (`<section>-long`)."""
    out = []
    small = Path(f"{d}-small")
    if small.exists():
        setup = json.load(open(small / "setup.json"))
        rate = setup["rates"].split()[-1]
        load = lambda name: json.load(open(small / f"{name}.json"))
        between = setup["steps"] - 1
        per_step = lambda name, where: (load(f"{rate}-{name}.bytes")[where]
                                        - load(f"one-{name}.bytes")[where]) / between
        out.append(
            f"GPT `{setup['model']}` at stage 3, {setup['steps']} steps at {rate} (`MODEL="
            f"{setup['model']} NAMES=\"s3 s3-fp16 s3-zeropp\" RATES={rate} LOSS_STEPS=0 "
            f"OUT=<target>/bench-slow-links-small`), bytes per step as above (these runs "
            f"measure bytes only):\n\n"
            "| run | bytes/step across nodes | bytes/step inside nodes "
            "| across nodes vs fp32 | across nodes vs fp16 |\n|---|---|---|---|---|")
        for name, label, _ in ROWS[:2] + ROWS[5:6]:
            links = per_step(name, "links")
            out.append(
                f"| {label} | {links:,.0f} "
                f"| {per_step(name, 'nodes'):,.0f} | {per_step('s3', 'links') / links:.2f}x "
                f"| {per_step('s3-fp16', 'links') / links:.2f}x |")
        out.append("")
    long = Path(f"{d}-long")
    if long.exists():
        setup = json.load(open(long / "setup.json"))
        steps = setup["loss_steps"]
        losses = {n: json.load(open(long / f"loss-{n}.json"))["losses"] for n in ("s3", "s3-zeropp")}
        base, zpp = last20(losses["s3"]), last20(losses["s3-zeropp"])
        out.append(
            f"Over {steps} steps (`NAMES=\"s3 s3-zeropp\" RATES=\"\" LOSS_STEPS={steps} "
            f"OUT=<target>/bench-slow-links-long`, GPT `{setup['model']}`): the mean loss of "
            f"the last 20 steps is {base:.4f} for plain stage 3 and {zpp:.4f} with all three "
            f"parts of ZeRO++ ({(zpp - base) / base:+.2%}); at step {steps} "
            f"{losses['s3'][-1]:.4f} and {losses['s3-zeropp'][-1]:.4f}.\n")
    return "\n".join(out)
