#!/usr/bin/env bash
# Regenerates the resume section of BENCHMARKS.md: the peak RSS of a training run that saves a
# checkpoint, against the peak RSS of runs that resume from it (load only, and load then one
# more step), each its own process measured by `/usr/bin/time -v`. GPT `medium` at ZeRO stage 3
# on 4 thread ranks by default (MODEL, RANKS, STEPS and BATCH override them; PROFILE=dev runs
# the dev build, which is optimized at opt-level 2 for every crate the run uses). The ratio is
# what a resume needs beyond training: a load that read every rank's files whole shows here.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${MODEL:-medium}"
RANKS="${RANKS:-4}"
STEPS="${STEPS:-2}"
BATCH="${BATCH:-8}"
PROFILE="${PROFILE:-release}"
target="${CARGO_TARGET_DIR:-target}"
out="$target/bench-resume"
rm -rf "$out"
mkdir -p "$out"
if [ "$PROFILE" = release ]; then
    cargo build --release --example gpt
else
    cargo build --example gpt
fi
gpt="$target/$PROFILE/examples/gpt"
[ "$PROFILE" = dev ] && gpt="$target/debug/examples/gpt"
run() { # NAME ARGS...: one run, its JSON report and its peak RSS (KiB) in $out/NAME.*
    local name=$1
    shift
    /usr/bin/time -v "$gpt" --model "$MODEL" --ranks "$RANKS" --config examples/gpt/configs/zero3.json \
        --train-batch-size "$BATCH" --json "$@" > "$out/$name.out" 2> "$out/$name.time"
    tail -n 1 "$out/$name.out" > "$out/$name.json"
    awk -F': ' '/Maximum resident set size/ { printf "{\"max_rss_kib\": %d}\n", $2 }' \
        "$out/$name.time" > "$out/$name.rss.json"
    echo "$name: $(cat "$out/$name.rss.json")"
}
echo "{\"profile\": \"$PROFILE\"}" > "$out/profile.json"
run train --steps "$STEPS" --save-dir "$out/ckpt"
run resume --steps "$STEPS" --resume "$out/ckpt"
run resume_step --steps "$((STEPS + 1))" --resume "$out/ckpt"
python3 scripts/benchmarks_md.py resume "$out" "$(nproc)"
