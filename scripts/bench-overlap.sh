#!/usr/bin/env bash
# Regenerates the overlap_comm section of BENCHMARKS.md: ZeRO stage 2 on GPT `small` with 4
# accumulation steps, each micro-batch's buckets reduced on the rank thread (off) or on a
# communication thread during the next micro-batch (on). Thread ranks in one process
# (overlap_bench, alternating), then `mpirun -n 2`, alternating off and on within each round,
# with OpenMPI's default busy polling and with `mpi_yield_when_idle`. Then ZeRO stage 3: the
# forward's next prefetch bundle all-gathered on the rank thread when needed (off) or on the
# communication thread while the current layer computes (on, DeepSpeed's default).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
STEPS="${STEPS:-6}"
ROUNDS="${ROUNDS:-4}"
cargo build --release --features burn-deepspeed-example-gpt/mpi --example overlap_bench \
    --example gpt
bin="${CARGO_TARGET_DIR:-target}/release/examples"
out="${CARGO_TARGET_DIR:-target}/bench-overlap"
rm -rf "$out" && mkdir -p "$out"
"$bin/overlap_bench" --model small --ranks 2 --accumulation 4 --steps "$STEPS" \
    --rounds "$ROUNDS" --json | tail -n 1 > "$out/threads.json"
python3 - examples/gpt/configs/zero2.json "$out" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["gradient_accumulation_steps"] = 4
config["wall_clock_breakdown"] = True
for overlap in (False, True):
    config["zero_optimization"]["overlap_comm"] = overlap
    json.dump(config, open(f"{sys.argv[2]}/config-{str(overlap).lower()}.json", "w"))
PY
for round in $(seq 1 "$ROUNDS"); do
    for yield in 0 1; do
        for ov in false true; do
            OMPI_MCA_mpi_yield_when_idle=$yield mpirun -n 2 -x OMPI_MCA_mpi_yield_when_idle \
                "$bin/gpt" --config "$out/config-$ov.json" --model small --steps "$STEPS" \
                --json 2> /dev/null | tail -n 1 > "$out/mpi-yield$yield-$ov-$round.json"
        done
    done
done
python3 scripts/benchmarks_md.py overlap "$out" "$(nproc)"

# Stage 3: one micro-batch per step, threads (overlap_bench) and mpirun -n 2 (zero3.json).
"$bin/overlap_bench" --model small --ranks 2 --stage 3 --accumulation 1 --steps "$STEPS" \
    --rounds "$ROUNDS" --json | tail -n 1 > "$out/threads3.json"
python3 - examples/gpt/configs/zero3.json "$out" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
for overlap in (False, True):
    config["zero_optimization"]["overlap_comm"] = overlap
    json.dump(config, open(f"{sys.argv[2]}/config3-{str(overlap).lower()}.json", "w"))
PY
for round in $(seq 1 "$ROUNDS"); do
    for yield in 0 1; do
        prefix=$([ "$yield" = 1 ] && echo mpi3y || echo mpi3)
        for ov in false true; do
            OMPI_MCA_mpi_yield_when_idle=$yield mpirun -n 2 -x OMPI_MCA_mpi_yield_when_idle \
                "$bin/gpt" --config "$out/config3-$ov.json" --model small --steps "$STEPS" \
                --json 2> /dev/null | tail -n 1 > "$out/$prefix-$ov-$round.json"
        done
    done
done
python3 scripts/benchmarks_md.py overlap3 "$out" "$(nproc)"
