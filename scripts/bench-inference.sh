#!/usr/bin/env bash
# Regenerates the inference section of BENCHMARKS.md: GPT `small` (seed-initialized: speed
# does not depend on training) generating 255 tokens after 4 one-byte prompts from the
# key/value caches, against full recomputation in the same process, at tp 1, 2 and 4
# (threads) and tp 2 under mpirun -n 2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
NEW="${NEW:-255}"
cargo build --release --features burn-deepspeed-example-gpt/mpi --example generate
bin="${CARGO_TARGET_DIR:-target}/release/examples/generate"
out=$(mktemp -d)
args=(--model small --prompt T --prompt I --prompt A --prompt W --max-new-tokens "$NEW"
    --compare-recompute --json)
for tp in 1 2 4; do
    "$bin" --tp "$tp" "${args[@]}" | tail -n 1 > "$out/threads-$tp.json"
done
mpirun -n 2 "$bin" "${args[@]}" | tail -n 1 > "$out/mpi-2.json"
python3 scripts/benchmarks_md.py inference "$out" "$NEW" "$(nproc)"
