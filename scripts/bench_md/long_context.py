"""The `long-context` section of BENCHMARKS.md (prose: templates/long-context.md)."""
import json
from pathlib import Path

from .common import render

WAYS = {
    "plain": "sp 1, every activation kept",
    "long": "sp 1, blockwise attention, tiled MLP and loss, checkpoints in host memory",
    "sp4": "sp 4 (4 thread ranks), as above",
}


def _mb(value):
    return "" if value is None else f"{value / 1e6:,.0f}"


def _row(r):
    rep = r.get("report") if "report" in r else None
    if rep is None:
        return (f"| {r['way']} | {r['seq_len']:,} | {r['ranks']} | failed: {r['error']} "
                f"| {r['seconds']} | | | | | |")
    heap = rep.get("peak_activation_bytes")
    per_rank = None if heap is None else heap / r["ranks"]
    host = rep.get("checkpoint_host_bytes")
    return (f"| {r['way']} | {r['seq_len']:,} | {r['ranks']} | trained | {r['seconds']} "
            f"| {_mb(rep['peak_rss_bytes'])} | {_mb(heap)} | {_mb(per_rank)} | {_mb(host)} "
            f"| {rep['tokens_per_s']:.0f} |")


def _steady(report):
    """Tokens/s of the steps after the first (one sequence per step)."""
    times = report["step_seconds_per_sample"][1:]
    return report["seq_len"] * len(times) / sum(times)


def long_context(directory, cores):
    d = Path(directory)
    text = open(d / "runs.jsonl").read()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    ladder = [r for r in rows if r["way"] in WAYS]

    def longest(way):
        ok = [r["seq_len"] for r in ladder if r["way"] == way and "report" in r]
        return max(ok) if ok else 0

    plain = longest("plain")
    reached = []
    for way, what in WAYS.items():
        n = longest(way)
        ratio = f" ({n / plain:.1f}x plain)" if plain and way != "plain" else ""
        reached.append(f"- {what}: {n:,} positions{ratio}" if n else f"- {what}: none")
    speed = {r["way"]: r for r in rows if r["way"].startswith("speed-") and "report" in r}
    if "speed-sp1" in speed and "speed-sp2" in speed:
        one, two = _steady(speed["speed-sp1"]["report"]), _steady(speed["speed-sp2"]["report"])
        speed_line = (f"{speed['speed-sp1']['seq_len']:,} positions: sp 1 {one:.0f} tokens/s, "
                      f"sp 2 {two:.0f} tokens/s, ratio {two / one:.2f}")
    else:
        speed_line = "not measured (a run failed: see its `.err` file)"
    limits = rows[0] if rows else {"mem_gb": "?", "limit_s": "?"}
    return render("long-context", cores=cores, mem_gb=limits["mem_gb"], limit_s=limits["limit_s"], rows="\n".join(_row(r) for r in ladder),
                  reached="\n".join(reached), speed=speed_line)
