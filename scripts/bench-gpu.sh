#!/usr/bin/env bash
# The GPU checks and the GPU section of BENCHMARKS.md (issue 17): the CUDA kernels' tests,
# the NCCL conformance, GPT `tiny` on CUDA against Flex at ZeRO stages 0-3, with 1-bit
# Adam/LAMB and in the pipeline, the engine against a plain Burn loop on the GPU, GPT `small`
# tokens/s at stages 0-3, and the fused AdamW against a device copy. Needs an NVIDIA GPU, its
# driver and libnccl (on the library path, or in a Python environment's `nvidia/nccl`, as
# PyTorch installs it).
#
#   bash scripts/bench-gpu.sh                     # build (feature cuda), run, write BENCHMARKS.md
#   bash scripts/bench-gpu.sh build DIR           # build only; the binaries go to DIR
#   BIN=DIR OUT=RES bash scripts/bench-gpu.sh run # run prebuilt binaries (a GPU machine that
#                                                 # cannot build), results in RES
#   OUT=RES bash scripts/bench-gpu.sh report      # write the section from RES
#   BIN=DIR OUT=RES bash scripts/bench-gpu.sh flex  # only the Flex references (no GPU needed)
#   BIN=DIR OUT=RES bash scripts/bench-gpu.sh tests|small|onebit  # one part of `run`
#                                                 # (onebit: DEVICE=flex for its references)
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-all}"

