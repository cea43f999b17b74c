"""Writes one section of BENCHMARKS.md from benchmark JSON, keeping the other sections.

Sections are delimited by `<!-- section: NAME -->` ... `<!-- end: NAME -->`.
Usage: benchmarks_md.py pipeline BENCH_JSON GRID_MPI_JSON GRID_THREADS_JSON CORES
       benchmarks_md.py onebit DIR FREEZE_STEP CORES
       benchmarks_md.py zero DIR CORES
       benchmarks_md.py learner DIR CORES
       benchmarks_md.py kernels KERNELS_JSON CORES
       benchmarks_md.py precision DIR CORES
       benchmarks_md.py offload DIR CORES
       benchmarks_md.py 3d BENCH_JSON MPI_JSON CORES
       benchmarks_md.py inference DIR NEW_TOKENS CORES
       benchmarks_md.py quantization DIR STEPS_SMALL STEPS_TINY CORES
       benchmarks_md.py moe DIR STEPS CORES
       benchmarks_md.py overhead DIR CORES
       benchmarks_md.py vs-pytorch DIR CORES
"""
import json
import re
import sys
from statistics import median
from pathlib import Path

PATH = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
CORPUS = PATH.parent / "examples" / "gpt" / "data" / "corpus.txt"
HEADER = "# Benchmarks\n\nMeasured figures; each section names the command that regenerates it.\n"


def pipeline(bench, grid_mpi, grid_threads, cores):
    b = json.load(open(bench))
    m = json.load(open(grid_mpi))
    t = json.load(open(grid_threads))
    lines = [
        "## Pipeline parallelism",
        "",
        f"`bash scripts/bench-pipeline.sh` (STEPS={b['steps']}, ROUNDS={b['rounds']}) on a machine "
        f"with {cores} CPU cores, Flex backend, fp32. Ranks beyond the core count share cores, "
        "so these figures measure the engine's overheads on a CPU, not the speed-up of "
        "dedicated devices.",
        "",
        f"### pp = 2 against dp = 2, GPT `{b['model']}` ({b['params']:,} parameters), "
        f"global batch {b['global_batch']} sequences",
        "",
        "Same process, interleaved rounds; dp = 2 runs 8 micro-batches of 2 per rank, pp = 2 "
        "one pipeline of 16 micro-batches of 2.",
        "",
        "| layout | tokens/s | ratio to dp = 2 | model state per rank, measured (B) "
        "| bytes sent per rank, measured |",
        "|---|---|---|---|---|",
        f"| dp = 2 | {b['dp2_tokens_per_s']:.0f} | 1.00 | {b['dp2_model_state_bytes_per_rank']:,} "
        f"| {', '.join(f'{x:,}' for x in b['dp2_comm_bytes_per_rank'])} |",
        f"| pp = 2 | {b['pp2_tokens_per_s']:.0f} | {b['pp2_over_dp2']:.2f} "
        f"| {b['pp2_model_state_bytes_per_rank']:,} "
        f"| {', '.join(f'{x:,}' for x in b['pp2_comm_bytes_per_rank'])} |",
        "",
        f"Measured bubble of the pp = 2 runs: {b['pp2_bubble_fraction']:.3f} "
        f"(schedule: 1/17 = {1/17:.3f}).",
        "",
        "### Bubble of 4 stages (GPT `tiny`, micro-batches of 1 sequence)",
        "",
        "Measured: 1 − (forward + backward time) / (schedule time) per stage, averaged over "
        "stages. Schedule: (S − 1)/(M + S − 1), which counts a backward as long as a forward.",
        f"Four stage ranks on {cores} cores time-share them: a stage's passes stretch while its "
        "neighbours compute and count as busy, and its waits include its neighbours' share of "
        "the cores, so the measured figure is only near the schedule's.",
        "",
        "| M | measured | schedule | peak live activations per stage | bound min(S − s, M) |",
        "|---|---|---|---|---|",
    ]
    for x in b["bubble"]:
        s, mb = x["stages"], x["micro_batches"]
        bound = [min(s - i, mb) for i in range(s)]
        lines.append(
            f"| {mb} | {x['measured']:.3f} | {x['theory']:.3f} | "
            f"{x['peak_live_activations_per_stage']} | {bound} |"
        )
    worst = max(abs(a - c) / abs(a) for a, c in zip(t["losses"], m["losses"]))
    lines += [
        "",
        f"### (pp, dp) = (2, 2) on GPT `small`: `mpirun -n 4` against 4 threads",
        "",
        "| backend | tokens/s | bubble | model state per rank, measured (B) | peak RSS (B) |",
        "|---|---|---|---|---|",
        f"| mpirun -n 4 | {m['tokens_per_s']:.0f} | {m['bubble_fraction']:.3f} | "
        f"{m['model_state_bytes_per_rank']:,} | {m['peak_rss_bytes']:,} |",
        f"| threads, 4 ranks | {t['tokens_per_s']:.0f} | {t['bubble_fraction']:.3f} | "
        f"{t['model_state_bytes_per_rank']:,} | {t['peak_rss_bytes']:,} |",
        "",
        f"Losses of the two backends agree to a maximum relative difference of {worst:.1e} "
        f"over {len(m['losses'])} steps.",
    ]
    return "\n".join(lines) + "\n"


def last20(losses):
    tail = losses[-20:]
    return sum(tail) / len(tail)


