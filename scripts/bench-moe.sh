#!/usr/bin/env bash
# Regenerates the Mixture-of-Experts section of BENCHMARKS.md (DeepSpeed-MoE, arXiv 2201.05596):
#   1. GPT `small` against `small-moe` (8 experts, top-1, every other block: the same compute
#      per token) and `small-pr-moe` (PR-MoE: a residual MLP beside 2 experts in the first two
#      MoE blocks and 4 in the last two), STEPS steps each on 2 data-parallel ranks (the
#      MoE models at ep_size 2), the same data and batches; held-out loss on the embedded
#      corpus's bytes after the first 62,000, tokens/s, and the all-to-all bytes per step as
#      the communicator counted them.
#   2. Mixture-of-Students: `small-moe` with half its layers (2 of the 4 MoE blocks) trained
#      for STEPS steps alone, and distilled from the `small-moe` of step 1 (the teacher's
#      term until 3/4 of the steps: staged KD).
#   3. MoE inference: the `small-moe` checkpoint (written at ep_size 2) served whole by the
#      generate example, its held-out loss against the training run's.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS="${STEPS:-200}"
cargo build --release -p burn-deepspeed-example-gpt --example gpt --example generate
bin="${CARGO_TARGET_DIR:-target}/release/examples"
out=$(mktemp -d)
corpus=examples/gpt/data/corpus.txt
heldout=$(( $(wc -c < "$corpus") - 62000 ))
tail -c "$heldout" "$corpus" > "$out/heldout.txt"
train() {
    local name=$1
    shift
    "$bin/gpt" --ranks 2 --steps "$STEPS" --heldout-bytes "$heldout" --json "$@" \
        | tail -n 1 > "$out/$name.json"
}
train small --model small
train small-moe --model small-moe --ep-size 2 --save-dir "$out/teacher"
train small-pr-moe --model small-pr-moe --ep-size 2
train student --model small-moe --layers 4 --ep-size 2
train student-kd --model small-moe --layers 4 --ep-size 2 --teacher "$out/teacher" \
    --teacher-model small-moe --kd-stop-step $(( STEPS * 3 / 4 ))
"$bin/generate" --checkpoint "$out/teacher" --model small-moe --eval "$out/heldout.txt" \
    --max-new-tokens 4 --json | tail -n 1 > "$out/serve.json"
python3 scripts/benchmarks_md.py moe "$out" "$STEPS" "$(nproc)"
