#!/usr/bin/env bash
# Regenerates the pipeline section of BENCHMARKS.md: pp = 2 against dp = 2 on `small` (in one
# process, interleaved), the bubble of 4 stages at 4, 8 and 16 micro-batches, and the
# (pp, dp) = (2, 2) grid under mpirun -n 4.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
STEPS="${STEPS:-4}"
ROUNDS="${ROUNDS:-2}"
cargo build --release --features burn-deepspeed-example-gpt/mpi \
    --example pipeline_bench --example gpt
target_dir="${CARGO_TARGET_DIR:-target}/release/examples"
out=$(mktemp -d)
"$target_dir/pipeline_bench" --model small --steps "$STEPS" --rounds "$ROUNDS" --json \
    | tail -n 1 > "$out/bench.json"
mpirun -n 4 "$target_dir/gpt" --config examples/gpt/configs/pipeline.json --model small \
    --steps "$STEPS" --json | tail -n 1 > "$out/grid-mpi.json"
"$target_dir/gpt" --config examples/gpt/configs/pipeline.json --model small --ranks 4 \
    --steps "$STEPS" --json | tail -n 1 > "$out/grid-threads.json"
python3 scripts/benchmarks_md.py pipeline "$out/bench.json" "$out/grid-mpi.json" \
    "$out/grid-threads.json" "$(nproc)"
