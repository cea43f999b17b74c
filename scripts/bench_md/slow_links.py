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
    (`<section>-small`: bytes per step at one rate), the same model with less compute per step
    (`<section>-bound`) and longer loss runs (`<section>-long`)."""
    out = []
    small = Path(f"{d}-small")
    if small.exists():
        setup = json.load(open(small / "setup.json"))
        rate = setup["rates"].split()[-1]
        per_step = lambda name, where: bytes_per_step(small, setup, rate, name, where)
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
    bound = Path(f"{d}-bound")
    if bound.exists():
        out.append(bound_table(bound))
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


def bound_table(folder):
    """Tokens/s at each rate and bytes across nodes with less compute per step (a few short
    sequences), each run against its uncompressed baseline."""
    setup = json.load(open(folder / "setup.json"))
    rates = setup["rates"].split()
    names = setup["names"].split()
    links = lambda name: bytes_per_step(folder, setup, rates[-1], name, "links")
    speed = lambda rate, name: json.load(open(folder / f"{rate}-{name}.json"))["tokens_per_s"]
    head = "".join(f" tokens/s at {r} | vs baseline |" for r in rates)
    lines = [
        f"Less compute per step: GPT `{setup['model']}` with {setup['batch']} sequences of "
        f"{setup['seq_len']} positions per step (one per rank), {setup['steps']} steps "
        f"(`MODEL={setup['model']} BATCH={setup['batch']} SEQ_LEN={setup['seq_len']} "
        f"STEPS={setup['steps']} "
        f"NAMES=\"{setup['names']}\" RATES=\"{setup['rates']}\" LOSS_STEPS=0 "
        f"OUT=<target>/bench-slow-links-bound`), so that the model's bytes weigh more "
        f"against a step's compute, as on nodes faster than these cores. Bytes per step as "
        f"above, at {rates[-1]}:\n",
        f"| run |{head} bytes/step across nodes | vs baseline |",
        "|---|" + "---|---|" * len(rates) + "---|---|",
    ]
    for name, label, base in ROWS:
        if name not in names:
            continue
        paired = base is not None and base in names
        cells = [label]
        for rate in rates:
            ratio = f"{speed(rate, name) / speed(rate, base):.2f}x" if paired else ""
            cells += [f"{speed(rate, name):.0f}", ratio]
        cells += [f"{links(name):,.0f}", f"{links(base) / links(name):.2f}x" if paired else ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def bytes_per_step(folder, setup, rate, name, where):
    """Bytes per step of an extra folder's run at `rate` (`links` or `nodes`): the timed run's
    less the one-step run's, which share a run's start and end, over the steps between."""
    load = lambda tag: json.load(open(folder / f"{tag}-{name}.bytes.json"))[where]
    return (load(rate) - load("one")) / (setup["steps"] - 1)
