"""The `overhead` section of BENCHMARKS.md (prose: templates/overhead.md)."""
import json
from pathlib import Path

from .common import render


# The phase columns, in the order of templates/overhead.md's header.
PHASES = ["forward", "backward", "accumulate", "reduce", "optimizer", "other"]

def overhead(directory, cores):
    d = Path(directory)
    rows = []
    for model in ["tiny", "small"]:
        f = d / f"{model}.json"
        if not f.exists():
            continue
        r = json.load(open(f))
        loops = ["plain", "engine"] + (["unfused"] if "unfused_tokens_per_s" in r else [])
        for loop in loops:
            ms = r[f"{loop}_ms_per_step"]
            tps = r[f"{loop}_tokens_per_s"]
            ratio = {
                "plain": "1.00",
                "engine": f"{r['engine_over_plain']:.3f}",
                "unfused": f"{1 / r.get('fused_over_unfused', 1):.3f}",
            }[loop]
            cells = " | ".join(f"{ms[p]:.2f}" if p in ms else "" for p in PHASES)
            diff = {
                "plain": "",
                "engine": f"{r['max_loss_difference']:.1e}",
                "unfused": f"{r.get('unfused_max_loss_difference', 0):.1e}",
            }[loop]
            name = {
                "plain": "plain Burn",
                "engine": f"engine, stage {r['stage']}",
                "unfused": "plain Burn, Burn's softmax/layer norm/GELU",
            }[loop]
            rows.append(
                f"| `{model}` | {name} | {tps:.0f} | {ratio} | {cells} | {ms['step']:.1f} | {diff} |"
            )
    steps = ", ".join(
        f"`{m}` {json.load(open(d / f'{m}.json'))['steps']} per run "
        f"({json.load(open(d / f'{m}.json'))['warm_up']} untimed), "
        f"{len(json.load(open(d / f'{m}.json'))['rounds'])} runs of each"
        for m in ["tiny", "small"]
        if (d / f"{m}.json").exists()
    )
    return render("overhead", cores=cores, rows="\n".join(rows), steps=steps)
