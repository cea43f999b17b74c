#!/usr/bin/env bash
# Regenerates the ZeRO section of BENCHMARKS.md: stages 0-3 interleaved at world 2 and 4 on
# GPT `small` (tokens/s over stage 0's from the same process, bytes per step against theory,
# model state per rank), the same stages under mpirun -n 2 (peak RSS per process), and
# stages 0 and 3 under mpirun -n 2 on GPT `medium` (50.7M parameters).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
STEPS="${STEPS:-6}"
ROUNDS="${ROUNDS:-2}"
STAGES="${STAGES:-0,1,2,3}"
cargo build --release --features burn-deepspeed-example-gpt/mpi --example zero_bench --example gpt
bin="${CARGO_TARGET_DIR:-target}/release/examples"
out="${CARGO_TARGET_DIR:-target}/bench-zero"
mkdir -p "$out"
"$bin/zero_bench" --model small --worlds 2,4 --stages "$STAGES" --steps "$STEPS" \
    --rounds "$ROUNDS" --json | tail -n 1 > "$out/bench.json"
for stage in ${STAGES//,/ }; do
    cfg=examples/gpt/configs/default.json
    [ "$stage" != 0 ] && cfg="examples/gpt/configs/zero$stage.json"
    mpirun -n 2 "$bin/gpt" --config "$cfg" --model small --steps 3 --json \
        | tail -n 1 > "$out/mpi-stage$stage.json"
done
for stage in 0 3; do
    cfg=examples/gpt/configs/default.json
    [ "$stage" != 0 ] && cfg="examples/gpt/configs/zero$stage.json"
    mpirun -n 2 "$bin/gpt" --config "$cfg" --model medium --train-batch-size 2 --steps 2 \
        --json | tail -n 1 > "$out/mpi-medium-stage$stage.json"
done
python3 scripts/benchmarks_md.py zero "$out" "$(nproc)"
