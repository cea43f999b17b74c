"""The `kernels` section of BENCHMARKS.md (prose: templates/kernels*.md)."""
import json

from .common import render


def kernels(path, cores):
    k = json.load(open(path))
    text = render("kernels", k=k, cores=cores,
                  burn_over_memcpy=k["burn_adamw_gbps"] / k["memcpy_gbps"])
    if k.get("qmatmul"):
        rows = [
            f"| [{q['m']}, {q['k']}] x [{q['k']}, {q['n']}] | {q['burn_f32_ms']:.3f} "
            f"| {q['int8_ms']:.3f} | {q['int8_over_burn']:.2f}x "
            f"| {q['int4_ms']:.3f} | {q['int4_over_burn']:.2f}x |"
            for q in k["qmatmul"]
        ]
        text += render("kernels-qmatmul", rows="\n".join(rows))
    if "device" in k:
        text += render("kernels-device", k=k)
    return text
