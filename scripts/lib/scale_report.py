"""Prints the "At scale" tables of docs/benchmarks.md from scripts/bench_scale.sh's JSON.

    python3 scripts/lib/scale_report.py OUT LARGE SMALL "sqlite postgres"
"""

import glob
import json
import os
import statistics
import sys

out, large, small, stores = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()


def load(path):
    with open(path) as f:
        return json.load(f)


def phase(report, name):
    return next(p for p in report["phases"] if p["name"] == name)


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v, unit=""):
    if v is None:
        return "—"
    if v >= 1000:
        return f"{v:,.0f}{unit}".replace(",", " ")
    return f"{v:.1f}{unit}" if v < 100 else f"{v:.0f}{unit}"


def count(n):
    exp = len(str(n)) - 1
    return f"10^{exp}" if n == 10**exp else f"{n:,}".replace(",", " ")


METRICS = [
    ("requests_per_second", "req/s", "≥ 0.8"),
    ("p99_ms", "p99 ms", ""),
    ("server_cpu_us_per_request", "server CPU µs/req", ""),
    ("database_cpu_us_per_request", "database CPU µs/req", ""),
]

print(f"### Scale: {count(large)} records against {count(small)}\n")
for store in stores:
    rows = []
    verdicts = []
    for label, suffix, name in [
        ("fresh", "", "fresh"),
        ("replay (cache)", "", "replay"),
        ("replay (database, after a restart)", "-db", "fresh"),
    ]:
        figures = {}
        for size in ("small", "large"):
            files = sorted(glob.glob(f"{out}/scale-{store}-{size}-[0-9]{suffix}.json"))
            files = [f for f in files if suffix or not f.endswith("-db.json")]
            figures[size] = {
                key: median(phase(load(f), name).get(key) for f in files) for key, _, _ in METRICS
            }
            figures[size]["runs"] = len(files)
        for key, what, target in METRICS:
            a, b = figures["small"][key], figures["large"][key]
            if a is None and b is None:
                continue
            ratio = b / a if a and b is not None else None
            verdict = ""
            if target and ratio is not None:
                met = ratio >= 0.8
                verdict = "met" if met else "**not met**"
                verdicts.append((label, ratio, met))
            rows.append(
                f"| {label} | {what} | {fmt(a)} | {fmt(b)} | "
                f"{'—' if ratio is None else f'{ratio:.2f}'} | {verdict} |"
            )
    print(f"{store} (median of {figures['small']['runs']} rounds each):\n")
    print(f"| load | figure | {count(small)} records | {count(large)} records | ratio | target ≥ 0.8× |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()

purges = [s for s in stores if os.path.exists(f"{out}/purge-{s}-summary.json")]
if purges:
    print(f"### Purge under load: {count(large)} expired records\n")
    print("| store | load | req/s | p50 ms | p99 ms | max ms | server CPU µs/req | database CPU µs/req | expired left after |")
    print("|---|---|---|---|---|---|---|---|---|")
    verdicts = []
    for store in purges:
        summary = load(f"{out}/purge-{store}-summary.json")
        with_p99, without_p99 = [], []
        for kind, sink in (("with", with_p99), ("without", without_p99)):
            for f in sorted(glob.glob(f"{out}/purge-{store}-{kind}-*.json")):
                r = load(f)
                p = phase(r, "fresh")
                sink.append(p["p99_ms"])
                n = f.rsplit("-", 1)[1].removesuffix(".json")
                left = r.get("expired_left_after")
                print(
                    f"| {store} | fresh, {kind} purge #{n} | {fmt(p['requests_per_second'])} | "
                    f"{p['p50_ms']:.2f} | {p['p99_ms']:.2f} | {p['max_ms']:.1f} | "
                    f"{fmt(p.get('server_cpu_us_per_request'))} | "
                    f"{fmt(p.get('database_cpu_us_per_request'))} | "
                    f"{'—' if left is None else fmt(left)} |"
                )
        verdicts.append((store, summary, with_p99, without_p99))
    print()
    for store, summary, with_p99, without_p99 in verdicts:
        rate = summary["expired"] / max(summary["purge_seconds"], 1)
        if summary.get("finished", True):
            took = f"took ~{summary['purge_seconds']} s (~{fmt(rate)} records/s)"
        else:
            took = f"had not ended after {summary['purge_seconds']} s (the wait's bound)"
        line = f"- {store}: the purge of {count(summary['expired'])} records {took}"
        scale = [
            phase(load(f), "fresh")["p99_ms"]
            for f in glob.glob(f"{out}/scale-{store}-large-[0-9].json")
        ]
        if not with_p99:
            line += "; the purge ended before a load could run under it"
        for what, ref in (
            ("the same server after the purge", without_p99),
            (f"the scale run's {count(large)}-record server", scale),
        ):
            if with_p99 and ref:
                worst, base = max(with_p99), statistics.median(ref)
                ratio = worst / base
                line += (
                    f"; worst p99 under purge {worst:.2f} ms against {base:.2f} ms on {what}: "
                    f"{ratio:.2f}× (target ≤ 2×: {'met' if ratio <= 2 else '**not met**'})"
                )
        print(line)
