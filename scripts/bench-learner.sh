#!/usr/bin/env bash
# Regenerates the Learner-strategy section of BENCHMARKS.md: DeepSpeedStrategy at ZeRO
# stages 0-3 beside Burn's own MultiDevice(OptimSharded), inside SupervisedTraining on GPT
# `small` at 2 and 4 ranks/devices. Each run is its own process (so that its peak RSS is its
# own); the configurations are interleaved round by round and the median is reported.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS="${STEPS:-8}"
ROUNDS="${ROUNDS:-2}"
WORLDS="${WORLDS:-2,4}"
cargo build --release --example learner_bench
bin="${CARGO_TARGET_DIR:-target}/release/examples/learner_bench"
out="${CARGO_TARGET_DIR:-target}/bench-learner"
rm -rf "$out"
mkdir -p "$out"
for round in $(seq 1 "$ROUNDS"); do
    for world in ${WORLDS//,/ }; do
        for run in "burn-sharded" "deepspeed 0" "deepspeed 1" "deepspeed 2" "deepspeed 3"; do
            set -- $run
            name="$1${2:+-stage$2}"
            "$bin" --strategy "$1" ${2:+--stage "$2"} --world "$world" --model small \
                --steps "$STEPS" --json | tail -n 1 > "$out/$name-w$world-r$round.json"
        done
    done
done
python3 scripts/benchmarks_md.py learner "$out" "$(nproc)"
