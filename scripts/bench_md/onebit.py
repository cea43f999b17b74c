"""The `onebit` section of BENCHMARKS.md (prose: templates/onebit.md)."""
import json
from pathlib import Path

from .common import last20, render


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
