"""The `quantization` section of BENCHMARKS.md."""
import json
from pathlib import Path


def quantization(directory, steps_small, steps_tiny, cores):
    d = Path(directory)
    load = lambda name: json.load(open(d / f"{name}.json"))
    lines = [
        "## Inference: quantized weights and MoQ",
        "",
        f"`bash scripts/bench-quantization.sh` on a machine with {cores} CPU cores, Flex. GPT "
        f"`small` trained for {steps_small} steps (2 data-parallel ranks) on the embedded "
        "corpus's first 62,000 bytes; the held-out figures are over the other "
        "7,538 bytes' non-overlapping windows. INT8: symmetric, groups of up to 512 values; "
        "INT4: asymmetric, groups of 64; around them the LayerNorms, biases and activations "
        "are fp16, as DeepSpeed serves INT8 models. KL: the mean "
        "KL divergence of the next-byte distributions from the fp32 model's. Weight bytes are "
        "measured on what each rank holds; Ψ/tp and Ψ/(2·tp) plus an 8-byte step and offset "
        "per 64 values are the formulas they are compared with (the LayerNorms and the "
        "row-parallel biases stay whole on every rank, so the fp32 ratio shows what "
        "replication adds).",
        "",
        "| tp | dtype | held-out loss | vs fp32 | KL from fp32 | weight bytes per rank "
        "| bytes / (Ψ/tp) | INT4: bytes / (Ψ/(2·tp) + steps) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tp in (1, 2, 4):
        base = load(f"small-fp32-{tp}")["heldout_loss"]
        for dtype in ("fp32", "bf16", "int8", "int4"):
            r = load(f"small-{dtype}-{tp}")
            kl = r.get("heldout_kl_from_fp32")
            psi = r["parameters"] / r["tp"]
            held = r["weight_bytes_per_rank"]
            int4 = f"{held / (psi * (0.5 + 8 / 64)):.4f}" if dtype == "int4" else ""
            lines.append(
                f"| {tp} | {dtype} | {r['heldout_loss']:.5f} "
                f"| {100 * (r['heldout_loss'] / base - 1):+.3f}% "
                f"| {'' if kl is None else f'{kl:.2e}'} | {held:,} "
                f"| {held / psi:.4f} | {int4} |"
            )
    plain, moq = load("train-tiny-plain"), load("train-tiny-moq")
    bits = moq.get("moq_bits", [])
    reach = next((i + 1 for i, b in enumerate(bits) if b == 8), None)
    lines += [
        "",
        f"MoQ: GPT `tiny` trained for {steps_tiny} steps plainly and with "
        "`examples/gpt/configs/moq.json` (start 16 bits, target 8, period 2, offset 0, one "
        f"symmetric group per matrix: 8 bits from step {reach}), both on the same bytes and "
        "seed. `int8-grid` is INT8 with MoQ's own grid (symmetric, one group per matrix).",
        "",
        "| training | final train loss | dtype | held-out loss | change from its fp32 | KL from its fp32 |",
        "|---|---|---|---|---|---|",
    ]
    for run, train in (("plain", plain), ("moq", moq)):
        base = load(f"tiny-{run}-fp32")["heldout_loss"]
        for name in ("fp32", "int8-grid", "int8", "int4"):
            r = load(f"tiny-{run}-{name}")
            kl = r.get("heldout_kl_from_fp32")
            lines.append(
                f"| {run} | {train['losses'][-1]:.4f} | {name} | {r['heldout_loss']:.5f} "
                f"| {100 * (r['heldout_loss'] / base - 1):+.4f}% "
                f"| {'' if kl is None else f'{kl:.2e}'} |"
            )
    return "\n".join(lines) + "\n"

