"""The `kernels` section of BENCHMARKS.md."""
import json


def kernels(path, cores):
    k = json.load(open(path))
    lines = [
        "## Kernels (CPU path)",
        "",
        f"`bash scripts/bench-kernels.sh` (`kernel-bench`, median of {k['reps']} after a "
        f"warm-up) on a machine with {cores} CPU cores ({k['threads']} rayon threads), "
        f"{k['params']:,} fp32 values. Bandwidths count the bytes a pass must move: AdamW 28 per "
        "parameter (read p, g, m, v; write p, m, v), the copy 8 per value, quantization 4 in "
        "and 1 (int8) or ½ (int4) out, the 1-bit compression 12⅛ (x, error in and out, signs). "
        "The copy is as large as the optimizer's four buffers, one `memcpy` per thread.",
        "",
        "| kernel | GB/s | ratio |",
        "|---|---|---|",
        f"| parallel memcpy (baseline) | {k['memcpy_gbps']:.2f} | 1.00 |",
        f"| fused AdamW (`adam_step`) | {k['adamw_gbps']:.2f} | {k['adamw_over_memcpy']:.2f} of "
        f"memcpy, {k['adamw_over_burn']:.1f}x Burn's |",
        f"| Burn `AdamW` through `ModuleOptimizer` on Flex | {k['burn_adamw_gbps']:.2f} | "
        f"{k['burn_adamw_gbps'] / k['memcpy_gbps']:.2f} of memcpy |",
        f"| int8 quantize / dequantize (symmetric, groups of 2048) | {k['quantize_int8_gbps']:.2f}"
        f" / {k['dequantize_int8_gbps']:.2f} | |",
        f"| int4 quantize / dequantize (symmetric, groups of 2048) | {k['quantize_int4_gbps']:.2f}"
        f" / {k['dequantize_int4_gbps']:.2f} | |",
        f"| 1-bit compression with error feedback | {k['onebit_compress_gbps']:.2f} | |",
        "",
        f"One AdamW step over the {k['params']:,} parameters: {k['adamw_ms']:.1f} ms fused, "
        f"{k['burn_adamw_ms']:.1f} ms in Burn.",
        "",
    ]
    if k.get("qmatmul"):
        lines += [
            "### The fused dequantize-matmul",
            "",
            "`y = x · W` for a weight quantized group-wise (asymmetric, groups of 64; "
            "`qmatmul::dequant_matmul`, never whole in f32) against Burn's f32 matmul on Flex "
            "(`x.matmul(w)`) on the same shapes. The three run in turn within each repetition, "
            "so each finds its weight out of cache as a model's layers do; medians.",
            "",
            "| shape | Burn f32 (ms) | int8 (ms) | int8 speed vs Burn | int4 (ms) | int4 speed vs Burn |",
            "|---|---|---|---|---|---|",
        ]
        for q in k["qmatmul"]:
            lines.append(
                f"| [{q['m']}, {q['k']}] x [{q['k']}, {q['n']}] | {q['burn_f32_ms']:.3f} "
                f"| {q['int8_ms']:.3f} | {q['int8_over_burn']:.2f}x "
                f"| {q['int4_ms']:.3f} | {q['int4_over_burn']:.2f}x |"
            )
        lines.append("")
    if "device" in k:
        lines += [
            f"### CubeCL kernels on {k['device']}",
            "",
            "The same run, `--device`: the fused AdamW kernel (fp32) against a device copy "
            "kernel moving as many bytes, each timed until the device finished.",
            "",
            "| kernel | GB/s | ratio |",
            "|---|---|---|",
            f"| device copy (baseline) | {k['device_copy_gbps']:.2f} | 1.00 |",
            f"| fused AdamW | {k['device_adamw_gbps']:.2f} | {k['device_adamw_over_copy']:.2f} "
            "of the copy |",
            "",
            f"One AdamW step: {k['device_adamw_ms']:.3f} ms.",
            "",
        ]
    return "\n".join(lines) + "\n"

