"""DeepSpeed's own top-1 and top-2 gating on seeded random logits, written as the test vectors
of `burn_deepspeed::moe::gating` (crates/burn-deepspeed/src/moe/deepspeed_gating.json).

Not run in CI. Regenerate with:
    python3 -m venv /tmp/dsvenv && DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install torch deepspeed
    /tmp/dsvenv/bin/python scripts/moe-gating-vectors.py
Top-2 and top-1 without random token selection are deterministic (no noise, no second-expert
sampling); top-1 with random token selection records DeepSpeed's draws for the test to replay.
"""
import json
import os
import sys

import torch
import deepspeed
from deepspeed.moe import sharded_moe
from deepspeed.moe.sharded_moe import top1gating, top2gating

# (tokens, experts, capacity_factor, min_capacity): drops at low factors, min_capacity
# binding at few tokens, ragged token counts.
SHAPES = [(16, 4, 1.0, 4), (64, 8, 1.0, 4), (100, 8, 0.5, 2), (37, 5, 1.25, 1),
          (128, 16, 2.0, 4), (12, 6, 1.0, 8), (50, 2, 0.3, 1)]


def case(k, tokens, experts, factor, min_capacity, seed, rts):
    torch.manual_seed(seed)
    # Peaked rows as a trained gate makes them, so that experts overflow.
    logits = (torch.randn(tokens, experts) * 2.0).float()
    draws = None
    if k == 1:
        if rts:
            # DeepSpeed draws its random token selection from a cached sampler: swap in one
            # that records its [tokens, experts] draws, for the test to replay.
            recorded = []

            def uniform(shape):
                u = torch.rand(shape)
                recorded.append(u)
                return u

            sharded_moe.exp_selection_uniform_map[logits.device] = uniform
        l_aux, combine, dispatch, counts = top1gating(
            logits.clone(), factor, min_capacity, noisy_gate_policy=None,
            drop_tokens=True, use_rts=rts)
        if rts:
            draws = [float(f"{v:.9g}") for v in recorded[0].flatten().tolist()]
    else:
        l_aux, combine, dispatch, counts = top2gating(
            logits.clone(), factor, min_capacity, drop_tokens=True,
            top2_2nd_expert_sampling=False)
    nonzero = combine.nonzero().tolist()
    return {
        "k": k,
        "tokens": tokens,
        "experts": experts,
        "capacity_factor": factor,
        "min_capacity": min_capacity,
        # 9 significant digits name an f32 exactly.
        "logits": [float(f"{v:.9g}") for v in logits.flatten().tolist()],
        "rts_draws": draws,
        "l_aux": float(l_aux),
        "capacity": int(combine.shape[2]),
        # The nonzero combine weights as (token, expert, slot, weight); the dispatch mask is
        # where they are.
        "combine": [[s, e, c, float(f"{float(combine[s, e, c]):.9g}")] for s, e, c in nonzero],
        "dispatch": int(dispatch.sum()),
        "counts": [int(c) for c in counts.tolist()],
    }


def main():
    cases = []
    for i, (tokens, experts, factor, min_capacity) in enumerate(SHAPES):
        # Top-1 with random token selection (DeepSpeed's default; the draws recorded) drops
        # the tokens of lowest draw. Without it, DeepSpeed keeps whichever tokens
        # torch.topk returns among equal mask values (an order torch leaves unspecified), so
        # the deterministic top-1 cases get a factor at which no expert overflows.
        cases.append(case(1, tokens, experts, factor, min_capacity, 1000 + i, True))
        cases.append(case(1, tokens, experts, float(experts), min_capacity, 1500 + i, False))
        cases.append(case(2, tokens, experts, factor, min_capacity, 2000 + i, False))
    out = os.path.join(os.path.dirname(__file__), "..", "crates", "burn-deepspeed", "src",
                       "moe", "deepspeed_gating.json")
    doc = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "cases": cases}
    with open(out, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    print(f"{len(cases)} cases from DeepSpeed {deepspeed.__version__} -> {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
