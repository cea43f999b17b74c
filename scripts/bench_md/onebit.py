"""The `onebit` section of BENCHMARKS.md (prose: templates/onebit.md)."""
import json
from pathlib import Path

from .common import last20, render
from .svg import lines, running_mean

PLOT = Path(__file__).resolve().parents[2] / "docs" / "plots" / "onebit-loss.svg"


def onebit(directory, freeze, cores):
    d = Path(directory)
    runs = {n: json.load(open(d / f"{n}.json")) for n in
            ["default", "onebit_adam", "lamb", "onebit_lamb"]}
    pld = json.load(open(d / "pld.json"))
    freeze = int(freeze)
    base = runs["default"]
    rows = []
    pairs = [("default", "Adam (AdamW mode)", None), ("onebit_adam", "OneBitAdam", "default"),
             ("lamb", "LAMB", None), ("onebit_lamb", "OneBitLamb", "lamb")]
    for key, label, ref in pairs:
        r = runs[key]
        loss = last20(r["losses"])
        per = r["comm_bytes_per_step"]
        total = r["comm_bytes_per_rank"][0]
        if ref is None:
            rows.append(f"| {label} | {loss:.4f} | | {per[-1]:,} | | | {total:,} | |")
        else:
            b = runs[ref]
            rel = (loss - last20(b["losses"])) / last20(b["losses"])
            warm = per[freeze - 1]
            comp = per[-1]
            rows.append(
                f"| {label} | {loss:.4f} | {rel:+.2%} | {warm:,} | {comp:,} | "
                f"{b['comm_bytes_per_step'][-1] / comp:.1f}x | {total:,} | "
                f"{b['comm_bytes_per_rank'][0] / total:.2f}x |"
            )
    return render("onebit", base=base, pld=pld, cores=cores, freeze=freeze, rows="\n".join(rows))


def onebit_plot(directory, freeze):
    """The loss curves of the four optimizer runs (a running mean of 10 steps), as
    `docs/plots/onebit-loss.svg`."""
    d = Path(directory)
    names = [("default", "Adam"), ("onebit_adam", "1-bit Adam"), ("lamb", "LAMB"),
             ("onebit_lamb", "1-bit LAMB")]
    series = [(label, running_mean(json.load(open(d / f"{n}.json"))["losses"], 10))
              for n, label in names]
    lines(PLOT, f"Training loss, GPT tiny, 2 ranks, compression from step {freeze} "
          "(mean of 10 steps)", series, "step", "loss")
