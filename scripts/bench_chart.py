#!/usr/bin/env python3
"""Draws scripts/bench.sh's JSON reports as an SVG bar chart (standard library only).

    python3 scripts/bench_chart.py DIR [-o OUT.svg] [--date DATE] [--commit COMMIT] [--note TEXT]

DIR holds the reports bench.sh writes (`LABEL-fresh.json`, `LABEL-replay.json` for each
LABEL: sqlite, postgres, sqlite-before, ...) and, optionally, `run.txt` with lines such as
`date: 2026-12-03` and `commit: 9d7026a` (the flags override them). Two panels, one group of
bars per label: requests per second of the unkeyed baseline, keyed fresh and replay phases,
with the ratios fresh / baseline and replay / fresh; and CPU µs per request of each phase,
the server's with the database's stacked on it where it was measured. Default output:
DIR/bench.svg.
"""

import argparse
import json
import math
import os
import sys
from xml.sax.saxutils import escape

ORDER = ["sqlite-before", "sqlite", "postgres-before", "postgres"]
PHASES = [("baseline", "unkeyed baseline"), ("fresh", "keyed, fresh key"), ("replay", "keyed, replay")]
COLOURS = {"baseline": "#9e9e9e", "fresh": "#1f77b4", "replay": "#2ca02c"}
DATABASE_COLOUR = "#ff7f0e"
FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"


def phase(report, name):
    return next((p for p in report["phases"] if p["name"] == name), None)


def read_run(directory):
    """The `key: value` lines of DIR/run.txt, if there is one."""
    meta = {}
    path = os.path.join(directory, "run.txt")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep:
                    meta[key.strip()] = value.strip()
    return meta


def load(directory):
    """One entry per label with both reports: its phases and ratios."""
    labels = sorted(
        {n.rsplit("-", 1)[0] for n in os.listdir(directory) if n.endswith(("-fresh.json", "-replay.json"))},
        key=lambda l: (ORDER.index(l) if l in ORDER else len(ORDER), l),
    )
    rows = []
    for label in labels:
        paths = [os.path.join(directory, f"{label}-{mode}.json") for mode in ("fresh", "replay")]
        if not all(os.path.exists(p) for p in paths):
            continue
        fresh_run, replay_run = (json.load(open(p, encoding="utf-8")) for p in paths)
        phases = {
            "baseline": phase(fresh_run, "baseline"),
            "fresh": phase(fresh_run, "fresh"),
            "replay": phase(replay_run, "replay"),
        }
        if any(p is None for p in phases.values()):
            continue
        rows.append({
            "label": label,
            "phases": phases,
            "fresh_ratio": fresh_run.get("ratio"),
            "replay_ratio": replay_run.get("ratio"),
            "concurrency": fresh_run.get("concurrency"),
            "requests": phases["fresh"]["requests"],
        })
    return rows


def nice_step(value):
    """A round tick step at or above value: 1, 2, 2.5 or 5 times a power of ten."""
    magnitude = 10 ** math.floor(math.log10(value)) if value > 0 else 1
    for step in (1, 2, 2.5, 5, 10):
        if step * magnitude >= value:
            return step * magnitude
    return 10 * magnitude


def fmt(v):
    if v == 0 or v >= 100:
        return f"{v:,.0f}".replace(",", " ")
    return f"{v:.1f}" if v < 10 else f"{v:.0f}"


class Svg:
    def __init__(self, width, height):
        self.width, self.height, self.parts = width, height, []

    def add(self, s):
        self.parts.append(s)

    def text(self, x, y, s, size=12, anchor="middle", weight="normal", fill="#222"):
        self.add(
            f"<text x='{x:.1f}' y='{y:.1f}' font-size='{size}' text-anchor='{anchor}' "
            f"font-weight='{weight}' fill='{fill}' {FONT}>{escape(s)}</text>"
        )

    def rect(self, x, y, w, h, fill, tip=None):
        body = f"<title>{escape(tip)}</title>" if tip else ""
        self.add(f"<rect x='{x:.1f}' y='{y:.1f}' width='{w:.1f}' height='{h:.1f}' fill='{fill}'>{body}</rect>")

    def line(self, x1, y1, x2, y2, stroke="#ccc", width=1):
        self.add(f"<line x1='{x1:.1f}' y1='{y1:.1f}' x2='{x2:.1f}' y2='{y2:.1f}' stroke='{stroke}' stroke-width='{width}'/>")

    def render(self, title):
        return (
            "<?xml version='1.0' encoding='UTF-8'?>\n"
            f"<svg xmlns='http://www.w3.org/2000/svg' width='{self.width}' height='{self.height}' "
            f"viewBox='0 0 {self.width} {self.height}'>\n<title>{escape(title)}</title>\n"
            f"<rect width='{self.width}' height='{self.height}' fill='white'/>\n"
            + "\n".join(self.parts)
            + "\n</svg>\n"
        )


