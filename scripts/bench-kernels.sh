#!/usr/bin/env bash
# Regenerates the kernel section of BENCHMARKS.md: the CPU kernels (fused AdamW at 16M
# parameters against a parallel memcpy and Burn's AdamW on Flex, quantization, 1-bit
# compression), measured in one run of `kernel-bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
PARAMS="${PARAMS:-16777216}"
REPS="${REPS:-7}"
out="${CARGO_TARGET_DIR:-target}/bench-kernels"
mkdir -p "$out"
cargo bench -p burn-deepspeed-cubecl-kernels --bench kernel-bench -- --params "$PARAMS" \
    --reps "$REPS" --json | tail -n 1 > "$out/kernels.json"
python3 scripts/benchmarks_md.py kernels "$out/kernels.json" "$(nproc)"
