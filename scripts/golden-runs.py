#!/usr/bin/env python3
"""Bit-for-bit guard for refactors: trains the GPT example in a fixed list of runs (ZeRO
stages 0-3, fp16/bf16, offload to cpu and nvme, pipeline, 3D grid, tensor slicing, 1-bit
Adam/LAMB, MoE, progressive layer dropping, MoQ, threads and mpirun, Flex and wgpu) and
prints each run's losses and the digest of its final parameters, one line per run.

    python3 scripts/golden-runs.py > before.txt       # on the old code
    python3 scripts/golden-runs.py --check before.txt # on the new code: fails on any change

Losses are printed as serde_json writes them (shortest round-trip form of the f64), so equal
lines mean equal bits. `--only NAME[,NAME]` runs a subset; `--no-build` skips the build.
On wgpu the parameters' digest is printed but not compared: the device's sum reduction
(the gradient norm) does not fix its order on lavapipe, so the last bits of the parameters
move from run to run of the same build (the losses do not); the losses and skipped steps
are compared there.
Matrix kernels pick their SIMD path by CPU, so a reference holds on the machine kind that
recorded it: `scripts/golden-runs.txt` was recorded on the development machine (its first
lines say which commit and CPU).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = ",".join(
    f"{c}/wgpu"
    for c in [
        "burn-deepspeed-cubecl-kernels",
        "burn-deepspeed-strategies",
        "burn-deepspeed",
        "burn-deepspeed-example-gpt",
        "burn-deepspeed-tests",
    ]
)
# The test suite's features but `blas`: the references hold for Flex's own products (OpenBLAS
# rounds the linear layers differently), which is also what a build without the feature runs.
FEATURES = (
    "burn-deepspeed-strategies/mpi,burn-deepspeed/mpi,burn-deepspeed-example-gpt/mpi,"
    "burn-deepspeed-tests/mpi," + KERNELS
)
STEPS = 4

FP16 = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2}}
BF16 = {"bf16": {"enabled": True}}


def zero(stage, **extra):
    return {"zero_optimization": {"stage": stage, "reduce_bucket_size": 5e5, **extra}}


def merge(*parts):
    out = {}
    for p in parts:
        for k, v in p.items():
            if isinstance(v, dict) and isinstance(out.get(k), dict):
                out[k] = merge(out[k], v)
            else:
                out[k] = v
    return out


# (name, ranks, launcher, device, base config, overrides, extra arguments)
RUNS = [
    ("stage0-1rank", 1, "threads", "flex", "default", {}, []),
    ("stage0", 2, "threads", "flex", "default", {}, []),
    ("stage1", 2, "threads", "flex", "zero1", {}, []),
    ("stage2", 2, "threads", "flex", "zero2", {}, []),
    ("stage3", 2, "threads", "flex", "zero3", {}, []),
    ("stage3-4ranks", 4, "threads", "flex", "zero3", {}, []),
    ("stage2-overlap", 2, "threads", "flex", "zero2", zero(2, overlap_comm=True), []),
    ("stage3-overlap", 2, "threads", "flex", "zero3", zero(3, overlap_comm=True,
                                                           stage3_param_persistence_threshold=0),
     []),
    ("stage0-fp16", 2, "threads", "flex", "default", FP16, []),
    ("stage2-fp16", 2, "threads", "flex", "fp16", {}, []),
    ("stage3-fp16", 2, "threads", "flex", "zero3", FP16, []),
    ("stage1-bf16", 2, "threads", "flex", "zero1", BF16, []),
    ("stage2-bf16", 2, "threads", "flex", "bf16", {}, []),
    ("stage3-bf16", 2, "threads", "flex", "zero3", BF16, []),
    ("stage2-offload-cpu", 2, "threads", "flex", "zero2",
     zero(2, offload_optimizer={"device": "cpu"}), []),
    ("stage3-offload-cpu", 2, "threads", "flex", "zero3",
     zero(3, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"},
          stage3_param_persistence_threshold=0), []),
    ("stage2-offload-nvme", 2, "threads", "flex", "zero2",
     zero(2, offload_optimizer={"device": "nvme", "nvme_path": "@SWAP@"}), []),
    ("stage3-offload-nvme", 2, "threads", "flex", "zero3",
     zero(3, offload_optimizer={"device": "nvme", "nvme_path": "@SWAP@"},
          offload_param={"device": "nvme", "nvme_path": "@SWAP@"},
          stage3_param_persistence_threshold=0), []),
    ("activation-checkpointing", 2, "threads", "flex", "activation_checkpointing", {}, []),
    ("pipeline-2stages", 2, "threads", "flex", "pipeline", {}, []),
    ("pipeline-2x2", 4, "threads", "flex", "pipeline", {}, []),
    ("pipeline-fp16", 2, "threads", "flex", "pipeline", FP16, []),
    ("tensor-parallel", 2, "threads", "flex", "tensor_parallel", {}, []),
    ("3d-grid", 8, "threads", "flex", "3d", {}, []),
    ("onebit-adam", 2, "threads", "flex", "onebit_adam",
     {"optimizer": {"params": {"freeze_step": 2}}}, []),
    ("onebit-lamb", 2, "threads", "flex", "onebit_lamb",
     {"optimizer": {"params": {"freeze_step": 2}}}, []),
    ("lamb", 2, "threads", "flex", "lamb", {}, []),
    ("moe-ep2", 2, "threads", "flex", "default", {}, ["--model", "tiny-moe", "--ep-size", "2"]),
    ("moe-stage2", 2, "threads", "flex", "zero2", {}, ["--model", "tiny-moe"]),
    ("pld", 2, "threads", "flex", "pld", {}, []),
    ("moq", 2, "threads", "flex", "moq", {}, []),
    ("mpi-stage0", 2, "mpi", "flex", "default", {}, []),
    ("mpi-stage2", 2, "mpi", "flex", "zero2", {}, []),
    ("mpi-stage3", 2, "mpi", "flex", "zero3", {}, []),
    ("mpi-pipeline", 2, "mpi", "flex", "pipeline", {}, []),
    ("wgpu-stage0", 2, "threads", "wgpu", "default", {}, []),
    ("wgpu-stage1", 2, "threads", "wgpu", "zero1", {}, []),
    ("wgpu-stage2-fp16", 2, "threads", "wgpu", "fp16", {}, []),
    ("wgpu-stage3", 2, "threads", "wgpu", "zero3", {}, []),
    ("wgpu-onebit-adam", 2, "threads", "wgpu", "onebit_adam",
     {"optimizer": {"params": {"freeze_step": 2}}}, []),
]


def target_dir():
    return os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))


def run_one(run, tmp):
    name, ranks, launcher, device, base, overrides, extra = run
    with open(os.path.join(ROOT, "examples/gpt/configs", base + ".json")) as f:
        config = merge(json.load(f), overrides)
    swap = tempfile.mkdtemp(prefix=name + "-", dir=tmp)
    text = json.dumps(config).replace("@SWAP@", swap)
    path = os.path.join(tmp, name + ".json")
    with open(path, "w") as f:
        f.write(text)
    gpt = os.path.join(target_dir(), "debug", "examples", "gpt")
    args = [gpt, "--config", path, "--device", device, "--steps", str(STEPS), "--json",
            "--params-digest", *extra]
    if launcher == "mpi":
        cmd = ["mpirun", "-n", str(ranks), *args]
    else:
        cmd = [*args, "--ranks", str(ranks)]
    started = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{name}: exit {out.returncode}\n{out.stderr[-3000:]}")
    # The JSON line is the last that parses (mpirun may interleave other lines).
    report = None
    for line in out.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            report = json.loads(line)
    if report is None:
        raise RuntimeError(f"{name}: no JSON summary on stdout\n{out.stderr[-3000:]}")
    losses = " ".join(repr(x) for x in report["losses"])
    line = f"{name} params={report['params_digest']} skipped={report['skipped_steps']} losses={losses}"
    return line, time.time() - started


def comparable(line, run):
    """The part of a run's line that must not change (see the module's documentation)."""
    if run[3] == "wgpu":
        return " ".join(w for w in line.split(" ") if not w.startswith("params="))
    return line


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", help="compare with the lines of this file; exit 1 on a change")
    ap.add_argument("--only", help="comma-separated run names")
    ap.add_argument("--no-build", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    os.environ.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.mkdtemp())
    if not args.no_build:
        subprocess.run(["cargo", "build", "--workspace", "--examples", "--features", FEATURES],
                       cwd=ROOT, check=True)
    runs = RUNS
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {r[0] for r in RUNS}
        if unknown:
            sys.exit(f"unknown run(s): {', '.join(sorted(unknown))}")
        runs = [r for r in RUNS if r[0] in wanted]
    expected = {}
    if args.check:
        with open(args.check) as f:
            for line in f:
                if line.strip() and not line.startswith("#"):
                    expected[line.split(" ", 1)[0]] = line.rstrip("\n")
    changed = []
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        for run in runs:
            line, seconds = run_one(run, tmp)
            print(line, flush=True)
            mark = ""
            if args.check:
                want = expected.get(run[0])
                if want is None:
                    mark = " (not in the reference)"
                    changed.append(run[0])
                elif comparable(want, run) != comparable(line, run):
                    mark = f" CHANGED, was:\n  {want}"
                    changed.append(run[0])
            print(f"  {run[0]}: {seconds:.1f} s{mark}", file=sys.stderr, flush=True)
    if args.check:
        if changed:
            sys.exit(f"{len(changed)} of {len(runs)} runs changed: {', '.join(changed)}")
        print(f"all {len(runs)} runs bit-identical to {args.check}", file=sys.stderr)


if __name__ == "__main__":
    main()
