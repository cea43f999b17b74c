"""The `moonshot` section of BENCHMARKS.md (prose: templates/moonshot.md)."""
import json
import re
from pathlib import Path

from .common import render
from .svg import grouped_bars

PLOT = Path(__file__).resolve().parents[2] / "docs" / "plots" / "moonshot-swap.svg"


def moonshot(directory, cores, mem_bytes):
    d = Path(directory)
    r = json.load(open(d / "xl.last.json"))
    err = open(d / "xl.err").read()
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", err)
    time_rss = int(m.group(1)) * 1024 if m else None
    base = r["disk_baseline"]
    params = r["params"]
    losses = r["losses"]
    steps = len(losses)
    step_secs = [x * r["train_batch_size"] for x in r["step_seconds_per_sample"]]
    opt = r["swap"]
    par = r["param_store"]["swap"]
    gib = 1 << 30
    rows = [
        f"| {name} | {sw['bytes_read'] / 1e9:.1f} | {sw['read_gb_per_s']:.3f} "
        f"({sw['read_gb_per_s'] / base['read_gb_per_s']:.0%}) | {sw['bytes_written'] / 1e9:.1f} "
        f"| {sw['write_gb_per_s']:.3f} ({sw['write_gb_per_s'] / base['write_gb_per_s']:.0%}) |"
        for name, sw in (("parameters", par), ("optimizer", opt))
    ]
    # The optimizer step's wall time against the disk's time to move its bytes at the
    # baseline rates (a step moves the whole state in and out).
    moved = opt["disk_bytes"] / 1e9
    disk_time = moved / base["read_gb_per_s"] + moved / base["write_gb_per_s"]
    steady = r["optimizer_seconds"][1:] or r["optimizer_seconds"]
    return render(
        "moonshot", cores=cores, ram_gib=int(mem_bytes) / gib, params=params,
        formula_gb=16 * params / 1e9, engine=opt["engine"], steps=steps,
        losses=" -> ".join(f"{x:.3f}" for x in losses),
        step_secs=", ".join(f"{x:.0f}" for x in step_secs),
        forward_backward=", ".join(f"{x:.0f}" for x in r["forward_backward_seconds"]),
        optimizer=", ".join(f"{x:.0f}" for x in r["optimizer_seconds"]),
        rss_gb=r["peak_rss_bytes"] / 1e9,
        time_rss=f"| peak RSS, `time -v` (GB) | {time_rss / 1e9:.2f} |" if time_rss else "",
        state_gb=r["model_state_bytes_per_rank"] / 1e9, param_swap_gb=par["disk_bytes"] / 1e9,
        optimizer_swap_gb=opt["disk_bytes"] / 1e9, baseline_gb=base["bytes"] / 1e9,
        write_gbps=base["write_gb_per_s"], read_gbps=base["read_gb_per_s"], rows="\n".join(rows),
        moved=moved, disk_time=disk_time, fastest=min(steady), slowest=max(steady),
        share=disk_time / (sum(steady) / len(steady)),
    )


def moonshot_plot(directory):
    """The swap files' transfer rates against the disk's own, as `docs/plots/moonshot-swap.svg`."""
    r = json.load(open(Path(directory) / "xl.last.json"))
    base = r["disk_baseline"]
    rates = {"the disk alone": (base["read_gb_per_s"], base["write_gb_per_s"])}
    for name, sw in (("parameter swap file", r["param_store"]["swap"]),
                     ("optimizer swap file", r["swap"])):
        rates[name] = (sw["read_gb_per_s"], sw["write_gb_per_s"])
    plot_rates(rates)


def plot_rates(rates):
    """[`moonshot_plot`] from `{what: (read GB/s, write GB/s)}`."""
    grouped_bars(
        PLOT,
        "ZeRO-Infinity, 2B-parameter GPT: swap-file transfer rates against the disk",
        ["read", "write"],
        [(name, list(pair)) for name, pair in rates.items()],
        "GB/s",
    )
