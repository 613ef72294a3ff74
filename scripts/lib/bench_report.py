"""Prints a table of scripts/bench.sh's JSON reports.

    python3 scripts/lib/bench_report.py OUT LABEL...

One row per label (`sqlite`, `sqlite-before`, `postgres`, …) whose `LABEL-fresh.json` and
`LABEL-replay.json` are in OUT. CPU figures are µs per request; "—" where not measured.
"""

import json
import os
import sys


def phase(report, name):
    return next(p for p in report["phases"] if p["name"] == name)


def us(v):
    return "—" if v is None else f"{v:.0f}"


def main():
    out, labels = sys.argv[1], sys.argv[2:]
    print(
        "| store, build | baseline req/s | fresh keyed req/s | fresh / baseline | replay req/s"
        " | replay / fresh | p99 fresh | p99 replay"
        " | server CPU µs/req baseline · fresh · replay"
        " | database CPU µs/req baseline · fresh · replay | peak memory |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label in labels:
        paths = [os.path.join(out, f"{label}-{mode}.json") for mode in ("fresh", "replay")]
        if not all(os.path.exists(p) for p in paths):
            continue
        fresh_run, replay_run = (json.load(open(p)) for p in paths)
        baseline, fresh = phase(fresh_run, "baseline"), phase(fresh_run, "fresh")
        replay = phase(replay_run, "replay")
        cpu = lambda key: " · ".join(us(p.get(key)) for p in (baseline, fresh, replay))
        peak = max(r.get("server_peak_rss_kib") or 0 for r in (fresh_run, replay_run))
        print(
            f"| {label} | {baseline['requests_per_second']:.0f}"
            f" | {fresh['requests_per_second']:.0f} | {fresh_run['ratio']:.3f}"
            f" | {replay['requests_per_second']:.0f} | {replay_run['ratio']:.1f}"
            f" | {fresh['p99_ms']:.1f} ms | {replay['p99_ms']:.1f} ms"
            f" | {cpu('server_cpu_us_per_request')} | {cpu('database_cpu_us_per_request')}"
            f" | {peak / 1024:.1f} MiB |"
        )


main()