def onebit(directory, freeze, cores):
    d = Path(directory)
    runs = {n: json.load(open(d / f"{n}.json")) for n in
            ["default", "onebit_adam", "lamb", "onebit_lamb"]}
    pld = json.load(open(d / "pld.json"))
    freeze = int(freeze)
    base = runs["default"]
    steps = base["steps"]
    lines = [
        "## 1-bit Adam, 1-bit LAMB and progressive layer dropping",
        "",
        f"`bash scripts/bench-onebit.sh` (STEPS={steps}) on a machine with {cores} CPU cores, "
        "Flex backend, fp32, thread ranks.",
        "",
        f"### Convergence and volume: GPT `tiny` ({base['params']:,} parameters), 2 ranks, "
        f"{steps} steps, global batch {base['train_batch_size']}, freeze_step {freeze}",
        "",
        "Configs: `examples/gpt/configs/{default,onebit_adam,lamb,onebit_lamb}.json`; the "
        "script sets `freeze_step` to 20% of the steps. The baseline of 1-bit Adam is Adam in "
        "AdamW mode (decoupled weight decay, as 1-bit Adam applies it). The Adam pair uses "
        "betas (0.9, 0.95), the LAMB pair DeepSpeed's default (0.9, 0.999) and lr 1e-2 (see "
        "the book's chapter on why β2 matters to 1-bit LAMB).",
        "Bytes are those rank 0's transport sent (measured): per step during warm-up, per "
        "step once compressing, and over the whole run.",
        "",
        "| optimizer | mean loss, last 20 steps | vs baseline | bytes/step warm-up "
        "| bytes/step compressing | reduction per step | whole run (B) | whole-run reduction |",
        "|---|---|---|---|---|---|---|---|",
    ]
    pairs = [("default", "Adam (AdamW mode)", None), ("onebit_adam", "OneBitAdam", "default"),
             ("lamb", "LAMB", None), ("onebit_lamb", "OneBitLamb", "lamb")]
    for key, label, ref in pairs:
        r = runs[key]
        loss = last20(r["losses"])
        per = r["comm_bytes_per_step"]
        total = r["comm_bytes_per_rank"][0]
        if ref is None:
            lines.append(f"| {label} | {loss:.4f} | | {per[-1]:,} | | | {total:,} | |")
        else:
            b = runs[ref]
            rel = (loss - last20(b["losses"])) / last20(b["losses"])
            warm = per[freeze - 1]
            comp = per[-1]
            lines.append(
                f"| {label} | {loss:.4f} | {rel:+.2%} | {warm:,} | {comp:,} | "
                f"{b['comm_bytes_per_step'][-1] / comp:.1f}x | {total:,} | "
                f"{b['comm_bytes_per_rank'][0] / total:.2f}x |"
            )
    bl, pl = pld["baseline"], pld["pld"]
    lines += [
        "",
        "The per-step reduction compares a compressed step with the baseline's fp32 "
        "all-reduce of the same number of elements (theory: 32x less for 2 ranks, as both "
        "phases move 1 bit per element against the ring's 2 x 32 bits). With 20% of "
        "the steps in warm-up, the whole run can save at most 1/(0.2 + 0.8/32) = 4.44x.",
        "",
        f"### Progressive layer dropping: GPT `{pld['model']}` ({pld['params']:,} parameters), "
        f"1 rank, batch {pld['batch']}, θ̄ = {pld['theta_bar']}, γ = {pld['gamma']}",
        "",
        f"`pld_bench` trains with and without PLD in one process, one step of each in turn, "
        f"for {pld['steps']} steps; time per sample is measured from step "
        f"{pld['measure_from']} on. Evaluation loss: one fixed held-out batch of 32 sequences, "
        "every layer applied.",
        "",
        "| run | seconds per sample (timed window) | ratio | mean training loss, last 20 "
        "| evaluation loss | θ at the last step |",
        "|---|---|---|---|---|---|",
        f"| without PLD | {bl['seconds_per_sample']:.5f} | 1.00 | {bl['loss_last20_mean']:.4f} "
        f"| {bl['eval_loss']:.4f} | |",
        f"| PLD | {pl['seconds_per_sample']:.5f} | {pld['time_per_sample_ratio']:.3f} "
        f"| {pl['loss_last20_mean']:.4f} | {pl['eval_loss']:.4f} | {pl['theta_last']:.5f} |",
        "",
        "PLD's training loss is measured on the thinned network, so the evaluation loss is "
        "the one to compare.",
    ]
    return "\n".join(lines) + "\n"


