"""The `vs-pytorch` section of BENCHMARKS.md (prose: templates/vs-pytorch.md)."""
import json
from pathlib import Path

from .common import PATH, render, steady_tokens
from .svg import grouped_bars

PLOT = PATH.parent / "docs" / "plots" / "vs-deepspeed.svg"


def vs_pytorch(directory, cores):
    d = Path(directory)
    seq = {"tiny": 128, "small": 256}
    torch = json.load(open(d / "tiny-ddp.json"))["torch"]
    rows = []

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
                rows.append(
                    f"| `{model}` | {stage} | {t:.0f} | {m:.0f} | {name} "
                    f"| {peer['tokens_per_s']:.0f} | {max(t, m) / peer['tokens_per_s']:.2f} |"
                )
    phase_rows = []
    for model in ["tiny", "small"]:
        if not (d / f"{model}-torch1.json").exists():
            continue
        torch1 = json.load(open(d / f"{model}-torch1.json"))
        burn1 = json.load(open(d / f"{model}-burn1.json"))
        pt = torch1["phase_ms"]
        base = pt["forward"] + pt["backward"]
        phase_rows.append(
            f"| `{model}` | PyTorch {torch1['torch']}, {torch1['threads_per_rank']} threads "
            f"| {pt['forward']:.1f} | {pt['backward']:.1f} | {pt['step']:.1f} | 1.00 |"
        )
        for loop, name in [("plain", "plain Burn"), ("engine", "engine, stage 0")]:
            ms = burn1[f"{loop}_ms_per_step"]
            phase_rows.append(
                f"| `{model}` | {name} | {ms['forward']:.1f} | {ms['backward']:.1f} "
                f"| {ms['optimizer']:.1f} | {(ms['forward'] + ms['backward']) / base:.2f} |"
            )
    lever_rows = []
    for model in ["tiny", "small"]:
        path = d / f"{model}-levers.json"
        if not path.exists():
            continue
        for r in json.load(open(path))["levers"]:
            ms = r["ms_per_step"]
            lever_rows.append(
                f"| `{model}` | {r['levers']} | {r['tokens_per_s']:.0f} | {r['ratio']:.2f} "
                f"| {ms['forward']:.1f} | {ms['backward']:.1f} | {r['max_loss_difference']:.1e} |"
            )
    return render("vs-pytorch", cores=cores, torch=torch, rows="\n".join(rows),
                  phase_rows="\n".join(phase_rows), lever_rows="\n".join(lever_rows))



def vs_pytorch_plot(directory):
    """Our tokens/s over DeepSpeed's at each stage, per model, as `docs/plots/vs-deepspeed.svg`."""
    d = Path(directory)
    seq = {"tiny": 128, "small": 256}
    ratios = {}
    for model in ["tiny", "small"]:
        if not (d / f"{model}-ddp.json").exists():
            continue
        for stage in range(4):
            ours = max(steady_tokens(json.load(open(d / f"{model}-{run}{stage}.json")), seq[model])
                       for run in ("ours", "mpi"))
            peer = json.load(open(d / f"{model}-ds{stage}.json"))["tokens_per_s"]
            ratios.setdefault(model, []).append(ours / peer)
    plot_ratios(ratios)


def plot_ratios(ratios):
    """[`vs_pytorch_plot`] from `{model: [ours / DeepSpeed at stages 0-3]}`."""
    grouped_bars(
        PLOT,
        "GPT on 2 CPU ranks: our tokens/s over DeepSpeed's (1.0: the same)",
        [f"ZeRO {s}" for s in range(4)],
        [(f"GPT {model}", values) for model, values in ratios.items()],
        "ours / DeepSpeed",
    )
