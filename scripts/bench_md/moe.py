"""The `moe` section of BENCHMARKS.md (prose: templates/moe.md)."""
import json
from statistics import median
from pathlib import Path

from .common import CORPUS, render


def moe(directory, steps, cores):
    d = Path(directory)
    load = lambda name: json.load(open(d / f"{name}.json"))
    small, moe_, pr = load("small"), load("small-moe"), load("small-pr-moe")
    student, kd, serve = load("student"), load("student-kd"), load("serve")
    rows = []
    for name, r in (("small", small), ("small-moe", moe_), ("small-pr-moe", pr)):
        m = r.get("moe")
        a2a = f"{int(median(m['all_to_all_bytes'])):,}" if m else "0"
        dropped = (
            f"{100 * sum(m['tokens_dropped']) / max(1, sum(m['tokens_routed'])):.1f}%"
            if m else ""
        )
        balance = f"{sum(m['load_balance']) / len(m['load_balance']):.2f}" if m else ""
        rows.append(
            f"| `{name}` | {r['params']:,} | {r['heldout_loss']:.4f} "
            f"| {100 * (r['heldout_loss'] / small['heldout_loss'] - 1):+.2f}% "
            f"| {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / small['tokens_per_s']:.2f} "
            f"| {a2a} | {dropped} | {balance} |"
        )
    change = lambda r, base: 100 * (r["heldout_loss"] / base["heldout_loss"] - 1)
    return render(
        "moe", steps=steps, cores=cores, heldout_bytes=CORPUS.stat().st_size - 62000,
        small=small, moe=moe_, pr=pr, student=student, kd=kd, serve=serve,
        rows="\n".join(rows), pr_vs_moe=change(pr, moe_), pr_share=pr["params"] / moe_["params"],
        kd_vs_alone=change(kd, student), teacher_vs_alone=change(moe_, student),
    )