def panel(svg, x0, y0, w, h, rows, title, value, stacked=None, ratios=False):
    """One panel: a group of three bars (the phases) per row; `value(p)` gives a bar's
    height, `stacked(p)` an optional part stacked on it (the database's CPU)."""
    top = max(
        (value(p) or 0) + ((stacked(p) or 0) if stacked else 0)
        for r in rows for p in r["phases"].values()
    )
    step = nice_step(top * 1.1 / 5)
    ticks = max(1, math.ceil(top * 1.1 / step))
    axis = step * ticks
    svg.text(x0 + w / 2, y0 - 12, title, size=14, weight="bold")
    for i in range(ticks + 1):
        v = step * i
        y = y0 + h - h * i / ticks
        svg.line(x0, y, x0 + w, y, stroke="#e4e4e4")
        svg.text(x0 - 6, y + 4, fmt(v), size=10, anchor="end", fill="#555")
    svg.line(x0, y0 + h, x0 + w, y0 + h, stroke="#444")
    group = w / max(len(rows), 1)
    bar = min(group / 4.2, 70)
    for g, r in enumerate(rows):
        left = x0 + g * group + (group - 3 * bar) / 2
        for k, (name, _) in enumerate(PHASES):
            p = r["phases"][name]
            v = value(p)
            x = left + k * bar
            if v is None:
                svg.text(x + bar / 2, y0 + h - 4, "—", size=10)
                continue
            bh = h * v / axis
            svg.rect(x + 2, y0 + h - bh, bar - 4, bh, COLOURS[name], f"{r['label']} {name}: {fmt(v)}")
            label_y = y0 + h - bh
            s = stacked(p) if stacked else None
            if s:
                sh = h * s / axis
                svg.rect(x + 2, label_y - sh, bar - 4, sh, DATABASE_COLOUR, f"{r['label']} {name} database: {fmt(s)}")
                svg.text(x + bar / 2, label_y - sh - 4, f"{fmt(v)}+{fmt(s)}", size=10)
            else:
                svg.text(x + bar / 2, label_y - 4, fmt(v), size=10)
        svg.text(x0 + g * group + group / 2, y0 + h + 18, r["label"], size=12, weight="bold")
        if ratios:
            lines = []
            if r["fresh_ratio"] is not None:
                lines.append(f"fresh / baseline {r['fresh_ratio']:.2f}")
            if r["replay_ratio"] is not None:
                lines.append(f"replay / its run's fresh {r['replay_ratio']:.1f}")
            for n, text in enumerate(lines):
                svg.text(x0 + g * group + group / 2, y0 + h + 34 + 15 * n, text, size=11, fill="#444")


def chart(rows, date, commit, note):
    width, height = 1000, 490
    svg = Svg(width, height)
    title = f"idemkey bench (scripts/bench.sh), {date}, commit {commit}"
    svg.text(width / 2, 26, title, size=16, weight="bold")
    load = f"{rows[0]['requests']} requests per phase, {rows[0]['concurrency']} clients, loopback" if rows else ""
    svg.text(width / 2, 46, " · ".join(s for s in (load, note) if s), size=12, fill="#444")
    top, h = 96, 270
    panel(svg, 70, top, 400, h, rows, "requests per second (higher is better)",
          lambda p: p.get("requests_per_second"), ratios=True)
    panel(svg, 570, top, 400, h, rows, "CPU µs per request (lower is better)",
          lambda p: p.get("server_cpu_us_per_request"),
          stacked=lambda p: p.get("database_cpu_us_per_request"))
    # Legend.
    items = [(COLOURS[n], t) for n, t in PHASES] + [(DATABASE_COLOUR, "database CPU (stacked on the server's)")]
    x = 70
    for colour, text in items:
        svg.rect(x, height - 42, 14, 14, colour)
        svg.text(x + 20, height - 30, text, size=12, anchor="start")
        x += 30 + 7.2 * len(text)
    return svg.render(title)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("-o", "--output")
    ap.add_argument("--date")
    ap.add_argument("--commit")
    ap.add_argument("--note")
    args = ap.parse_args()
    meta = read_run(args.dir)
    rows = load(args.dir)
    if not rows:
        sys.exit(f"no LABEL-fresh.json / LABEL-replay.json pairs in {args.dir}")
    date = args.date or meta.get("date", "date unknown")
    commit = args.commit or meta.get("commit", "unknown")
    note = args.note if args.note is not None else meta.get("note", "")
    out = args.output or os.path.join(args.dir, "bench.svg")
    with open(out, "w", encoding="utf-8") as f:
        f.write(chart(rows, date, commit, note))
    print(out)


main()
