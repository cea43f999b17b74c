"""The `moe` section of BENCHMARKS.md."""
import json
from statistics import median
from pathlib import Path

from .common import CORPUS


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

