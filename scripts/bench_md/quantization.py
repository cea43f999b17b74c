"""The `quantization` section of BENCHMARKS.md (prose: templates/quantization.md)."""
import json
from pathlib import Path

from .common import render


def quantization(directory, steps_small, steps_tiny, cores):
    d = Path(directory)
    load = lambda name: json.load(open(d / f"{name}.json"))
    rows = []
    for tp in (1, 2, 4):
        base = load(f"small-fp32-{tp}")["heldout_loss"]
        for dtype in ("fp32", "bf16", "int8", "int4"):
            r = load(f"small-{dtype}-{tp}")
            kl = r.get("heldout_kl_from_fp32")
            psi = r["parameters"] / r["tp"]
            held = r["weight_bytes_per_rank"]
            int4 = f"{held / (psi * (0.5 + 8 / 64)):.4f}" if dtype == "int4" else ""
            rows.append(
                f"| {tp} | {dtype} | {r['heldout_loss']:.5f} "
                f"| {100 * (r['heldout_loss'] / base - 1):+.3f}% "
                f"| {'' if kl is None else f'{kl:.2e}'} | {held:,} "
                f"| {held / psi:.4f} | {int4} |"
            )
    plain, moq = load("train-tiny-plain"), load("train-tiny-moq")
    bits = moq.get("moq_bits", [])
    reach = next((i + 1 for i, b in enumerate(bits) if b == 8), None)
    moq_rows = []
    for run, train in (("plain", plain), ("moq", moq)):
        base = load(f"tiny-{run}-fp32")["heldout_loss"]
        for name in ("fp32", "int8-grid", "int8", "int4"):
            r = load(f"tiny-{run}-{name}")
            kl = r.get("heldout_kl_from_fp32")
            moq_rows.append(
                f"| {run} | {train['losses'][-1]:.4f} | {name} | {r['heldout_loss']:.5f} "
                f"| {100 * (r['heldout_loss'] / base - 1):+.4f}% "
                f"| {'' if kl is None else f'{kl:.2e}'} |"
            )
    return render(
        "quantization", cores=cores, steps_small=steps_small, steps_tiny=steps_tiny, reach=reach,
        rows="\n".join(rows), moq_rows="\n".join(moq_rows),
    )

