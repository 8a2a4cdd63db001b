#!/usr/bin/env python3
"""The table and the plot of bench/scripts/scale.sh: reads OUT/storm-N/storm.json for every N
present, prints a Markdown table (medians over the rounds, proxy ÷ HAProxy), writes an SVG of
three panels against the number of connections (log scale): the target's memory with all
connected, its CPU in the reconnection storm, and the time until every client is back.

    python3 bench/scripts/scale_plot.py OUT SVG
"""
import json
import math
import pathlib
import sys

TARGETS = [("haproxy", "HAProxy", "#d62728"), ("proxy", "proxy", "#1f77b4")]
PANELS = [
    ("rss_before_bytes", "memory, all connected (MiB)", 1 / 2**20),
    ("target_cpu_s", "CPU in the storm (s)", 1.0),
    ("all_back_us", "time until all are back (s)", 1e-6),
]
ROWS = [
    ("processes per role", None, None),
    ("rss_before_bytes", "target RSS, all connected", lambda v: f"{v / 2**20:.1f} MiB"),
    ("idle_cpu_s", "target CPU while all idle (2 s)", lambda v: f"{v:.2f} s"),
    ("all_back_us", "time until all are back", lambda v: f"{v / 1e6:.2f} s"),
    ("back_p99_us", "per-client reconnect p99", lambda v: f"{v / 1e6:.2f} s"),
    ("failed", "failed attempts", lambda v: f"{v:,.0f}"),
    ("target_cpu_s", "target CPU in the storm", lambda v: f"{v:.2f} s"),
    ("rss_peak_bytes", "target RSS peak in the storm", lambda v: f"{v / 2**20:.1f} MiB"),
]


def load(out):
    runs = {}
    for path in sorted(pathlib.Path(out).glob("storm-*/storm.json")):
        report = json.loads(path.read_text())
        n = report["parameters"]["connections"]
        medians = {}
        for metric in report["summary"]:
            for target, figures in metric["targets"].items():
                medians.setdefault(target, {})[metric["key"]] = figures["median"]
        runs[n] = (report["parameters"]["processes"], medians)
    return dict(sorted(runs.items()))


def table(runs):
    sizes = list(runs)
    lines = ["| figure | " + " | ".join(f"{n:,}: HAProxy / proxy (÷)" for n in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for key, label, fmt in ROWS:
        if fmt is None:
            cells = [str(runs[n][0]) for n in sizes]
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
            continue
        cells = []
        for n in sizes:
            m = runs[n][1]
            h, p = m.get("haproxy", {}).get(key), m.get("proxy", {}).get(key)
            if h is None or p is None:
                cells.append("–")
                continue
            ratio = f" ({p / h:.2f})" if h else ""
            cells.append(f"{fmt(h)} / {fmt(p)}{ratio}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def svg(runs):
    w, h, pad, gap = 300, 220, 50, 30
    width = len(PANELS) * (w + gap) + pad
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h + 2 * pad}" '
             'font-family="sans-serif" font-size="11">',
             f'<rect width="{width}" height="{h + 2 * pad}" fill="white"/>']
    sizes = list(runs)
    lo, hi = math.log10(min(sizes)), math.log10(max(sizes))
    for i, (key, title, scale) in enumerate(PANELS):
        x0, y0 = pad + i * (w + gap), pad
        values = [runs[n][1].get(t, {}).get(key) for n in sizes for t, _, _ in TARGETS]
        top = max(v * scale for v in values if v is not None) * 1.1 or 1
        parts.append(f'<text x="{x0 + w / 2}" y="{y0 - 12}" text-anchor="middle" '
                     f'font-weight="bold">{title}</text>')
        parts.append(f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#999"/>')
        px = lambda n: x0 + 10 + (w - 20) * ((math.log10(n) - lo) / ((hi - lo) or 1))
        py = lambda v: y0 + h - h * (v * scale) / top
        for n in sizes:
            parts.append(f'<text x="{px(n)}" y="{y0 + h + 14}" text-anchor="middle">{n:,}</text>')
        for frac in (0, 0.5, 1):
            v = top * frac / 1.1
            parts.append(f'<text x="{x0 - 4}" y="{y0 + h - h * frac / 1.1 + 4}" '
                         f'text-anchor="end">{v:.3g}</text>')
        for target, label, colour in TARGETS:
            points = [(px(n), py(runs[n][1][target][key])) for n in sizes
                      if runs[n][1].get(target, {}).get(key) is not None]
            if not points:
                continue
            parts.append('<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>'.format(
                colour, " ".join(f"{x:.1f},{y:.1f}" for x, y in points)))
            parts.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>'
                         for x, y in points)
        parts.append(f'<text x="{x0 + w / 2}" y="{y0 + h + 30}" text-anchor="middle">'
                     'connections (log scale)</text>')
    for j, (_, label, colour) in enumerate(TARGETS):
        parts.append(f'<rect x="{pad + j * 90}" y="4" width="10" height="10" '
                     f'fill="{colour}"/><text x="{pad + j * 90 + 14}" y="13">{label}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def main():
    out, path = sys.argv[1], sys.argv[2]
    runs = load(out)
    if not runs:
        sys.exit(f"no {out}/storm-*/storm.json found")
    print(table(runs))
    pathlib.Path(path).write_text(svg(runs))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
