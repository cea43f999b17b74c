#!/usr/bin/env bash
# Regenerates the engine-overhead section of BENCHMARKS.md: GPT `tiny` and `small` trained
# by a plain Burn loop (Burn's AdamW, no engine) and by the engine at one rank, stage 0, in
# one process, alternating, with each step split into phases; and the plain loop again with
# Burn's own softmax, layer norm and GELU instead of burn_deepspeed::fused's (`--unfused`).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS_TINY="${STEPS_TINY:-30}"
STEPS_SMALL="${STEPS_SMALL:-12}"
ROUNDS="${ROUNDS:-3}"
cargo build --release --example overhead_bench
bin="${CARGO_TARGET_DIR:-target}/release/examples/overhead_bench"
out=$(mktemp -d)
"$bin" --model tiny --steps "$STEPS_TINY" --warm-up 5 --rounds "$ROUNDS" --unfused --json \
    | tail -n 1 > "$out/tiny.json"
"$bin" --model small --steps "$STEPS_SMALL" --warm-up 2 --rounds "$ROUNDS" --unfused --json \
    | tail -n 1 > "$out/small.json"
python3 scripts/benchmarks_md.py overhead "$out" "$(nproc)"
