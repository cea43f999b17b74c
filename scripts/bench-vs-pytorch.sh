#!/usr/bin/env bash
# Regenerates the PyTorch/DeepSpeed comparison section of BENCHMARKS.md (not run in CI).
#
# Creates a Python virtual environment with PyTorch and DeepSpeed from PyPI (a few GB: the
# Linux wheels of PyTorch bring CUDA libraries even for a CPU run), then trains the same
# GPT on the same data and global batch (16 sequences) at 2 ranks: PyTorch DDP, DeepSpeed at
# ZeRO stages 0-3 (CPU, gloo), and our example (threads and mpirun -n 2) at the same stages.
# Each figure is the median tokens/s of the steps after the warm-up.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export DS_ACCELERATOR=cpu
STEPS_TINY="${STEPS_TINY:-40}"
STEPS_SMALL="${STEPS_SMALL:-12}"
WORLD="${WORLD:-2}"
target="${CARGO_TARGET_DIR:-target}"
venv="$(realpath -m "$target/pt-venv")"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, deepspeed" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet "torch==2.15.0" "deepspeed==0.19.8"
fi
# DeepSpeed JIT-builds its CPU ops with the venv's ninja.
export PATH="$venv/bin:$PATH"
# Ours with the CPU levers: the linear layers through OpenBLAS (`blas`), the flash-attention
# kernel (`--blockwise-attention`, `--flash`) and the host cache (`--host-cache`).
cargo build --release --features burn-deepspeed-example-gpt/mpi,burn-deepspeed-example-gpt/blas \
    --example gpt --example overhead_bench
gpt="$target/release/examples/gpt"
out=$(mktemp -d)
for model in tiny small; do
    steps=$STEPS_TINY
    [ "$model" = small ] && steps=$STEPS_SMALL
    # One process: PyTorch, a plain Burn loop and our engine, phase by phase (whose kernels
    # the time is in).
    "$venv/bin/python" scripts/bench_vs_pytorch.py --impl ddp --world 1 --model "$model" \
        --steps "$steps" | tail -n 1 > "$out/$model-torch1.json"
    "$target/release/examples/overhead_bench" --model "$model" --steps "$steps" --warm-up 5 \
        --rounds 1 --flash --host-cache --json | tail -n 1 > "$out/$model-burn1.json"
    # Each lever alone and all together, against the plain loop without them.
    "$target/release/examples/overhead_bench" --model "$model" --steps "$steps" --warm-up 5 \
        --rounds 1 --levers | tail -n 1 > "$out/$model-levers.json"
    "$venv/bin/python" scripts/bench_vs_pytorch.py --impl ddp --world "$WORLD" \
        --model "$model" --steps "$steps" | tail -n 1 > "$out/$model-ddp.json"
    for stage in 0 1 2 3; do
        "$venv/bin/python" scripts/bench_vs_pytorch.py --impl deepspeed --stage "$stage" \
            --world "$WORLD" --model "$model" --steps "$steps" | tail -n 1 > "$out/$model-ds$stage.json"
        config=$(mktemp)
        python3 - "$stage" > "$config" <<'PY'
import json, sys
c = json.load(open("examples/gpt/configs/default.json"))
c["zero_optimization"]["stage"] = int(sys.argv[1])
print(json.dumps(c))
PY
        "$gpt" --config "$config" --model "$model" --ranks "$WORLD" --steps "$steps" --json \
            --blockwise-attention --host-cache \
            | tail -n 1 > "$out/$model-ours$stage.json"
        mpirun -n "$WORLD" "$gpt" --config "$config" --model "$model" --steps "$steps" --json \
            --blockwise-attention --host-cache \
            | tail -n 1 > "$out/$model-mpi$stage.json"
        rm -f "$config"
    done
done
python3 scripts/benchmarks_md.py vs-pytorch "$out" "$(nproc)"
