"""The `resume` section of BENCHMARKS.md (prose: templates/resume.md)."""
import json
from pathlib import Path

from .common import render


def resume(directory, cores):
    d = Path(directory)
    runs = ("train", "resume", "resume_step")
    report = {k: json.load(open(d / f"{k}.json")) for k in runs}
    rss = {k: json.load(open(d / f"{k}.rss.json"))["max_rss_kib"] * 1024 for k in runs}
    train = report["train"]
    profile = json.load(open(d / "profile.json"))["profile"]
    labels = {
        "train": f"train {train['steps']} steps, save",
        "resume": "resume: load only",
        "resume_step": "resume: load, then one step",
    }
    rows = "\n".join(
        f"| {labels[k]} | {rss[k]:,} | {rss[k] / rss['train']:.3f} |" for k in runs
    )
    return render(
        "resume", train=train, cores=cores, rows=rows, profile=profile,
        worst=max(rss["resume"], rss["resume_step"]) / rss["train"],
        first=report["resume_step"]["losses"][0],
    )
