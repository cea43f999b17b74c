#!/usr/bin/env bash
# Regenerates the quantized-inference section of BENCHMARKS.md: held-out quality and weight
# bytes per rank of INT8 and INT4 weights against fp32, and MoQ against quantizing after plain
# training.
#   1. GPT `small` trained for STEPS_SMALL steps (2 data-parallel ranks) on the embedded
#      corpus's first 62,000 bytes; held-out loss, KL from fp32 and weight bytes on the rest,
#      in fp32, bf16, int8 and int4, at tp 1, 2 and 4.
#   2. GPT `tiny` trained for STEPS_TINY steps plainly and with MoQ (configs/moq.json: 16 to
#      8 bits, period 2, so 8 bits from step 256), each evaluated in fp32 and at INT8 with
#      MoQ's own grid (symmetric, one group per matrix) and with the default INT8 and INT4.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS_SMALL="${STEPS_SMALL:-150}"
STEPS_TINY="${STEPS_TINY:-300}"
cargo build --release -p burn-deepspeed-example-gpt --example gpt --example generate
bin="${CARGO_TARGET_DIR:-target}/release/examples"
out=$(mktemp -d)
corpus=examples/gpt/data/corpus.txt
head -c 62000 "$corpus" > "$out/train.txt"
tail -c +62001 "$corpus" > "$out/heldout.txt"
eval_args=(--eval "$out/heldout.txt" --max-new-tokens 4 --json)
"$bin/gpt" --model small --ranks 2 --steps "$STEPS_SMALL" --data "$out/train.txt" \
    --save-dir "$out/small" --json | tail -n 1 > "$out/train-small.json"
for tp in 1 2 4; do
    for dtype in fp32 bf16 int8 int4; do
        "$bin/generate" --checkpoint "$out/small" --model small --tp "$tp" --dtype "$dtype" \
            "${eval_args[@]}" | tail -n 1 > "$out/small-$dtype-$tp.json"
    done
done
for run in plain moq; do
    config=()
    [ "$run" = moq ] && config=(--config examples/gpt/configs/moq.json)
    "$bin/gpt" --model tiny --steps "$STEPS_TINY" "${config[@]}" --data "$out/train.txt" \
        --save-dir "$out/tiny-$run" --json | tail -n 1 > "$out/train-tiny-$run.json"
    for q in "fp32" "int8-grid --dtype int8 --quant-scheme symmetric --quant-group 1000000000" \
        "int8 --dtype int8" "int4 --dtype int4"; do
        name=${q%% *}
        args=(${q#"$name"})
        [ "$name" = fp32 ] && args=(--dtype fp32)
        "$bin/generate" --checkpoint "$out/tiny-$run" --model tiny "${args[@]}" \
            "${eval_args[@]}" | tail -n 1 > "$out/tiny-$run-$name.json"
    done
done
python3 scripts/benchmarks_md.py quantization "$out" "$STEPS_SMALL" "$STEPS_TINY" "$(nproc)"
