"""The `offload` section of BENCHMARKS.md (prose: templates/offload.md)."""
import json
from pathlib import Path

from .common import render


def offload(directory, cores):
    d = Path(directory)
    s = json.load(open(d / "swap.json"))
    g = {k: json.load(open(d / f"gpt_{k}.json")) for k in ("none", "nvme")}
    gb = s["state_bytes"] / 1e9
    pass_rows = [
        f"| swap pass (read + write back) | {p['engine']} | {p['seconds']:.2f} "
        f"| {p['read_write_gb_per_s']:.3f} (read + written) | {p['efficiency']:.2f} |"
        for p in s["swap_passes"]
    ]
    rows = []
    for k in ("none", "nvme"):
        r = g[k]
        sw = r.get("swap")
        swap_cols = (
            f"{sw['disk_bytes']:,} | {sw['read_gb_per_s']:.3f} / {sw['write_gb_per_s']:.3f}"
            if sw else " | "
        )
        rows.append(
            f"| {k} | {r['tokens_per_s']:.0f} | {r['model_state_bytes_per_rank']:,} "
            f"| {swap_cols} | {r['losses'][-1]:.4f} |"
        )
    same = g["none"]["losses"] == g["nvme"]["losses"]
    return render(
        "offload", s=s, none=g["none"], cores=cores, gb=gb,
        write_s=s["state_bytes"] / 1e9 / s["raw_write_gb_per_s"],
        read_s=s["state_bytes"] / 1e9 / s["raw_read_gb_per_s"],
        pass_rows="\n".join(pass_rows), rows="\n".join(rows), same="yes" if same else "no",
    )
