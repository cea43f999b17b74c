"""Plain SVG charts for BENCHMARKS.md and the README, written without a plotting library (none
is installed offline): grouped bars with a labelled axis, deterministic text for review."""
import math
from pathlib import Path

WIDTH, HEIGHT = 720, 360
LEFT, RIGHT, TOP, BOTTOM = 90, 20, 40, 70
COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759"]


def _ticks(top):
    """Round tick values from 0 to at least `top`, about five of them (steps of 1, 2 or 5 times
    a power of ten)."""
    raw = top / 5
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(f * magnitude for f in (1, 2, 5, 10) if raw <= f * magnitude)
    return [round(i * step, 10) for i in range(math.ceil(top / step - 1e-9) + 1)]


def grouped_bars(path, title, groups, series, unit, scale=1.0):
    """Writes a grouped bar chart to `path`: one group of bars per label in `groups`, one bar per
    `(name, values)` in `series`; the axis shows `value / scale` in `unit`."""
    values = [v / scale for _, vs in series for v in vs]
    ticks = _ticks(max(values))
    top = ticks[-1]
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    group_w = plot_w / len(groups)
    bar_w = group_w * 0.7 / len(series)
    y = lambda v: TOP + plot_h * (1 - v / top)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2:.0f}" y="22" text-anchor="middle" font-size="15">{title}</text>',
    ]
    for t in ticks:
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(t):.1f}" y2="{y(t):.1f}" '
                   f'stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    out.append(f'<text x="18" y="{TOP + plot_h / 2:.0f}" text-anchor="middle" '
               f'transform="rotate(-90 18 {TOP + plot_h / 2:.0f})">{unit}</text>')
    for g, label in enumerate(groups):
        x0 = LEFT + g * group_w + group_w * 0.15
        for s, (_, vs) in enumerate(series):
            v = vs[g] / scale
            out.append(f'<rect x="{x0 + s * bar_w:.1f}" y="{y(v):.1f}" width="{bar_w - 1:.1f}" '
                       f'height="{TOP + plot_h - y(v):.1f}" fill="{COLORS[s % len(COLORS)]}"/>')
        for line, text in enumerate(label.split("\n")):
            out.append(f'<text x="{LEFT + (g + 0.5) * group_w:.1f}" '
                       f'y="{TOP + plot_h + 18 + 14 * line}" text-anchor="middle">{text}</text>')
    out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{TOP + plot_h}" '
               f'y2="{TOP + plot_h}" stroke="black"/>')
    for s, (name, _) in enumerate(series):
        lx = LEFT + 10 + s * 200
        out.append(f'<rect x="{lx}" y="{HEIGHT - 22}" width="12" height="12" '
                   f'fill="{COLORS[s % len(COLORS)]}"/>')
        out.append(f'<text x="{lx + 18}" y="{HEIGHT - 12}">{name}</text>')
    out.append("</svg>")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(out) + "\n")
    print(f"wrote {path}")
