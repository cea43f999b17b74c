#!/usr/bin/env bash
# Regenerates the 3D section of BENCHMARKS.md: every grid of 8 ranks that GPT `tiny` splits
# into (tensor x pipeline x data, ZeRO stage 1 on the data axis), in one process with
# interleaved rounds, and the (2, 2, 2) grid under mpirun -n 8 (one process per rank).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
STEPS="${STEPS:-4}"
ROUNDS="${ROUNDS:-3}"
cargo build --release --features burn-deepspeed-example-gpt/mpi \
    --example grid_bench --example gpt
target_dir="${CARGO_TARGET_DIR:-target}/release/examples"
out=$(mktemp -d)
"$target_dir/grid_bench" --steps "$STEPS" --rounds "$ROUNDS" --json | tail -n 1 > "$out/bench.json"
mpirun -n 8 "$target_dir/gpt" --config examples/gpt/configs/3d.json --steps "$STEPS" --json \
    | tail -n 1 > "$out/mpi.json"
python3 scripts/benchmarks_md.py 3d "$out/bench.json" "$out/mpi.json" "$(nproc)"
