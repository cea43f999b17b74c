#!/usr/bin/env bash
# Regenerates the flight-recorder section of BENCHMARKS.md: GPT `small` at ZeRO stage 3 (the
# stage with the most collectives per step) on 2 thread ranks, with the flight recorder off
# (BURN_DEEPSPEED_FLIGHT_ENTRIES=0) and on (its default ring of 2000 entries), alternating run
# by run, ROUNDS rounds of STEPS steps each; the section gives each one's median tokens/s.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${ROUNDS:-3}"
STEPS="${STEPS:-6}"
PROFILE="${PROFILE:-release}"
target="${CARGO_TARGET_DIR:-target}"
out="$target/bench-recorder"
rm -rf "$out"
mkdir -p "$out"
if [ "$PROFILE" = release ]; then
    cargo build --release --example gpt
    gpt="$target/release/examples/gpt"
else
    cargo build --example gpt
    gpt="$target/debug/examples/gpt"
fi
echo "{\"profile\": \"$PROFILE\", \"steps\": $STEPS, \"rounds\": $ROUNDS}" > "$out/setup.json"
for round in $(seq 1 "$ROUNDS"); do
    for entries in 0 2000; do
        BURN_DEEPSPEED_FLIGHT_ENTRIES=$entries "$gpt" --model small --ranks 2 --steps "$STEPS" \
            --config examples/gpt/configs/zero3.json --json | tail -n 1 \
            > "$out/entries${entries}_round$round.json"
        echo "round $round, $entries entries: $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["tokens_per_s"])' "$out/entries${entries}_round$round.json") tokens/s"
    done
done
python3 scripts/benchmarks_md.py recorder "$out" "$(nproc)"
