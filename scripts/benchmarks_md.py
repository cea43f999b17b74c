"""Writes one section of BENCHMARKS.md from benchmark JSON, keeping the other sections.

Sections are delimited by `<!-- section: NAME -->` ... `<!-- end: NAME -->`. Each section's
prose is a template in `bench_md/templates/` (Python format syntax); its module in `bench_md/`
reads the benchmark's JSON and computes the figures and table rows that fill it.
`python3 scripts/bench_md/selfcheck.py` renders every section from symbolic output.

Usage: benchmarks_md.py pipeline BENCH_JSON GRID_MPI_JSON GRID_THREADS_JSON CORES
       benchmarks_md.py onebit DIR FREEZE_STEP CORES
       benchmarks_md.py zero DIR CORES
       benchmarks_md.py learner DIR CORES
       benchmarks_md.py kernels KERNELS_JSON CORES
       benchmarks_md.py precision DIR CORES
       benchmarks_md.py offload DIR CORES
       benchmarks_md.py resume DIR CORES
       benchmarks_md.py recorder DIR CORES
       benchmarks_md.py slow-links DIR CORES
       benchmarks_md.py long-context DIR CORES
       benchmarks_md.py 3d BENCH_JSON MPI_JSON CORES
       benchmarks_md.py inference DIR NEW_TOKENS CORES
       benchmarks_md.py quantization DIR STEPS_SMALL STEPS_TINY CORES
       benchmarks_md.py moe DIR STEPS CORES
       benchmarks_md.py overhead DIR CORES
       benchmarks_md.py vs-pytorch DIR CORES
       benchmarks_md.py device-flex|redesign-flex OUT ROUNDS REV CORES
"""
import sys

from bench_md.common import write_section
from bench_md.pipeline import pipeline
from bench_md.onebit import onebit, onebit_plot
from bench_md.zero import zero, zero_plot
from bench_md.learner import learner
from bench_md.kernels import kernels
from bench_md.precision import precision, precision_plot
from bench_md.offload import offload
from bench_md.resume import resume
from bench_md.recorder import recorder
from bench_md.slow_links import slow_links
from bench_md.long_context import long_context
from bench_md.moonshot import moonshot, moonshot_plot
from bench_md.device_flex import device_flex
from bench_md.grid3d import grid3d
from bench_md.inference import inference
from bench_md.quantization import quantization
from bench_md.moe import moe
from bench_md.overhead import overhead
from bench_md.overlap import overlap, overlap3
from bench_md.vs_pytorch import vs_pytorch, vs_pytorch_plot
from bench_md.gpu import gpu

if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "pipeline":
        write_section("pipeline", pipeline(*sys.argv[2:6]))
    elif kind == "onebit":
        write_section("onebit", onebit(*sys.argv[2:5]))
        onebit_plot(*sys.argv[2:4])
    elif kind == "zero":
        write_section("zero", zero(*sys.argv[2:4]))
        zero_plot(sys.argv[2])
    elif kind == "kernels":
        write_section("kernels", kernels(*sys.argv[2:4]))
    elif kind == "learner":
        write_section("learner", learner(*sys.argv[2:4]))
    elif kind == "precision":
        write_section("precision", precision(*sys.argv[2:4]))
        precision_plot(sys.argv[2])
    elif kind == "offload":
        write_section("offload", offload(*sys.argv[2:4]))
    elif kind == "recorder":
        write_section("recorder", recorder(*sys.argv[2:4]))
    elif kind == "slow-links":
        write_section("slow-links", slow_links(*sys.argv[2:4]))
    elif kind == "long-context":
        write_section("long-context", long_context(*sys.argv[2:4]))
    elif kind == "resume":
        write_section("resume", resume(*sys.argv[2:4]))
    elif kind == "moonshot":
        write_section("moonshot", moonshot(*sys.argv[2:5]))
        moonshot_plot(sys.argv[2])
    elif kind in ("device-flex", "redesign-flex"):
        write_section(kind, device_flex(*sys.argv[2:6], section=kind))
    elif kind == "3d":
        write_section("3d", grid3d(*sys.argv[2:5]))
    elif kind == "inference":
        write_section("inference", inference(*sys.argv[2:5]))
    elif kind == "quantization":
        write_section("quantization", quantization(*sys.argv[2:6]))
    elif kind == "moe":
        write_section("moe", moe(*sys.argv[2:5]))
    elif kind == "overhead":
        write_section("overhead", overhead(*sys.argv[2:4]))
    elif kind == "vs-pytorch":
        write_section("vs-pytorch", vs_pytorch(*sys.argv[2:4]))
        vs_pytorch_plot(sys.argv[2])
    elif kind == "overlap":
        write_section("overlap", overlap(*sys.argv[2:4]))
    elif kind == "overlap3":
        write_section("overlap3", overlap3(*sys.argv[2:4]))
    elif kind == "gpu":
        write_section("gpu", gpu(*sys.argv[2:3]))
    else:
        sys.exit(f"unknown section {kind}")
