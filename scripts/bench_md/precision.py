"""The `precision` section of BENCHMARKS.md (prose: templates/precision.md)."""
import json
from pathlib import Path

from .common import render
from .svg import lines, running_mean

PLOT = Path(__file__).resolve().parents[2] / "docs" / "plots" / "precision-loss.svg"


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


def precision_plot(directory):
    """The loss curves of fp32, fp16 and bf16 at ZeRO stage 0 (a running mean of 10 steps), as
    `docs/plots/precision-loss.svg`."""
    rows = json.load(open(Path(directory) / "precision.json"))["result"]["rows"]
    series = [(r["precision"], running_mean(r["losses"], 10)) for r in rows if r["stage"] == 0]
    lines(PLOT, "Training loss, GPT tiny, 2 ranks, ZeRO stage 0 (mean of 10 steps)", series,
          "step", "loss")
