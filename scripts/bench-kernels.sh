#!/usr/bin/env bash
# Regenerates the kernel section of BENCHMARKS.md: the CPU kernels (fused AdamW at 16M
# parameters against a parallel memcpy and Burn's AdamW on Flex, quantization, 1-bit
# compression), measured in one run of `kernel-bench`. DEVICE=wgpu or DEVICE=cuda adds the
# CubeCL kernels on that runtime (fused AdamW against a device copy), measured in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
PARAMS="${PARAMS:-16777216}"
REPS="${REPS:-7}"
out="${CARGO_TARGET_DIR:-target}/bench-kernels"
mkdir -p "$out"
device=()
features=()
if [ -n "${DEVICE:-}" ]; then
    device=(--device "$DEVICE")
    features=(--features "$DEVICE")
    export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
fi
cargo bench -p burn-deepspeed-cubecl-kernels "${features[@]}" --bench kernel-bench -- \
    --params "$PARAMS" --reps "$REPS" --json "${device[@]}" | tail -n 1 > "$out/kernels.json"
python3 scripts/benchmarks_md.py kernels "$out/kernels.json" "$(nproc)"
