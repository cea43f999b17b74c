"""The `overhead` section of BENCHMARKS.md."""
import json
from pathlib import Path


PHASES = ["forward", "backward", "accumulate", "reduce", "optimizer", "other"]



def overhead(directory, cores):
    d = Path(directory)
    lines = [
        "## Engine overhead against a plain Burn loop",
        "",
        f"`bash scripts/bench-overhead.sh` on a machine with {cores} CPU cores, Flex, fp32. "
        "One process trains the GPT with a plain Burn loop (one model, Burn's AdamW, no engine) "
        "and with `DeepSpeedEngine` at one rank, ZeRO stage 0, alternating runs, on the same "
        "initial model, batches (16 sequences) and hyper-parameters (the default config without "
        "gradient clipping, which Burn applies per tensor and the engine globally). Both compute "
        "the same steps: the largest difference between their losses is given. The GPT's "
        "softmax, layer norm and GELU are `burn_deepspeed::fused`'s; the last row of each "
        "model runs the plain loop with Burn's own (`overhead_bench --unfused`; the losses then "
        "differ by float rounding), and its ratio is that loop over the fused plain loop. Phases are "
        "milliseconds per step, measured; `other` is the step's wall clock less the phases.",
        "",
        "| model | loop | tokens/s | ratio | " + " | ".join(PHASES) + " | step (ms) | max loss difference |",
        "|---|---|---|---|" + "---|" * len(PHASES) + "---|---|",
    ]
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
            lines.append(
                f"| `{model}` | {name} | {tps:.0f} | {ratio} | {cells} | {ms['step']:.1f} | {diff} |"
            )
    lines += [
        "",
        "Steps: "
        + ", ".join(
            f"`{m}` {json.load(open(d / f'{m}.json'))['steps']} per run "
            f"({json.load(open(d / f'{m}.json'))['warm_up']} untimed), "
            f"{len(json.load(open(d / f'{m}.json'))['rounds'])} runs of each"
            for m in ["tiny", "small"]
            if (d / f"{m}.json").exists()
        )
        + ".",
    ]
    return "\n".join(lines) + "\n"

