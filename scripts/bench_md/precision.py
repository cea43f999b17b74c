"""The `precision` section of BENCHMARKS.md (prose: templates/precision.md)."""
import json
from pathlib import Path

from .common import render


def precision(directory, cores):
    d = Path(directory)
    p = json.load(open(d / "precision.json"))
    a = json.load(open(d / "activation.json"))
    r = a["result"]
    rows = p["result"]["rows"]
    table = []
    for row in rows:
        gather = row["gather_bytes_sent"]
        table.append(
            f"| {row['precision']} | {row['stage']} | {row['tokens_per_s']:.0f} "
            f"| {row['ratio_to_fp32_stage0']:.2f} | {row['model_state_bytes_per_rank']:,} "
            f"| {row['model_state_bytes_formula']:,} | {'' if gather is None else f'{gather:,}'} "
            f"| {row['peak_activation_bytes'] or 0:,} | {row['tail_loss']:.4f} "
            f"| {row['tail_loss_rel_to_fp32']:.2e} | {row['skipped_steps']} |"
        )
    across = ", ".join(
        f"{x['precision']} {x['max_rel_across_stages']:.1e}" for x in p["result"]["across_stages"]
    )
    return render("precision", p=p, a=a, r=r, cores=cores, params=rows[0]["params"],
                  rows="\n".join(table), across=across)
