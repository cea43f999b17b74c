#!/usr/bin/env bash
# Regenerates the precision section of BENCHMARKS.md: fp32, fp16 and bf16 at ZeRO stages 0-3
# on GPT `tiny` with 2 thread ranks (tokens/s, model state, stage-3 gather bytes, activation
# heap, tail loss against fp32), and activation checkpointing on GPT `small` (sequence 256,
# micro-batch 16, one rank: activation heap, tokens/s, losses).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS="${STEPS:-300}"
ROUNDS="${ROUNDS:-1}"
AC_STEPS="${AC_STEPS:-4}"
AC_ROUNDS="${AC_ROUNDS:-2}"
cargo build --release --example precision_bench
bin="${CARGO_TARGET_DIR:-target}/release/examples"
out="${CARGO_TARGET_DIR:-target}/bench-precision"
mkdir -p "$out"
"$bin/precision_bench" --part activation --model small --micro-batch 16 \
    --steps "$AC_STEPS" --rounds "$AC_ROUNDS" --json | tail -n 1 > "$out/activation.json"
"$bin/precision_bench" --part precision --model tiny --world 2 --micro-batch 8 \
    --steps "$STEPS" --rounds "$ROUNDS" --json | tail -n 1 > "$out/precision.json"
python3 scripts/benchmarks_md.py precision "$out" "$(nproc)"
