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


def _open(title):
    """The start of a chart: the canvas and its title."""
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2:.0f}" y="22" text-anchor="middle" font-size="15">{title}</text>',
    ]


def _close(path, out, names, spacing):
    """Adds the legend (one colour per name, `spacing` apart) and writes the chart to `path`."""
    for s, name in enumerate(names):
        lx = LEFT + 10 + s * spacing
        out.append(f'<rect x="{lx}" y="{HEIGHT - 22}" width="12" height="12" '
                   f'fill="{COLORS[s % len(COLORS)]}"/>')
        out.append(f'<text x="{lx + 18}" y="{HEIGHT - 12}">{name}</text>')
    out.append("</svg>")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(out) + "\n")
    print(f"wrote {path}")


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
    out = _open(title)
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
    _close(path, out, [name for name, _ in series], 200)


def _span_ticks(lo, hi):
    """Round tick values covering `lo`..`hi`, about five of them."""
    raw = (hi - lo) / 5 or abs(hi) or 1.0
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(f * magnitude for f in (1, 2, 5, 10) if raw <= f * magnitude)
    first = math.floor(lo / step + 1e-9)
    last = math.ceil(hi / step - 1e-9)
    return [round(i * step, 10) for i in range(first, last + 1)]


def running_mean(values, window):
    """Each value replaced by the mean of the `window` values up to it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def lines(path, title, series, x_label, y_label):
    """Writes a line chart to `path`: one line per `(name, values)` in `series`, the x axis the
    value's index plus one (a step)."""
    values = [v for _, vs in series for v in vs]
    ticks = _span_ticks(min(values), max(values))
    lo, hi = ticks[0], max(ticks[-1], ticks[0] + 1e-9)
    steps = max(len(vs) for _, vs in series)
    xticks = _ticks(steps)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    x = lambda i: LEFT + plot_w * i / xticks[-1]
    y = lambda v: TOP + plot_h * (1 - (v - lo) / (hi - lo))
    out = _open(title)
    for t in ticks:
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(t):.1f}" y2="{y(t):.1f}" '
                   f'stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    for t in xticks:
        out.append(f'<text x="{x(t):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{t:g}'
                   f'</text>')
    out.append(f'<text x="{LEFT + plot_w / 2:.0f}" y="{TOP + plot_h + 32}" '
               f'text-anchor="middle">{x_label}</text>')
    out.append(f'<text x="18" y="{TOP + plot_h / 2:.0f}" text-anchor="middle" '
               f'transform="rotate(-90 18 {TOP + plot_h / 2:.0f})">{y_label}</text>')
    for s, (_, vs) in enumerate(series):
        points = " ".join(f"{x(i + 1):.1f},{y(v):.1f}" for i, v in enumerate(vs))
        out.append(f'<polyline points="{points}" fill="none" stroke-width="1.5" '
                   f'stroke="{COLORS[s % len(COLORS)]}"/>')
    out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{TOP + plot_h}" '
               f'y2="{TOP + plot_h}" stroke="black"/>')
    _close(path, out, [name for name, _ in series], 160)
