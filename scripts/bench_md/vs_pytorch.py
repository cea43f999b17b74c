"""The `vs-pytorch` section of BENCHMARKS.md."""
import json
from pathlib import Path

from .common import steady_tokens


def vs_pytorch(directory, cores):
    d = Path(directory)
    seq = {"tiny": 128, "small": 256}
    lines = [
        "## Against PyTorch DDP and DeepSpeed on CPU",
        "",
        f"`bash scripts/bench-vs-pytorch.sh` on a machine with {cores} CPU cores (not run in "
        "CI). The same GPT (`scripts/bench_vs_pytorch.py` mirrors the example layer by layer), "
        "data (the same windows of the embedded corpus at each step), global batch (16 "
        "sequences), AdamW, WarmupLR and clipping, at 2 data-parallel ranks: PyTorch under DDP "
        "and DeepSpeed (0.19.8 as the script pins it; CPU accelerator, gloo, `torch_adam`), one thread per rank; ours on "
        "Flex, fp32, as threads and under `mpirun -n 2`. Tokens/s are the median over the "
        "steps after the first 5 (ours: from each step's measured time). PyTorch is "
        f"{json.load(open(d / 'tiny-ddp.json'))['torch']} from PyPI, running its CPU path.",
        "",
        "| model | stage | ours, threads | ours, mpirun | peer | peer tokens/s | ours / peer (best of ours) |",
        "|---|---|---|---|---|---|---|",
    ]

    def ours(path, model):
        r = json.load(open(path))
        return steady_tokens(r, seq[model]), r.get("peak_rss_bytes", 0)

    for model in ["tiny", "small"]:
        if not (d / f"{model}-ddp.json").exists():
            continue
        ddp = json.load(open(d / f"{model}-ddp.json"))
        for stage in range(4):
            t, _ = ours(d / f"{model}-ours{stage}.json", model)
            m, _ = ours(d / f"{model}-mpi{stage}.json", model)
            ds = json.load(open(d / f"{model}-ds{stage}.json"))
            peers = [("DeepSpeed " + ds["deepspeed"] if "deepspeed" in ds else "DeepSpeed", ds)]
            if stage == 0:
                peers.insert(0, ("PyTorch DDP", ddp))
            for name, peer in peers:
                lines.append(
                    f"| `{model}` | {stage} | {t:.0f} | {m:.0f} | {name} "
                    f"| {peer['tokens_per_s']:.0f} | {max(t, m) / peer['tokens_per_s']:.2f} |"
                )
    lines += [
        "",
        "### One process: where the time goes",
        "",
        "The same model and batch of 16 sequences in one process with the machine's cores: "
        "PyTorch (median ms per step after the warm-up), a plain Burn loop and our engine at "
        "stage 0 (mean ms per step, `overhead_bench`). Forward includes reading the loss "
        "back; the step is clipping (PyTorch) and the optimizer.",
        "",
        "| model | loop | forward (ms) | backward (ms) | step (ms) | forward + backward vs PyTorch |",
        "|---|---|---|---|---|---|",
    ]
    for model in ["tiny", "small"]:
        if not (d / f"{model}-torch1.json").exists():
            continue
        torch1 = json.load(open(d / f"{model}-torch1.json"))
        burn1 = json.load(open(d / f"{model}-burn1.json"))
        pt = torch1["phase_ms"]
        base = pt["forward"] + pt["backward"]
        lines.append(
            f"| `{model}` | PyTorch {torch1['torch']}, {torch1['threads_per_rank']} threads "
            f"| {pt['forward']:.1f} | {pt['backward']:.1f} | {pt['step']:.1f} | 1.00 |"
        )
        for loop, name in [("plain", "plain Burn"), ("engine", "engine, stage 0")]:
            ms = burn1[f"{loop}_ms_per_step"]
            lines.append(
                f"| `{model}` | {name} | {ms['forward']:.1f} | {ms['backward']:.1f} "
                f"| {ms['optimizer']:.1f} | {(ms['forward'] + ms['backward']) / base:.2f} |"
            )
    return "\n".join(lines) + "\n"

