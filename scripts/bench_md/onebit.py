"""The `onebit` section of BENCHMARKS.md."""
import json
from pathlib import Path

from .common import last20


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

