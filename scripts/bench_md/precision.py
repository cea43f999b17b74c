"""The `precision` section of BENCHMARKS.md."""
import json
from pathlib import Path


def precision(directory, cores):
    d = Path(directory)
    p = json.load(open(d / "precision.json"))
    a = json.load(open(d / "activation.json"))
    r = a["result"]
    rows = p["result"]["rows"]
    lines = [
        "## Mixed precision and activation checkpointing",
        "",
        f"`bash scripts/bench-precision.sh` on a machine with {cores} CPU cores, Flex backend. "
        "A CPU has no 16-bit matrix units: here f16 runs at about half of fp32's speed and "
        "bf16 at about fp32's, so these figures measure the engine's mixed-precision "
        "machinery (casts, fp32 masters, halved stage-3 traffic), not the speed-up of 16-bit "
        "hardware. fp16 skips its first steps while the loss scale comes down from 2^16, as "
        "DeepSpeed's does.",
        "",
        f"### fp32, fp16 and bf16 at ZeRO stages 0-3, GPT `{p['model']}` "
        f"({rows[0]['params']:,} parameters), {p['world']} thread ranks, "
        f"{p['steps']} steps of {p['micro_batch']} sequences per rank",
        "",
        "Tokens/s over fp32 stage 0's from the same process (first step not timed). Model "
        "state per rank is measured where it is allocated; the formula (fp32: 16Ψ, 8Ψ + 8Ψ/N, "
        "4Ψ + 12Ψ/N, 16Ψ/N; fp16, with fp16 gradient buffers, the paper's 2Ψ + 2Ψ + 12Ψ; "
        "bf16, with fp32 gradient buffers as DeepSpeed's bf16 optimizer, 2Ψ + 4Ψ + 12Ψ; each "
        "cut by stage) "
        "sits beside it. Tail loss: mean of the last 20 steps, against fp32 at the same stage. "
        "Activation heap: the most heap one micro-batch's forward and backward held above what "
        "was live before them, for the whole process (both thread ranks).",
        "",
        "| precision | stage | tokens/s | ratio | model state per rank, measured (B) "
        "| formula (B) | stage-3 gather bytes sent | activation heap (B) | tail loss "
        "| rel. to fp32 | skipped steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        gather = row["gather_bytes_sent"]
        lines.append(
            f"| {row['precision']} | {row['stage']} | {row['tokens_per_s']:.0f} "
            f"| {row['ratio_to_fp32_stage0']:.2f} | {row['model_state_bytes_per_rank']:,} "
            f"| {row['model_state_bytes_formula']:,} | {'' if gather is None else f'{gather:,}'} "
            f"| {row['peak_activation_bytes'] or 0:,} | {row['tail_loss']:.4f} "
            f"| {row['tail_loss_rel_to_fp32']:.2e} | {row['skipped_steps']} |"
        )
    lines += [
        "",
        "Largest relative difference of the tail loss across stages 0-3: "
        + ", ".join(
            f"{x['precision']} {x['max_rel_across_stages']:.1e}"
            for x in p["result"]["across_stages"]
        )
        + ".",
        "",
        f"### Activation checkpointing, GPT `{a['model']}` ({r['params']:,} parameters), "
        f"sequence {a['seq_len']}, micro-batch {a['micro_batch']}, one rank",
        "",
        f"Each block a checkpoint (the config's `activation_checkpointing` section), against "
        f"the same run without it, interleaved over {a['rounds']} rounds of {a['steps']} steps. "
        "The activation heap is measured by the counting allocator the benchmark installs.",
        "",
        "| run | activation heap (B) | tokens/s |",
        "|---|---|---|",
        f"| without checkpoints | {r['without_peak_activation_bytes']:,} "
        f"| {r['without_tokens_per_s']:.0f} |",
        f"| each block a checkpoint | {r['with_peak_activation_bytes']:,} "
        f"| {r['with_tokens_per_s']:.0f} |",
        "",
        f"Activation heap ratio {r['peak_activation_ratio']:.3f}; tokens/s ratio "
        f"{r['tokens_per_s_ratio']:.3f} (the recompute is one more forward of each block); "
        f"losses differ by at most {r['losses_max_rel']:.1e} relative.",
        "",
    ]
    return "\n".join(lines) + "\n"