build() {
    local dest=$1
    export XDG_DATA_HOME="${XDG_DATA_HOME:-$PWD/target/xdg}"
    bash scripts/offline-llvm.sh
    local features="burn-deepspeed-cubecl-kernels/cuda,burn-deepspeed-strategies/cuda,burn-deepspeed-example-gpt/cuda"
    mkdir -p "$dest"
    cargo build --release -p burn-deepspeed-cubecl-kernels -p burn-deepspeed-strategies \
        -p burn-deepspeed-example-gpt --lib --tests --examples --benches --features "$features" \
        --message-format=json-render-diagnostics \
        | python3 -c 'import json, shutil, sys
want = {("burn_deepspeed_cubecl_kernels", "lib"): "kernels-tests",
        ("burn_deepspeed_strategies", "lib"): "strategies-tests",
        ("gpt", "example"): "gpt", ("overhead_bench", "example"): "overhead_bench",
        ("kernel-bench", "bench"): "kernel-bench"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    name = want.get((m["target"]["name"].replace("-", "_") if m["target"]["kind"] == ["lib"]
                     else m["target"]["name"], m["target"]["kind"][0]))
    if name:
        shutil.copy(m["executable"], sys.argv[1] + "/" + name)
        print("built", name)' "$dest" || exit 1
    strip "$dest"/* 2> /dev/null || true
}

# libnccl from the system, or from a Python environment's nvidia-nccl wheel.
find_nccl() {
    ldconfig -p | grep -q 'libnccl\.so' && return
    local dirs=(/opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/lib)
    dirs+=("$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0] + "/lib")' 2> /dev/null)")
    for d in "${dirs[@]}"; do
        if [ -e "$d/libnccl.so.2" ]; then
            mkdir -p /tmp/nccl-lib
            ln -sf "$d/libnccl.so.2" /tmp/nccl-lib/libnccl.so
            export LD_LIBRARY_PATH="/tmp/nccl-lib:$d:${LD_LIBRARY_PATH:-}"
            echo "libnccl: $d"
            return
        fi
    done
    echo "libnccl: not found (the NCCL checks will fail)"
}

# GPT `tiny`, 20 steps, the device test's config at `stage`.
tiny_config() {
    cat > "$OUT/zero$1.json" <<JSON
{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
 "zero_optimization": {"stage": $1, "stage3_param_persistence_threshold": 0}}
JSON
}

step() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
    local rc=$?
    echo "$name: exit $rc after $((SECONDS - start)) s"
    tail -n 3 "$OUT/$name.err" | sed 's/^/    /'
    return 0
}

run() {
    : "${BIN:?BIN names the folder of the built binaries}" "${OUT:?OUT names the results folder}"
    mkdir -p "$OUT"
    find_nccl
    nproc > "$OUT/cores.txt"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
        | tee "$OUT/gpu.txt"
    gpu_tests
    tiny_on cuda
    step overhead-small 240 "$BIN/overhead_bench" --device cuda --model small --steps 40 \
        --warm-up 10 --rounds 2 --json
    small_on_cuda
    step kernel-bench 120 "$BIN/kernel-bench" --device cuda --json
    for stage in 0 1 2 3; do
        step "medium-cuda-s$stage" 120 "$BIN/gpt" --device cuda --ranks 1 --model medium \
            --steps 30 --config "$OUT/small$stage.json" --json
    done
    offload_on_cuda
    # The device's own copy bandwidth as PyTorch measures it (a second baseline beside our
    # copy kernel, when PyTorch is installed).
    timeout 60 python3 - > "$OUT/torch-copy.json" 2> "$OUT/torch-copy.err" <<'PY'
import json, torch
x = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
y = torch.empty_like(x)
times = []
for i in range(23):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); y.copy_(x); b.record(); torch.cuda.synchronize()
    if i >= 3:
        times.append(a.elapsed_time(b) / 1e3)
times.sort()
s = times[len(times) // 2]
print(json.dumps({"bytes": 8 * x.numel(), "seconds": s, "gbps": 8 * x.numel() / s / 1e9,
                  "torch": torch.__version__}))
PY
    echo "torch copy: $(cat "$OUT/torch-copy.json")"
    # The Flex references of the tiny runs: the same binary on the CPU (FLEX=0 leaves them to
    # another machine, as they need no GPU).
    [ "${FLEX:-1}" = 1 ] && tiny_on flex
}

# The CubeCL kernels' tests on CUDA and the device collectives' tests with the GPU ones.
gpu_tests() {
    step kernels-tests 150 "$BIN/kernels-tests" --test-threads 4
    grep "test result" "$OUT/kernels-tests.out"
    step strategies-tests 150 "$BIN/strategies-tests" device --include-ignored
    grep "test result\|FAILED\|panicked" "$OUT/strategies-tests.out" "$OUT/strategies-tests.err" | head
}

# GPT `small`, one rank (NCCL), the example's default config at stages 0-3, 40 steps.
small_on_cuda() {
    for stage in 0 1 2 3; do
        sed "s/\"stage\": 0/\"stage\": $stage/" examples/gpt/configs/default.json > "$OUT/small$stage.json"
        step "small-cuda-s$stage" 120 "$BIN/gpt" --device cuda --ranks 1 --model small \
            --steps 40 --config "$OUT/small$stage.json" --json
    done
}

# GPT `tiny` on `device`, 20 steps: 2 ranks at stages 0-3 and 1 rank at stages 0 and 3 (the
# device test's config), then the 16-bit runs.
tiny_on() {
    for stage in 0 1 2 3; do
        tiny_config "$stage"
        step "tiny-$1-s$stage" 120 "$BIN/gpt" --device "$1" --ranks 2 --steps 20 \
            --config "$OUT/zero$stage.json" --json
    done
    for stage in 0 3; do
        step "tiny-$1-r1-s$stage" 120 "$BIN/gpt" --device "$1" --ranks 1 --steps 20 \
            --config "$OUT/zero$stage.json" --json
    done
    mixed_on "$1"
    onebit_on "$1"
}

# 1-bit Adam and 1-bit LAMB (the example's configs, compressing from step 8) on `device`,
# GPT `tiny`, 20 steps, at 2 ranks (sharing one GPU: host-staged) and 1 rank (NCCL), and the
# pipeline (2 stages, 2 ranks).
onebit_on() {
    for opt in adam lamb; do
        sed 's/"freeze_step": [0-9]*/"freeze_step": 8/' "examples/gpt/configs/onebit_$opt.json" \
            > "$OUT/onebit-$opt.json"
        for ranks in 2 1; do
            step "tiny-$1-onebit-$opt-r$ranks" 120 "$BIN/gpt" --device "$1" --ranks "$ranks" \
                --steps 20 --config "$OUT/onebit-$opt.json" --json
        done
    done
    step "tiny-$1-pipeline" 120 "$BIN/gpt" --device "$1" --ranks 2 --steps 20 \
        --config examples/gpt/configs/pipeline.json --json
}

# ZeRO-Offload on the GPU: GPT `small`, one rank, the optimizer on the CPU at stage 2 and the
# parameters too at stage 3, each beside a device-resident run of the same stage.
offload_on_cuda() {
    python3 - examples/gpt/configs/default.json "$OUT" <<'PY'
import json, sys
for stage, params in [(2, False), (3, True)]:
    c = json.load(open(sys.argv[1]))
    c["zero_optimization"]["stage"] = stage
    c["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if params:
        c["zero_optimization"]["offload_param"] = {"device": "cpu"}
    json.dump(c, open(f"{sys.argv[2]}/small{stage}-offload.json", "w"))
PY
    for stage in 2 3; do
        step "small-cuda-s$stage-offload" 120 "$BIN/gpt" --device cuda --ranks 1 --model small \
            --steps 40 --config "$OUT/small$stage-offload.json" --json
        # The device-resident baseline of the same stage, in the same session.
        sed "s/\"stage\": 0/\"stage\": $stage/" examples/gpt/configs/default.json > "$OUT/small$stage.json"
        step "small-cuda-s$stage-resident" 120 "$BIN/gpt" --device cuda --ranks 1 --model small \
            --steps 40 --config "$OUT/small$stage.json" --json
    done
}

# 16-bit training on `device`: the example's fp16 and bf16 configs (stage 2, fp32 masters) on
# `tiny`, 2 ranks; fp16 also from a loss scale of 2^8, below the overflows that 2^16 meets
# first (whether a step overflows at the edge depends on the device's rounding).
mixed_on() {
    sed 's/"initial_scale_power": 16/"initial_scale_power": 8/' examples/gpt/configs/fp16.json \
        > "$OUT/fp16-scale8.json"
    for dtype in fp16 fp16-scale8 bf16; do
        local config="examples/gpt/configs/$dtype.json"
        [ -e "$config" ] || config="$OUT/$dtype.json"
        step "tiny-$1-$dtype" 120 "$BIN/gpt" --device "$1" --ranks 2 --steps 20 \
            --config "$config" --json
    done
}

case "$mode" in
build) build "${2:?build DIR}" ;;
run) run ;;
offload)
    mkdir -p "${OUT:?}"
    find_nccl
    offload_on_cuda
    ;;
mixed)
    mkdir -p "${OUT:?}"
    find_nccl
    mixed_on "${DEVICE:-cuda}"
    ;;
onebit | tests | small)
    # One part of `run` (1-bit and pipeline runs, the GPU tests, GPT `small` at stages 0-3).
    mkdir -p "${OUT:?}"
    find_nccl
    case "$mode" in
    onebit) onebit_on "${DEVICE:-cuda}" ;;
    tests) gpu_tests ;;
    small) small_on_cuda ;;
    esac
    ;;
flex)
    mkdir -p "${OUT:?}"
    echo "$(nproc) CPU cores, $BIN/gpt" > "$OUT/flex-host.txt"
    tiny_on flex
    ;;
report) python3 scripts/benchmarks_md.py gpu "${OUT:?}" ;;
all)
    BIN="${BIN:-target/gpu-bin}"
    OUT="${OUT:-target/bench-gpu}"
    build "$BIN"
    run
    python3 scripts/benchmarks_md.py gpu "$OUT"
    ;;
*)
    echo "usage: bench-gpu.sh [build DIR | run | report]" >&2
    exit 2
    ;;
esac
