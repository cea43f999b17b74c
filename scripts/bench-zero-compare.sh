#!/usr/bin/env bash
# Compares this checkout with an earlier revision on Flex, in one session: builds the ZeRO
# benchmark and the GPT example at REV (a git worktree under the target directory) and here,
# then alternates them, ROUNDS times (the order of the two alternating each round), on GPT
# `small` at world 2, stages 0-3 (tokens/s, each binary's ratio to its own stage 0), and
# trains GPT `small` 3 steps at each stage with both to show whether the losses are
# bit-identical; writes the SECTION section of BENCHMARKS.md (`device-flex` by default, or
# `redesign-flex`). PROFILE=dev builds in the dev profile (opt-level 2, shared with the tests)
# instead of release.
#
#   bash scripts/bench-zero-compare.sh d33a202
#   ROUNDS=4 PROFILE=dev SECTION=redesign-flex bash scripts/bench-zero-compare.sh 96385b5
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:?usage: bench-zero-compare.sh REV}"
ROUNDS="${ROUNDS:-2}"
STEPS="${STEPS:-6}"
PROFILE="${PROFILE:-release}"
SECTION="${SECTION:-device-flex}"
case "$PROFILE" in
    release) profile_flag=(--release); profile_dir=release ;;
    dev) profile_flag=(); profile_dir=debug ;;
    *) echo "PROFILE is release or dev, not $PROFILE" >&2; exit 1 ;;
esac
target="${CARGO_TARGET_DIR:-$PWD/target}"
out="$target/bench-zero-compare"
tree="$target/compare-$rev"
mkdir -p "$out"
[ -d "$tree" ] || git worktree add --detach "$tree" "$rev" >/dev/null
build() {
    (cd "$1" && CARGO_TARGET_DIR="$target" cargo build "${profile_flag[@]}" -q \
        -p burn-deepspeed-example-gpt --example zero_bench --example gpt)
    mkdir -p "$out/$2"
    cp "$target/$profile_dir/examples/zero_bench" "$target/$profile_dir/examples/gpt" "$out/$2/"
}
build "$tree" before
build "$PWD" after
for round in $(seq 1 "$ROUNDS"); do
    order="before after"
    [ $((round % 2)) = 0 ] && order="after before"
    for side in $order; do
        "$out/$side/zero_bench" --model small --worlds 2 --stages 0,1,2,3 --steps "$STEPS" \
            --rounds 1 --json | tail -n 1 > "$out/$side-bench-$round.json"
    done
done
for stage in 0 1 2 3; do
    cfg=examples/gpt/configs/default.json
    [ "$stage" != 0 ] && cfg="examples/gpt/configs/zero$stage.json"
    for side in before after; do
        "$out/$side/gpt" --config "$cfg" --model small --ranks 2 --steps 3 --json \
            | tail -n 1 > "$out/$side-gpt-stage$stage.json"
    done
done
python3 scripts/benchmarks_md.py "$SECTION" "$out" "$ROUNDS" "$rev" "$(nproc)"
