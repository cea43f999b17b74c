"""The `gpu` section of BENCHMARKS.md."""
import json
from pathlib import Path

from .common import compared, last_json, max_rel, steady_tokens, test_counts


def gpu(directory):
    d = Path(directory)
    name = (d / "gpu.txt").read_text().strip()
    cores = (d / "cores.txt").read_text().strip() if (d / "cores.txt").exists() else "?"
    # `bench-gpu.sh flex` writes where the Flex references ran when not beside the GPU runs.
    flex_host = d / "flex-host.txt"
    flex_where = (
        f"the Flex references on another machine: {flex_host.read_text().strip()}"
        if flex_host.exists()
        else f"the Flex references with the same binary on its {cores} CPU cores"
    )
    kt, st = test_counts(d / "kernels-tests.out"), test_counts(d / "strategies-tests.out")
    lines = [
        "## GPU (CUDA, NCCL)",
        "",
        f"`bash scripts/bench-gpu.sh` on one {name} ({flex_where}). With one GPU, a run of 2 ranks puts both on GPU 0: NCCL refuses two "
        "ranks of one communicator on one device, so those ranks stage their collectives "
        "through host memory (counted below); a run of 1 rank takes NCCL, whose collectives "
        "at one rank return their input without a call or a synchronisation (the conformance "
        "test turns that shortcut off to exercise NCCL itself).",
        "",
        f"- The CubeCL kernels' tests on CUDA against their CPU references: {kt[0]} passed, "
        f"{kt[1]} failed.",
        f"- The device collectives' tests with the GPU ones (`--include-ignored`: NCCL "
        f"conformance at world 1, the word collectives of the packed signs included, the "
        f"host-staged collectives on CUDA tensors at worlds 1-4, the device 1-bit all-reduce "
        f"and 1-bit Adam/LAMB on CUDA against the host optimizers): "
        f"{st[0]} passed, {st[1]} failed.",
        "",
        "### GPT `tiny` on CUDA against Flex",
        "",
        "20 steps, the wgpu test's config (batch 8, micro-batch 4, AdamW, clipping 1.0), "
        "`--device cuda` against `--device flex`. Bytes are rank 0's per step, measured where "
        "the copies happen.",
        "",
        "| ranks | stage | collectives | Flex loss (first, last) | CUDA loss (first, last) "
        "| max rel diff | host/device bytes per step | of which staged collectives |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ranks, stages in [(2, [0, 1, 2, 3]), (1, [0, 3])]:
        for stage in stages:
            tag = "" if ranks == 2 else "-r1"
            c = last_json(d / f"tiny-cuda{tag}-s{stage}.out")
            f = last_json(d / f"tiny-flex{tag}-s{stage}.out")
            if c is None or f is None:
                lines.append(f"| {ranks} | {stage} | | | | did not run | | |")
                continue
            worst = max_rel(f["losses"], c["losses"])
            via = "NCCL" if ranks == 1 else "host-staged"
            lines.append(
                f"| {ranks} | {stage} | {via} | {f['losses'][0]:.4f}, {f['losses'][-1]:.4f} "
                f"| {c['losses'][0]:.4f}, {c['losses'][-1]:.4f} | {worst:.1e} "
                f"| {max(c['host_device_bytes_per_step']):,} "
                f"| {max(c['staged_collective_bytes_per_step']):,} |"
            )
    o = last_json(d / "overhead-small.out")
    if o:
        ms_p, ms_e = o["plain_ms_per_step"], o["engine_ms_per_step"]
        lines += [
            "",
            "### The engine against a plain Burn loop on the GPU",
            "",
            f"`overhead_bench --device cuda --model {o['model']}`: one process alternates a "
            "plain Burn loop (Burn's AdamW on the GPU) and `DeepSpeedEngine` at one rank, "
            f"stage {o['stage']}, device-resident (the fused CubeCL AdamW), same model, "
            f"batches (16 sequences) and hyper-parameters; {o['steps']} steps per run "
            f"({o['warm_up']} untimed), {len(o['rounds'])} runs of each.",
            "",
            "| loop | tokens/s | ratio | forward (ms) | backward (ms) | optimizer (ms) | step (ms) |",
            "|---|---|---|---|---|---|---|",
            f"| plain Burn | {o['plain_tokens_per_s']:.0f} | 1.00 | {ms_p.get('forward', 0):.2f} "
            f"| {ms_p.get('backward', 0):.2f} | {ms_p.get('optimizer', 0):.2f} | {ms_p['step']:.2f} |",
            f"| engine | {o['engine_tokens_per_s']:.0f} | {o['engine_over_plain']:.3f} "
            f"| {ms_e.get('forward', 0):.2f} | {ms_e.get('backward', 0):.2f} "
            f"| {ms_e.get('optimizer', 0):.2f} | {ms_e['step']:.2f} |",
            "",
            f"The largest difference between the two loops' losses: {o['max_loss_difference']:.1e}.",
        ]
    for model in ["small", "medium"]:
        runs = [(st, last_json(d / f"{model}-cuda-s{st}.out")) for st in range(4)]
        if not any(r for _, r in runs):
            continue

        def steady(r):
            return steady_tokens(r, 256)

        base = next(steady(r) for _, r in runs if r)
        first = next(r for _, r in runs if r)
        lines += [
            "",
            f"### GPT `{model}` on CUDA at stages 0-3",
            "",
            f"One rank (NCCL), {first['params']:,} parameters, the example's default config "
            f"at each stage, {len(first['losses'])} steps. Steady tokens/s: the median step "
            "after the first 5 (measured per step); whole run: every step, the kernels' "
            "compilation on first use included.",
            "",
            "| stage | steady tokens/s | ratio to stage 0 | whole-run tokens/s | last loss "
            "| model state bytes | host/device bytes per step |",
            "|---|---|---|---|---|---|---|",
        ]
        for stage, r in runs:
            if r is None:
                lines.append(f"| {stage} | did not run | | | | | |")
                continue
            lines.append(
                f"| {stage} | {steady(r):.0f} | {steady(r) / base:.2f} | {r['tokens_per_s']:.0f} "
                f"| {r['losses'][-1]:.4f} | {r['model_state_bytes_per_rank']:,} "
                f"| {max(r['host_device_bytes_per_step']):,} |"
            )
    offloaded = [(st, last_json(d / f"small-cuda-s{st}-resident.out"),
                  last_json(d / f"small-cuda-s{st}-offload.out"))
                 for st in [2, 3]]
    if any(o for _, _, o in offloaded):

        lines += [
            "",
            "### ZeRO-Offload on the GPU",
            "",
            "GPT `small`, one rank, 40 steps: `offload_optimizer` `cpu` at stage 2 (and "
            "`offload_param` `cpu` at stage 3) against a device-resident run of the same "
            "stage in the same session. Offloaded, each step moves the gradients to the host, steps the fp32 "
            "masters, m and v there with the CPU fused Adam and writes the parameters back.",
            "",
            "| stage | offloaded | steady tokens/s | ratio to device-resident | host/device bytes "
            "per step | model state bytes per rank | max rel loss diff |",
            "|---|---|---|---|---|---|---|",
        ]
        for stage, r, o, worst in compared(offloaded):
            what = "optimizer" + (" + parameters" if stage == 3 else "")
            for name, x in [("no", r), (what, o)]:
                ratio = steady_tokens(x, 256) / steady_tokens(r, 256)
                lines.append(
                    f"| {stage} | {name} | {steady_tokens(x, 256):.0f} | {ratio:.2f} "
                    f"| {max(x['host_device_bytes_per_step']):,} "
                    f"| {x['model_state_bytes_per_rank']:,} | {'' if x is r else f'{worst:.1e}'} |"
                )
    mixed = [(t, last_json(d / f"tiny-cuda-{t}.out"), last_json(d / f"tiny-flex-{t}.out"))
             for t in ["fp16", "fp16-scale8", "bf16"]]
    if any(c and f for _, c, f in mixed):
        lines += [
            "",
            "### 16-bit training on CUDA against Flex",
            "",
            "GPT `tiny`, 2 ranks, 20 steps, the example's `fp16.json` and `bf16.json` (stage 2, "
            "fp32 masters, fp16 with dynamic loss scaling from 2^16, and from 2^8 as "
            "`fp16-scale8`). Whether a step overflows at the edge of fp16's range depends on "
            "the device's rounding: where the two devices skip different steps, their loss "
            "scales and trajectories part from then on.",
            "",
            "| dtype | Flex loss (first, last) | CUDA loss (first, last) | max rel diff "
            "| skipped steps (Flex, CUDA) | host/device bytes per step |",
            "|---|---|---|---|---|---|",
        ]
        for t, f, c, worst in compared((t, f, c) for t, c, f in mixed):
            lines.append(
                f"| {t} | {f['losses'][0]:.4f}, {f['losses'][-1]:.4f} "
                f"| {c['losses'][0]:.4f}, {c['losses'][-1]:.4f} | {worst:.1e} "
                f"| {f['skipped_steps']}, {c['skipped_steps']} "
                f"| {max(c['host_device_bytes_per_step']):,} |"
            )
    onebit = [((opt, ranks), last_json(d / f"tiny-flex-onebit-{opt}-r{ranks}.out"),
               last_json(d / f"tiny-cuda-onebit-{opt}-r{ranks}.out"))
              for opt in ["adam", "lamb"] for ranks in [2, 1]]
    onebit.append((("pipeline", 2), last_json(d / "tiny-flex-pipeline.out"),
                   last_json(d / "tiny-cuda-pipeline.out")))
    if any(c for _, _, c in onebit):
        lines += [
            "",
            "### 1-bit Adam, 1-bit LAMB and the pipeline on CUDA against Flex",
            "",
            "GPT `tiny`, 20 steps, the example's `onebit_adam.json` and `onebit_lamb.json` "
            "compressing from step 8 (stage 0, device-resident: the gradient, the fp32 "
            "parameters, the moments and the error buffers on the GPU, the packed signs moved "
            "as u32 words) and `pipeline.json` (2 stages, a host regime). Dense steps: before "
            "`freeze_step`. Bytes are rank 0's per step, measured where the copies happen.",
            "",
            "| run | ranks | collectives | Flex loss (first, last) | CUDA loss (first, last) "
            "| max rel diff, dense steps | max rel diff, all | host/device bytes per step "
            "(dense, compressed) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for (opt, ranks), f, c, worst in compared(onebit):
            dense = "" if opt == "pipeline" else f"{max_rel(f['losses'][:8], c['losses'][:8]):.1e}"
            via = "NCCL" if ranks == 1 else "host-staged"
            b = c["host_device_bytes_per_step"]
            name = "pipeline" if opt == "pipeline" else f"1-bit {opt.capitalize() if opt == 'adam' else 'LAMB'}"
            lines.append(
                f"| {name} | {ranks} | {via} | {f['losses'][0]:.4f}, {f['losses'][-1]:.4f} "
                f"| {c['losses'][0]:.4f}, {c['losses'][-1]:.4f} | {dense} | {worst:.1e} "
                f"| {b[0]:,}, {b[-1]:,} |"
            )
        lines += [
            "",
            "The dense steps agree as the stage-0 runs do. Once compressing, a sign taken of an "
            "element near zero may differ between the two devices' rounding, the error "
            "feedback carries it on, and 1-bit Adam's update `m/√v` with `v` frozen this early "
            "(step 8) amplifies it where `v` is small: the runs part, and one of them may "
            "spike (Flex at 1 rank, step 16). 1-bit LAMB's trust ratio and clamped factor "
            "keep its runs together. That the device optimizers compute the host ones' steps "
            "is the unit tests' check (CUDA within 1e-5 of the host over warm-up and "
            "compression, above; Flex bit for bit). At 1 rank the compressed all-reduce still "
            "compresses and decompresses; nothing crosses but the norm and the two scales.",
        ]
    k = last_json(d / "kernel-bench.out")
    if k and "device" in k:
        lines += [
            "",
            "### Fused AdamW on the GPU",
            "",
            f"`kernel-bench --device cuda`, {k['params']:,} fp32 parameters, median of "
            f"{k['reps']}: the fused AdamW kernel (28 bytes per parameter) against a device "
            "copy kernel moving as many bytes, each timed until the device finished.",
            "",
            "| kernel | GB/s | ratio |",
            "|---|---|---|",
            f"| device copy (baseline) | {k['device_copy_gbps']:.0f} | 1.00 |",
            f"| fused AdamW | {k['device_adamw_gbps']:.0f} | {k['device_adamw_over_copy']:.2f} of the copy |",
        ]
        t = last_json(d / "torch-copy.out") or (
            json.load(open(d / "torch-copy.json")) if (d / "torch-copy.json").exists() else None
        )
        if t:
            lines += [
                f"| PyTorch {t['torch']} `copy_` of {t['bytes'] // 2**30} GiB read and written "
                f"(same machine, another process) | {t['gbps']:.0f} | AdamW at "
                f"{k['device_adamw_gbps'] / t['gbps']:.2f} of it |",
            ]
        lines += [
            "",
            f"One AdamW step: {k['device_adamw_ms']:.3f} ms. Our copy kernel moves one f32 "
            "per unit; the fused AdamW moves 28 bytes per unit and keeps more loads in flight, "
            "hence above it; PyTorch's copy is the device's bandwidth.",
        ]
    return "\n".join(lines) + "\n"