def zero(directory, cores):
    d = Path(directory)
    b = json.load(open(d / "bench.json"))
    lines = [
        "## ZeRO stages",
        "",
        f"`bash scripts/bench-zero.sh` (STEPS={b['steps']}, ROUNDS={b['rounds']}) on a machine "
        f"with {cores} CPU cores, Flex backend, fp32, GPT `{b['model']}` "
        f"({b['rows'][0]['params']:,} parameters), global batch {b['batch']} sequences, AdamW, "
        "thread ranks. The stages run interleaved, round by round, in one process; tokens/s "
        "counts every step but the first (warm-up), averaged over the rounds. Ranks beyond the "
        "core count share cores: the ratios measure the engine's overheads, not a speed-up. "
        "Stages 1 and 2 come out faster than stage 0 because each rank steps only its 1/N "
        "slice, with the fused CPU AdamW, where stage 0 runs Burn's AdamW on every tensor. "
        "Stage 3 runs with `stage3_param_persistence_threshold` 0 (every tensor partitioned) "
        "and a prefetch bucket of 5e5 elements; it pays for gathering every weight twice per "
        "micro-batch and for Burn's gradient checkpointing, which recomputes the memory-bound "
        "ops in the backward.",
        "",
        "Every byte and memory figure is labelled: *measured* figures are counted where the "
        "bytes move or are allocated (the transport's copies; the tensors and buffers a rank "
        "holds), *modelled* ones come from a formula applied to the same run.",
        "",
        "| world | stage | tokens/s | over stage 0 | bytes sent per rank per step, measured "
        "| ring model | paper's volume (modelled) | model state per rank, measured (B) "
        "| ZeRO formula (B) | measured / formula | in-step peak, measured (B) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in b["rows"]:
        n, s = r["world"], r["stage"]
        held, formula = r["model_state_bytes_per_rank"], r["model_state_bytes_formula"]
        lines.append(
            f"| {n} | {s} | {r['tokens_per_s']:.0f} | {r['ratio_to_stage0']:.3f} "
            f"| {r['bytes_per_step']:,} | {r['ring_model_bytes_per_step']:,} "
            f"| {r['paper_bytes_per_step']:,.0f} | {held:,} | {formula:,} "
            f"| {held / formula:.3f} | {r['peak_model_state_bytes_per_rank']:,} |"
        )
    lines += [
        "",
        "Measured bytes are what the thread transport copied for rank 0: an all-reduce copies "
        "the whole buffer in and out (n, whatever N), a reduce-scatter the whole input, an "
        "all-gather the rank's chunk. The ring model applies 2(N−1)/N n to the same calls; the "
        "paper's volume is 2(N−1)/N Ψ fp32 values per step for stages 0-2 and 3(N−1)/N Ψ for "
        "stage 3. The ZeRO formula is 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N or 16Ψ/N (fp32 parameters, "
        "gradients, m, v); stage 3 measures a little more because its chunks are padded. The "
        "in-step peak adds the transient buffers (backward's gradient tensors, a reduction "
        "bucket, stage 3's gathered weights) when they are allocated.",
        "",
        "### Peak RSS under `mpirun -n 2` (GPT `small`, 3 steps)",
        "",
        "Activations and the allocator dominate RSS at this size; the model-state column "
        "is what ZeRO partitions. Both are measured.",
        "",
        "| stage | peak RSS per process (B) | model state per rank, measured (B) |",
        "|---|---|---|",
    ]
    for f in sorted(d.glob("mpi-stage*.json")):
        r = json.load(open(f))
        lines.append(f"| {r['zero_stage']} | {r['peak_rss_bytes']:,} | "
                     f"{r['model_state_bytes_per_rank']:,} |")
    runs = {s: d / f"mpi-medium-stage{s}.json" for s in (0, 3)}
    if all(p.exists() for p in runs.values()):
        r0, r3 = (json.load(open(runs[s])) for s in (0, 3))
        psi, n = r0["params"], r0["world"]
        predicted = 16 * psi - 16 * psi / n
        saved = r0["peak_rss_bytes"] - r3["peak_rss_bytes"]
        lines += [
            "",
            f"### Peak RSS under `mpirun -n 2`, GPT `medium` ({psi:,} parameters, 2 steps, "
            "batch 2)",
            "",
            "| stage | peak RSS per process (B) | model state per rank, measured (B) "
            "| in-step peak of model state, measured (B) |",
            "|---|---|---|---|",
        ]
        for r in (r0, r3):
            lines.append(f"| {r['zero_stage']} | {r['peak_rss_bytes']:,} "
                         f"| {r['model_state_bytes_per_rank']:,} "
                         f"| {r['peak_model_state_bytes_per_rank']:,} |")
        lines += [
            "",
            f"Stage 3 saves {saved:,} B of peak RSS per process (measured); the formula "
            f"predicts 16Ψ − 16Ψ/N = {predicted:,.0f} B (modelled), so {saved / predicted:.1%} "
            "of it shows in RSS.",
        ]
    return "\n".join(lines) + "\n"


def learner(directory, cores):
    runs = {}
    for f in sorted(Path(directory).glob("*.json")):
        r = json.load(open(f))
        name = r["strategy"] if r["stage"] is None else f"DeepSpeedStrategy, stage {r['stage']}"
        runs.setdefault((r["world"], name), []).append(r)
    if not runs:
        raise SystemExit(f"no runs in {directory}")

    any_run = next(iter(runs.values()))[0]
    rounds = max(len(v) for v in runs.values())
    lines = [
        "## Learner strategy beside Burn's `MultiDevice(OptimSharded)`",
        "",
        f"`bash scripts/bench-learner.sh` (STEPS={any_run['steps']}, ROUNDS={rounds}) on a "
        f"machine with {cores} CPU cores, Flex backend, fp32. GPT `{any_run['model']}` "
        f"({any_run['params']:,} parameters), 4 sequences per rank per step, one epoch inside "
        "`SupervisedTraining` with the Learner's AdamW (lr 1e-3). Each run is its own process, "
        "so its peak RSS (`VmHWM`) is its own; every rank or Burn device is a thread of that "
        "process, so the per-rank share is the process's peak over the world size. The "
        "configurations are interleaved round by round; the table gives each one's median. "
        "tokens/s counts training tokens over the whole `launch` (including one validation "
        "batch and the event processing, the same for all).",
        "",
        "Burn's `OptimSharded` steps each parameter on one device (chosen by its id) and keeps "
        "a full replica and full gradients on every device. It adds the devices' gradients "
        "instead of averaging them, so its trajectory (held-out loss) differs; ours equals "
        "stage 0's at every stage.",
        "",
        "Why Burn's is faster here: its devices are threads of one process sharing one "
        "address space, so a parameter's gradients are added and stepped where they lie, "
        "with no copies. Our ranks keep to SPMD as under MPI: gradients go through flat "
        "buffers and the communicator, and at stage 0 every rank steps the whole model with "
        "its own optimizer. Stage 3 holds the least: each rank stores its chunks, and only "
        "the tensor in use is whole.",
        "",
        "| world | strategy | tokens/s | ratio to Burn's | peak RSS (B) | per rank (B) "
        "| RSS ratio to Burn's | held-out loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world in sorted({w for w, _ in runs}):
        base = runs.get((world, "burn-sharded"))
        base_tps = median([r["tokens_per_s"] for r in base]) if base else None
        base_rss = median([r["peak_rss_bytes"] for r in base]) if base else None
        names = sorted((n for w, n in runs if w == world), key=lambda n: (n != "burn-sharded", n))
        for name in names:
            rs = runs[(world, name)]
            tps = median([r["tokens_per_s"] for r in rs])
            rss = int(median([r["peak_rss_bytes"] for r in rs]))
            label = "Burn `MultiDevice(OptimSharded)`" if name == "burn-sharded" else name
            ratio = f"{tps / base_tps:.2f}" if base_tps else "-"
            rss_ratio = f"{rss / base_rss:.2f}" if base_rss else "-"
            lines.append(
                f"| {world} | {label} | {tps:.0f} | {ratio} | {rss:,} | {rss // world:,} "
                f"| {rss_ratio} | {rs[0]['held_out_loss']:.4f} |"
            )
    lines.append("")
    return "\n".join(lines) + "\n"


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


def offload(directory, cores):
    d = Path(directory)
    s = json.load(open(d / "swap.json"))
    g = {k: json.load(open(d / f"gpt_{k}.json")) for k in ("none", "nvme")}
    gb = s["state_bytes"] / 1e9
    lines = [
        "## ZeRO-Offload and ZeRO-Infinity",
        "",
        f"`bash scripts/bench-offload.sh` on a machine with {cores} CPU cores; swap files in "
        "the system's temp folder (ext4 on a virtual disk here).",
        "",
        f"### The swapper against the disk, one optimizer state of {gb:.2f} GB "
        f"({s['elements']:,} elements of fp32 masters, m and v, tiles of {s['tile']:,})",
        "",
        "The disk's own bandwidth: one thread writing, then reading, the same number of bytes "
        "sequentially in 8 MiB `O_DIRECT` requests, one at a time (`dd oflag=direct bs=8M`), "
        "measured in the same run. A swap pass reads and writes every tile back (no work on "
        "it), pipelined, with DeepSpeed's `aio` defaults (1 MiB requests, 8 in flight). Its "
        "efficiency is the disk's time to read and write the state at the rates above, over "
        "the pass's wall time: above 1 means that the swapper's requests in flight, and its "
        "reads beside its writes, move bytes faster than one sequential stream does. All data "
        "is incompressible noise, since a virtual disk may store zeros without moving them. "
        f"Median of {s['reps']}.",
        "",
        "| what | engine | seconds | GB/s | efficiency |",
        "|---|---|---|---|---|",
        f"| disk write, `O_DIRECT` 8 MiB | pwrite | {s['state_bytes'] / 1e9 / s['raw_write_gb_per_s']:.2f} "
        f"| {s['raw_write_gb_per_s']:.3f} | |",
        f"| disk read, `O_DIRECT` 8 MiB | pread | {s['state_bytes'] / 1e9 / s['raw_read_gb_per_s']:.2f} "
        f"| {s['raw_read_gb_per_s']:.3f} | |",
    ]
    for p in s["swap_passes"]:
        lines.append(
            f"| swap pass (read + write back) | {p['engine']} | {p['seconds']:.2f} "
            f"| {p['read_write_gb_per_s']:.3f} (read + written) | {p['efficiency']:.2f} |"
        )
    lines += [
        f"| Adam step from the swap file | {s['adam_swapped_engine']} "
        f"| {s['adam_swapped_seconds']:.2f} | | {s['adam_swapped_efficiency']:.2f} |",
        f"| Adam step in memory | | {s['adam_in_memory_seconds']:.2f} | | |",
        "",
        f"### GPT `small` at ZeRO stage 3, {g['none']['world']} thread ranks, "
        f"{g['none']['steps']} steps of {g['none']['train_batch_size']} sequences",
        "",
        "Model state in memory per rank is measured where it is allocated (the largest over "
        "ranks). With `nvme` the optimizer holds only its tile buffers (three tiles of "
        "`sub_group_size` 500,000 elements, pipelined), and the swap file (rank 0's) holds fp32 "
        "masters, m and v. On a model this small, the tile buffers are close to the m and v "
        "they replace, so memory barely drops. Swap GB/s is bytes moved over the time spent "
        "in transfers, which overlap the step. Six steps on a shared 2-core machine: tokens/s "
        "varies by about 10% from run to run.",
        "",
        "| `offload_optimizer` | tokens/s | model state in memory per rank (B) "
        "| swap file (B) | swap read / write GB/s | final loss |",
        "|---|---|---|---|---|---|",
    ]
    for k in ("none", "nvme"):
        r = g[k]
        sw = r.get("swap")
        swap_cols = (
            f"{sw['disk_bytes']:,} | {sw['read_gb_per_s']:.3f} / {sw['write_gb_per_s']:.3f}"
            if sw else " | "
        )
        lines.append(
            f"| {k} | {r['tokens_per_s']:.0f} | {r['model_state_bytes_per_rank']:,} "
            f"| {swap_cols} | {r['losses'][-1]:.4f} |"
        )
    same = g["none"]["losses"] == g["nvme"]["losses"]
    lines += [
        "",
        f"Losses identical with and without offload: {'yes' if same else 'no'}.",
        "",
    ]
    return "\n".join(lines) + "\n"


def moonshot(directory, cores, mem_bytes):
    d = Path(directory)
    r = json.load(open(d / "xl.last.json"))
    err = open(d / "xl.err").read()
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", err)
    time_rss = int(m.group(1)) * 1024 if m else None
    base = r["disk_baseline"]
    params = r["params"]
    losses = r["losses"]
    steps = len(losses)
    step_secs = [x * r["train_batch_size"] for x in r["step_seconds_per_sample"]]
    opt = r["swap"]
    par = r["param_store"]["swap"]
    gib = 1 << 30
    lines = [
        "## ZeRO-Infinity: a 2-billion-parameter GPT on one machine",
        "",
        f"`bash scripts/moonshot.sh` on a machine with {cores} CPU cores and "
        f"{int(mem_bytes) / gib:.1f} GiB of RAM; swap files in the system's temp folder (ext4 on "
        "a virtual disk here). GPT `xl`: d 2048, 40 layers, 16 heads, context 128, "
        f"{params:,} parameters. Its fp32 model states at ZeRO's 16 bytes per parameter "
        f"(formula, not measured) would be {16 * params / 1e9:.1f} GB, more than the machine's RAM. "
        "ZeRO stage 3 on one rank, AdamW with a linear warm-up (WarmupLR, 1e-6 to 1e-5 over 8 "
        "steps), 2 sequences per step, blocks checkpointed; parameters "
        "(fp32 pieces, read ahead of their gathers) and optimizer state (fp32 masters, m and v, "
        "stepped in tiles of 10M elements, reads and writes pipelined) in swap files through "
        f"{opt['engine']} with `O_DIRECT`.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| optimizer steps | {steps} |",
        f"| loss at each step | {' -> '.join(f'{x:.3f}' for x in losses)} |",
        f"| seconds per step (each step) | {', '.join(f'{x:.0f}' for x in step_secs)} |",
        f"| of which forward + backward (s) | {', '.join(f'{x:.0f}' for x in r['forward_backward_seconds'])} |",
        f"| of which optimizer step (s) | {', '.join(f'{x:.0f}' for x in r['optimizer_seconds'])} |",
        f"| peak RSS, the report (GB) | {r['peak_rss_bytes'] / 1e9:.2f} |",
    ]
    if time_rss:
        lines.append(f"| peak RSS, `time -v` (GB) | {time_rss / 1e9:.2f} |")
    lines += [
        f"| model state in memory (GB): pieces' gradients, tile and read-ahead buffers | "
        f"{r['model_state_bytes_per_rank'] / 1e9:.2f} |",
        f"| parameter swap file (GB) | {par['disk_bytes'] / 1e9:.2f} |",
        f"| optimizer swap file (GB) | {opt['disk_bytes'] / 1e9:.2f} |",
        "",
        f"The disk's own bandwidth, measured by the same run before training (one thread, 8 MiB "
        f"`O_DIRECT` requests, {base['bytes'] / 1e9:.1f} GB of noise): write "
        f"{base['write_gb_per_s']:.3f} GB/s, read {base['read_gb_per_s']:.3f} GB/s. The swap "
        "files' GB/s below are bytes moved over the time spent in their transfers (which "
        "overlap compute, and each other: the optimizer's reads run beside its writes); "
        "the share is that rate over the disk's rate in the same direction.",
        "",
        "| swap file | read GB | read GB/s (share of the disk's) | written GB | write GB/s (share) |",
        "|---|---|---|---|---|",
    ]
    for name, sw in (("parameters", par), ("optimizer", opt)):
        lines.append(
            f"| {name} | {sw['bytes_read'] / 1e9:.1f} | {sw['read_gb_per_s']:.3f} "
            f"({sw['read_gb_per_s'] / base['read_gb_per_s']:.0%}) | {sw['bytes_written'] / 1e9:.1f} "
            f"| {sw['write_gb_per_s']:.3f} ({sw['write_gb_per_s'] / base['write_gb_per_s']:.0%}) |"
        )
    # The optimizer step's wall time against the disk's time to move its bytes at the
    # baseline rates (a step moves the whole state in and out).
    moved = opt["disk_bytes"] / 1e9
    disk_time = moved / base["read_gb_per_s"] + moved / base["write_gb_per_s"]
    steady = r["optimizer_seconds"][1:] or r["optimizer_seconds"]
    lines += [
        "",
        f"Each optimizer step reads and writes the {moved:.1f} GB optimizer state once and "
        f"writes the parameters: at the disk's rates that is {disk_time:.0f} s of transfers for "
        f"the state alone; the step took {min(steady):.0f}-{max(steady):.0f} s "
        f"({disk_time / (sum(steady) / len(steady)):.0%} of the disk's time, the overlap of "
        "reads with writes included).",
        "",
    ]
    return "\n".join(lines) + "\n"


def device_flex(out, rounds, rev, cores):
    """Flex before and after the device-resident regimes: `scripts/bench-zero-compare.sh`."""
    rounds = int(rounds)

    def speeds(side):
        by_stage = {}
        for r in range(1, rounds + 1):
            for row in json.load(open(f"{out}/{side}-bench-{r}.json"))["rows"]:
                by_stage.setdefault(row["stage"], []).append(row["tokens_per_s"])
        return {s: sum(v) / len(v) for s, v in by_stage.items()}

    before, after = speeds("before"), speeds("after")
    lines = [
        "## Training on the model's device: Flex before and after",
        "",
        f"`bash scripts/bench-zero-compare.sh {rev}` (`ROUNDS={rounds}`): the ZeRO benchmark of",
        f"`{rev}` (the last commit before the device-resident regimes) and of this checkout,",
        "built side by side and interleaved round by round in one session on GPT `small`, world 2,",
        f"{cores} cores; tokens/s averaged over the rounds. Flex keeps the host regimes, so the",
        "losses of GPT `small` trained 3 steps at each stage by both binaries must be identical.",
        "",
        "| stage | before tokens/s | after tokens/s | after / before | losses bit-identical |",
        "|---|---|---|---|---|",
    ]
    for s in sorted(before):
        lb = json.load(open(f"{out}/before-gpt-stage{s}.json"))["losses"]
        la = json.load(open(f"{out}/after-gpt-stage{s}.json"))["losses"]
        same = "yes" if lb == la else f"no: {lb} vs {la}"
        lines.append(
            f"| {s} | {before[s]:.0f} | {after[s]:.0f} | {after[s] / before[s]:.3f} | {same} |"
        )
    return "\n".join(lines) + "\n\n"


def grid3d(bench, mpi, cores):
    b = json.load(open(bench))
    m = json.load(open(mpi))
    lines = [
        "## 3D parallelism: tensor x pipeline x data",
        "",
        f"`bash scripts/bench-3d.sh` (STEPS={b['steps']}, ROUNDS={b['rounds']}) on a machine with "
        f"{cores} CPU cores, Flex backend, fp32. GPT `{b['model']}` ({b['params']:,} parameters), "
        f"{b['ranks']} thread ranks, global batch {b['train_batch_size']} sequences in micro-batches "
        "of 2, AdamW, ZeRO stage 1 on the data axis, every grid through the pipeline engine (one "
        "stage when pp = 1). Eight ranks share the cores, so the tokens/s measure the engine's "
        "overheads and each axis's traffic on a CPU, not the speed-up of dedicated devices.",
        "",
        "Same process, interleaved rounds (median tokens/s of the whole runs), ratios against "
        "tp 1 x pp 1 x dp 8 in the same process. Model state: the largest rank's parameters, "
        "gradients and optimizer state, measured where they are allocated, beside ZeRO stage 1's "
        "formula for its slice of its stage (Ψ_r = the stage's parameters / tp; 4Ψ_r + 4Ψ_r + "
        "8Ψ_r/dp). Traffic: bytes each rank sent per step along each axis, measured by the "
        "communicators, averaged over the ranks. Every grid trains the same losses.",
        "",
        "| tp | pp | dp | tokens/s | vs dp 8 | model state per rank, measured (B) | formula (B) "
        "| tensor axis (B/step) | pipe axis (B/step) | data axis (B/step) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in b["grids"]:
        lines.append(
            f"| {g['tp']} | {g['pp']} | {g['dp']} | {g['tokens_per_s']:.0f} | {g['ratio_to_dp8']:.2f} "
            f"| {g['model_state_bytes_per_rank']:,} | {g['model_state_bytes_formula']:,} "
            f"| {g['tensor_bytes_per_rank_step']:,.0f} | {g['pipe_bytes_per_rank_step']:,.0f} "
            f"| {g['data_bytes_per_rank_step']:,.0f} |"
        )
    first = b["grids"][0]["losses"]
    worst = max(
        abs(x - y) / abs(x) for g in b["grids"] for x, y in zip(first, g["losses"])
    )
    steps = m["steps"]
    axis = m["comm_bytes_per_axis"]
    per = lambda k: sum(a[k] for a in axis) / (len(axis) * steps)
    lines += [
        "",
        f"Largest relative loss difference between grids: {worst:.1e}.",
        "",
        "### (tp, pp, dp) = (2, 2, 2) under `mpirun -n 8` (examples/gpt/configs/3d.json)",
        "",
        "| tokens/s | model state per rank, measured (B) | formula (B) | peak RSS per process (B) "
        "| tensor (B/step) | pipe (B/step) | data (B/step) |",
        "|---|---|---|---|---|---|---|",
        f"| {m['tokens_per_s']:.0f} | {m['model_state_bytes_per_rank']:,} "
        f"| {m['model_state_bytes_formula']:,} | {m['peak_rss_bytes']:,} "
        f"| {per('tensor'):,.0f} | {per('pipe'):,.0f} | {per('data'):,.0f} |",
    ]
    return "\n".join(lines) + "\n"


def inference(directory, new, cores):
    d = Path(directory)
    runs = [(f"threads, tp {tp}", json.load(open(d / f"threads-{tp}.json"))) for tp in (1, 2, 4)]
    runs.append(("mpirun -n 2, tp 2", json.load(open(d / "mpi-2.json"))))
    lines = [
        "## Inference: generation from key/value caches",
        "",
        f"`bash scripts/bench-inference.sh` (NEW={new}) on a machine with {cores} CPU cores, Flex "
        f"backend, fp32. GPT `small` (seed-initialized: the speed does not depend on training), "
        f"4 prompts of one byte, {new} new tokens each (the context is 256), greedy. Each run "
        "also generates by full recomputation (the whole sequences again for every token, no "
        "cache) in the same process: the ratio is decode from the caches over that, and the "
        "tokens must be the same. Ranks beyond the core count share the cores.",
        "",
        "| run | prefill tokens/s | decode tokens/s | recompute tokens/s | decode / recompute "
        "| first token (s) | per token p50 (s) | p99 (s) | weight bytes per rank | cache bytes per rank "
        "| same tokens as recompute |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    first = runs[0][1]["tokens"]
    for name, r in runs:
        lines.append(
            f"| {name} | {r['prefill_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.0f} "
            f"| {r['recompute_tokens_per_s']:.1f} "
            f"| {r['decode_tokens_per_s'] / r['recompute_tokens_per_s']:.1f} "
            f"| {r['time_to_first_token_s']:.4f} | {r['token_latency_p50_s']:.4f} "
            f"| {r['token_latency_p99_s']:.4f} | {r['weight_bytes_per_rank']:,} "
            f"| {r['cache_bytes_per_rank']:,} | {r['matches_recompute']} |"
        )
    same = all(r["tokens"] == first for _, r in runs)
    lines += [
        "",
        f"Every run generated the same tokens as tp 1: {same}.",
    ]
    return "\n".join(lines) + "\n"


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


def moe(directory, steps, cores):
    d = Path(directory)
    load = lambda name: json.load(open(d / f"{name}.json"))
    small, moe_, pr = load("small"), load("small-moe"), load("small-pr-moe")
    student, kd, serve = load("student"), load("student-kd"), load("serve")
    lines = [
        "## Mixture of Experts",
        "",
        f"`bash scripts/bench-moe.sh` (STEPS={steps}) on a machine with {cores} CPU cores, "
        "Flex, fp32, 2 data-parallel thread ranks, the example's default config (AdamW, "
        "global batch 16 sequences of 256 bytes). Every model trains on the embedded corpus's "
        f"first 62,000 bytes with the same batches; the held-out loss is over the other "
        f"{CORPUS.stat().st_size - 62000:,} bytes' non-overlapping windows "
        f"({small['heldout_tokens']:,} tokens). The MoE models run at `ep_size` 2: each rank "
        "holds half the experts of every MoE block, and the tokens cross ranks by all-to-all. "
        "All-to-all bytes are what rank 0's expert-parallel communicator counted in forward "
        "and backward; drops and load balance are rank 0's, over its MoE blocks.",
        "",
        "| model | parameters | held-out loss | vs `small` | tokens/s | ratio to `small` "
        "| all-to-all bytes per step | tokens dropped | load balance |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in (("small", small), ("small-moe", moe_), ("small-pr-moe", pr)):
        m = r.get("moe")
        a2a = f"{int(median(m['all_to_all_bytes'])):,}" if m else "0"
        dropped = (
            f"{100 * sum(m['tokens_dropped']) / max(1, sum(m['tokens_routed'])):.1f}%"
            if m else ""
        )
        balance = f"{sum(m['load_balance']) / len(m['load_balance']):.2f}" if m else ""
        lines.append(
            f"| `{name}` | {r['params']:,} | {r['heldout_loss']:.4f} "
            f"| {100 * (r['heldout_loss'] / small['heldout_loss'] - 1):+.2f}% "
            f"| {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / small['tokens_per_s']:.2f} "
            f"| {a2a} | {dropped} | {balance} |"
        )
    lines += [
        "",
        f"PR-MoE against MoE: held-out loss {pr['heldout_loss']:.4f} against "
        f"{moe_['heldout_loss']:.4f} ({100 * (pr['heldout_loss'] / moe_['heldout_loss'] - 1):+.2f}%) "
        f"with {pr['params'] / moe_['params']:.2f} of its parameters "
        f"({pr['params']:,} against {moe_['params']:,}).",
        "",
        "### Mixture-of-Students",
        "",
        f"The student is `small-moe` with half its layers (4 blocks, 2 of them MoE). Trained "
        f"{steps} steps alone, and the same {steps} steps distilled from the `small-moe` above "
        f"(loss = CE + T²·KL from the teacher at T = 1; staged: the teacher's term for the first "
        f"{kd['distilled_steps']} steps, then the CE alone).",
        "",
        "| student | parameters | held-out loss | vs alone |",
        "|---|---|---|---|",
        f"| alone | {student['params']:,} | {student['heldout_loss']:.4f} | |",
        f"| distilled (MoS) | {kd['params']:,} | {kd['heldout_loss']:.4f} "
        f"| {100 * (kd['heldout_loss'] / student['heldout_loss'] - 1):+.2f}% |",
        f"| the teacher | {moe_['params']:,} | {moe_['heldout_loss']:.4f} "
        f"| {100 * (moe_['heldout_loss'] / student['heldout_loss'] - 1):+.2f}% |",
        "",
        "### Serving the MoE model",
        "",
        f"The `small-moe` checkpoint, written at `ep_size` 2 (every expert in it), served whole "
        f"by the generate example: held-out loss {serve['heldout_loss']:.6f} against "
        f"{moe_['heldout_loss']:.6f} at the end of training, "
        f"{serve['decode_tokens_per_s']:.0f} decode tokens/s.",
    ]
    return "\n".join(lines) + "\n"


def write_section(name, body):
    text = PATH.read_text() if PATH.exists() else HEADER
    block = f"<!-- section: {name} -->\n{body}<!-- end: {name} -->\n"
    pattern = re.compile(
        rf"<!-- section: {re.escape(name)} -->\n.*?<!-- end: {re.escape(name)} -->\n", re.S
    )
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip("\n") + "\n\n" + block
    PATH.write_text(text)
    print(f"wrote the `{name}` section of {PATH}")


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


def paired_rounds(runs, timed):
    """On/off tokens/s ratios round by round, and the largest loss difference of the pairs."""
    pairs = list(zip(runs["false"], runs["true"]))
    paired = [timed(on) / timed(off) for off, on in pairs]
    diff = max(abs(x - y) for off, on in pairs for x, y in zip(off["losses"], on["losses"]))
    return paired, diff


def overlap(directory, cores):
    d = Path(directory)
    t = json.load(open(d / "threads.json"))
    lines = [
        "## `overlap_comm` at ZeRO stage 2",
        "",
        f"`bash scripts/bench-overlap.sh` on a machine with {cores} CPU cores, Flex, fp32: GPT "
        f"`{t['model']}`, {t['ranks']} data-parallel ranks, a global batch of {t['batch']} "
        f"sequences in {t['accumulation']} micro-batches per step, AdamW, buckets of 5e5 "
        "elements. Off, each micro-batch's buckets are reduce-scattered by the rank thread right "
        "after its backward; on, by the rank's communication thread while the rank runs the next "
        "micro-batch (the last one's are waited for at the step). Tokens/s are measured over "
        f"{t['steps'] - 1} steps per run (the first is untimed), medians of {t['rounds']} runs "
        "of each, off and on alternating. `accumulate` is the slowest rank thread's time "
        "handing gradients over, per step (off: staging, reducing and waiting for the other "
        "rank; on: staging only). Both compute the same steps: the loss columns give the "
        "largest difference between them.",
        "",
        "| ranks | MPI polling | overlap_comm | tokens/s | on / off | accumulate (ms/step) "
        "| peak model state per rank (MB) | max loss difference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    off_tps = t["rows"][0]["tokens_per_s"]
    for row in t["rows"]:
        ratio = "1.00" if row["overlap_comm"] == "off" else f"{t['ratio_on_over_off']:.3f}"
        diff = f"{t['max_loss_diff']:.1e}" if row["overlap_comm"] == "on" else ""
        lines.append(
            f"| threads | | {row['overlap_comm']} | {row['tokens_per_s']:.0f} | {ratio} | "
            f"{row['accumulate_ms_per_step']:.1f} | "
            f"{row['peak_model_state_bytes_per_rank'] / 1e6:.1f} | {diff} |"
        )
    seq = 256 if t["model"] == "small" else 128

    def timed(r):
        secs = [s * r["train_batch_size"] for s in r["step_seconds_per_sample"][1:]]
        return len(secs) * r["train_batch_size"] * seq / sum(secs)

    ratios = {}
    for y, polling in [(0, "busy (default)"), (1, "`mpi_yield_when_idle`")]:
        runs = {}
        for ov in ["false", "true"]:
            runs[ov] = [
                json.load(open(f))
                for f in sorted(d.glob(f"mpi-yield{y}-{ov}-*.json"))
                if f.stat().st_size > 0
            ]
        if not runs["false"] or not runs["true"]:
            continue
        # Paired by round: on over off within the same round.
        paired, diff = paired_rounds(runs, timed)
        ratios[polling] = paired
        for ov in ["false", "true"]:
            rs = runs[ov]
            tps = median(timed(r) for r in rs)
            acc = median(
                max(b["accumulate"] for b in r["breakdown_per_rank"]) for r in rs
            )
            name = "on" if ov == "true" else "off"
            ratio = "1.00" if ov == "false" else f"{median(paired):.3f}"
            peak = rs[-1]["peak_model_state_bytes_per_rank"] / 1e6
            lines.append(
                f"| `mpirun -n 2` | {polling} | {name} | {tps:.0f} | {ratio} | {acc:.1f} | "
                f"{peak:.1f} | {'' if ov == 'false' else f'{diff:.1e}'} |"
            )
    lines += [
        "",
        "Under `mpirun` the ratio is the median of the rounds' own on/off ratios "
        + "; ".join(
            f"{k}: " + ", ".join(f"{x:.3f}" for x in v) for k, v in ratios.items()
        )
        + ". Thread ranks, per round: off "
        + ", ".join(f"{x:.0f}" for x in t["rows"][0]["tokens_per_s_rounds"])
        + ", on "
        + ", ".join(f"{x:.0f}" for x in t["rows"][1]["tokens_per_s_rounds"])
        + f" tokens/s (off median {off_tps:.0f}).",
    ]
    return "\n".join(lines) + "\n"


def overlap3(directory, cores):
    d = Path(directory)
    t = json.load(open(d / "threads3.json"))
    seq = 256 if t["model"] == "small" else 128
    lines = [
        "## `overlap_comm` at ZeRO stage 3: parameter prefetch on the communication thread",
        "",
        f"`bash scripts/bench-overlap.sh` on a machine with {cores} CPU cores, Flex, fp32: GPT "
        f"`{t['model']}`, {t['ranks']} data-parallel ranks, a global batch of {t['batch']} "
        f"sequences in {t['accumulation']} micro-batch(es) per step, AdamW, prefetch bundles "
        "of up to 5e5 elements and every tensor partitioned (as "
        "`examples/gpt/configs/zero3.json`, which the `mpirun` rows run). Off, the forward all-gathers a prefetch bundle on the "
        "rank thread when its first tensor is needed; on (DeepSpeed's default at stage 3), the "
        "next bundle is all-gathered on the rank's communication thread while the current "
        "layer computes. The backward's re-gathers and reduce-scatters stay on the rank thread. "
        f"Tokens/s are measured over {t['steps'] - 1} steps per run (the first is untimed), "
        f"medians of {t['rounds']} runs of each, off and on alternating. Both compute the same "
        "steps: the loss column gives the largest difference between them.",
        "",
        "| ranks | overlap_comm | tokens/s | on / off | bundles gathered ahead per run | max loss difference |",
        "|---|---|---|---|---|---|",
    ]
    for row in t["rows"]:
        on = row["overlap_comm"] == "on"
        ratio = f"{t['ratio_on_over_off']:.3f}" if on else "1.00"
        ahead = t.get("gathered_ahead") if on else 0
        diff = f"{t['max_loss_diff']:.1e}" if on else ""
        lines.append(
            f"| threads | {row['overlap_comm']} | {row['tokens_per_s']:.0f} | {ratio} | "
            f"{ahead} | {diff} |"
        )

    def timed(r):
        secs = [x * r["train_batch_size"] for x in r["step_seconds_per_sample"][1:]]
        return len(secs) * r["train_batch_size"] * seq / sum(secs)

    ratios = {}
    for prefix, polling in [("mpi3", "busy (default)"), ("mpi3y", "`mpi_yield_when_idle`")]:
        runs = {
            ov: [
                json.load(open(f))
                for f in sorted(d.glob(f"{prefix}-{ov}-*.json"))
                if f.stat().st_size > 0
            ]
            for ov in ["false", "true"]
        }
        if not runs["false"] or not runs["true"]:
            continue
        paired, diff = paired_rounds(runs, timed)
        ratios[polling] = paired
        for ov in ["false", "true"]:
            rs = runs[ov]
            tps = median(timed(r) for r in rs)
            name = "on" if ov == "true" else "off"
            ratio = "1.00" if ov == "false" else f"{median(paired):.3f}"
            ahead = rs[-1]["gather_stats"]["gathered_ahead"]
            lines.append(
                f"| `mpirun -n 2`, {polling} | {name} | {tps:.0f} | {ratio} | {ahead} | "
                f"{'' if ov == 'false' else f'{diff:.1e}'} |"
            )
    lines += [
        "",
        "Per round, thread ranks: off "
        + ", ".join(f"{x:.0f}" for x in t["rows"][0]["tokens_per_s_rounds"])
        + ", on "
        + ", ".join(f"{x:.0f}" for x in t["rows"][1]["tokens_per_s_rounds"])
        + " tokens/s"
        + "".join(
            f"; `mpirun` ({k}), on/off within each round: " + ", ".join(f"{x:.3f}" for x in v)
            for k, v in ratios.items()
        )
        + ". Under `mpirun` each rank is bound to one core, and OpenMPI's busy polling inside "
        "the communication thread's all-gather takes that core from the forward; with "
        "`mpi_yield_when_idle` the waiting thread yields, as for stage 2's overlap.",
    ]
    return "\n".join(lines) + "\n"


def steady_tokens(report, seq_len):
    """Tokens/s of a GPT run's median step after its first 5 (from its per-step seconds)."""
    return seq_len / median(report["step_seconds_per_sample"][5:])


def vs_pytorch(directory, cores):
    d = Path(directory)
    seq = {"tiny": 128, "small": 256}
    lines = [
        "## Against PyTorch DDP and DeepSpeed on CPU",
        "",
        f"`bash scripts/bench-vs-pytorch.sh` on a machine with {cores} CPU cores (not run in "
        "CI). The same GPT (`scripts/bench_vs_pytorch.py` mirrors the example layer by layer), "
        "data (the same windows of the embedded corpus at each step), global batch (16 "
        "sequences), AdamW, WarmupLR and clipping, at 2 data-parallel ranks: PyTorch under DDP "
        "and DeepSpeed (0.19.8 as the script pins it; CPU accelerator, gloo, `torch_adam`), one thread per rank; ours on "
        "Flex, fp32, as threads and under `mpirun -n 2`. Tokens/s are the median over the "
        "steps after the first 5 (ours: from each step's measured time). PyTorch is "
        f"{json.load(open(d / 'tiny-ddp.json'))['torch']} from PyPI, running its CPU path.",
        "",
        "| model | stage | ours, threads | ours, mpirun | peer | peer tokens/s | ours / peer (best of ours) |",
        "|---|---|---|---|---|---|---|",
    ]

    def ours(path, model):
        r = json.load(open(path))
        return steady_tokens(r, seq[model]), r.get("peak_rss_bytes", 0)

    for model in ["tiny", "small"]:
        if not (d / f"{model}-ddp.json").exists():
            continue
        ddp = json.load(open(d / f"{model}-ddp.json"))
        for stage in range(4):
            t, _ = ours(d / f"{model}-ours{stage}.json", model)
            m, _ = ours(d / f"{model}-mpi{stage}.json", model)
            ds = json.load(open(d / f"{model}-ds{stage}.json"))
            peers = [("DeepSpeed " + ds["deepspeed"] if "deepspeed" in ds else "DeepSpeed", ds)]
            if stage == 0:
                peers.insert(0, ("PyTorch DDP", ddp))
            for name, peer in peers:
                lines.append(
                    f"| `{model}` | {stage} | {t:.0f} | {m:.0f} | {name} "
                    f"| {peer['tokens_per_s']:.0f} | {max(t, m) / peer['tokens_per_s']:.2f} |"
                )
    lines += [
        "",
        "### One process: where the time goes",
        "",
        "The same model and batch of 16 sequences in one process with the machine's cores: "
        "PyTorch (median ms per step after the warm-up), a plain Burn loop and our engine at "
        "stage 0 (mean ms per step, `overhead_bench`). Forward includes reading the loss "
        "back; the step is clipping (PyTorch) and the optimizer.",
        "",
        "| model | loop | forward (ms) | backward (ms) | step (ms) | forward + backward vs PyTorch |",
        "|---|---|---|---|---|---|",
    ]
    for model in ["tiny", "small"]:
        if not (d / f"{model}-torch1.json").exists():
            continue
        torch1 = json.load(open(d / f"{model}-torch1.json"))
        burn1 = json.load(open(d / f"{model}-burn1.json"))
        pt = torch1["phase_ms"]
        base = pt["forward"] + pt["backward"]
        lines.append(
            f"| `{model}` | PyTorch {torch1['torch']}, {torch1['threads_per_rank']} threads "
            f"| {pt['forward']:.1f} | {pt['backward']:.1f} | {pt['step']:.1f} | 1.00 |"
        )
        for loop, name in [("plain", "plain Burn"), ("engine", "engine, stage 0")]:
            ms = burn1[f"{loop}_ms_per_step"]
            lines.append(
                f"| `{model}` | {name} | {ms['forward']:.1f} | {ms['backward']:.1f} "
                f"| {ms['optimizer']:.1f} | {(ms['forward'] + ms['backward']) / base:.2f} |"
            )
    return "\n".join(lines) + "\n"


def last_json(path):
    """The JSON summary a binary printed as its last line of stdout (None when absent)."""
    try:
        lines = [l for l in Path(path).read_text().splitlines() if l.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def test_counts(path):
    """Passed and failed counts from a test harness's output."""
    passed = failed = 0
    for m in re.finditer(r"test result: \w+\. (\d+) passed; (\d+) failed", Path(path).read_text()):
        passed += int(m.group(1))
        failed += int(m.group(2))
    return passed, failed


def max_rel(reference, other):
    """The largest relative difference of `other`'s losses from `reference`'s."""
    return max(abs(a - b) / abs(a) for a, b in zip(reference, other))


def compared(rows):
    """(key, reference, run, largest relative loss difference) for the rows where both ran."""
    for key, reference, run in rows:
        if reference and run:
            yield key, reference, run, max_rel(reference["losses"], run["losses"])


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


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "pipeline":
        write_section("pipeline", pipeline(*sys.argv[2:6]))
    elif kind == "onebit":
        write_section("onebit", onebit(*sys.argv[2:5]))
    elif kind == "zero":
        write_section("zero", zero(*sys.argv[2:4]))
    elif kind == "kernels":
        write_section("kernels", kernels(*sys.argv[2:4]))
    elif kind == "learner":
        write_section("learner", learner(*sys.argv[2:4]))
    elif kind == "precision":
        write_section("precision", precision(*sys.argv[2:4]))
    elif kind == "offload":
        write_section("offload", offload(*sys.argv[2:4]))
    elif kind == "moonshot":
        write_section("moonshot", moonshot(*sys.argv[2:5]))
    elif kind == "device-flex":
        write_section("device-flex", device_flex(*sys.argv[2:6]))
    elif kind == "3d":
        write_section("3d", grid3d(*sys.argv[2:5]))
    elif kind == "inference":
        write_section("inference", inference(*sys.argv[2:5]))
    elif kind == "quantization":
        write_section("quantization", quantization(*sys.argv[2:6]))
    elif kind == "moe":
        write_section("moe", moe(*sys.argv[2:5]))
    elif kind == "overhead":
        write_section("overhead", overhead(*sys.argv[2:4]))
    elif kind == "vs-pytorch":
        write_section("vs-pytorch", vs_pytorch(*sys.argv[2:4]))
    elif kind == "overlap":
        write_section("overlap", overlap(*sys.argv[2:4]))
    elif kind == "overlap3":
        write_section("overlap3", overlap3(*sys.argv[2:4]))
    elif kind == "gpu":
        write_section("gpu", gpu(*sys.argv[2:3]))
    else:
        sys.exit(f"unknown section {kind}")
