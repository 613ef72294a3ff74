"""Writes scripts/bench_all.sh's summary: one table per section of docs/benchmarks.md.

    python3 scripts/lib/bench_summary.py OUT > OUT/summary.md

OUT is bench_all.sh's output directory: run.json (commit, date, machine), phases.tsv (each
phase's exit status and seconds) and a subdirectory per phase with the JSON, CSV and log its
script wrote. A section whose phase was skipped, failed or left no figures says so.
"""

import csv
import glob
import json
import os
import re
import sys

OUT = sys.argv[1] if len(sys.argv) > 1 else sys.exit(__doc__)


def read(*parts):
    path = os.path.join(OUT, *parts)
    return open(path, encoding="utf-8").read() if os.path.exists(path) else None


def load(path):
    return json.load(open(path, encoding="utf-8")) if os.path.exists(path) else None


def phase(report, name):
    return next((p for p in report["phases"] if p["name"] == name), None)


def us(v):
    return "—" if v is None else f"{v:.0f}"


def span(values):
    """`a` or `a–b` of some numbers, "—" when there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    lo, hi = min(values), max(values)
    return f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}–{hi:.0f}"


PHASES = {}
for row in csv.DictReader(open(os.path.join(OUT, "phases.tsv"), encoding="utf-8"), delimiter="\t"):
    PHASES[row["phase"]] = row


def state(name):
    """None when the phase ran and succeeded, else a sentence saying why it has no figures."""
    row = PHASES.get(name)
    if row is None:
        return f"**Not run** (`{name}` is not in this run)."
    if row["status"] == "skipped":
        return f"**Skipped**: {read(name, 'skipped.txt').strip()}."
    if row["status"] == "124":
        return f"**Out of time** after {row['seconds']} s: see `{name}/log.txt`."
    if row["status"] != "0":
        return f"**Failed** (exit {row['status']}) after {row['seconds']} s: see `{name}/log.txt`."
    return None


def section(title, *names):
    """The section's heading, then why each of its phases that did not succeed has no figures."""
    print(f"\n## {title}\n")
    for name in names:
        if name in PHASES and state(name):
            print(state(name) + "\n")


def verbatim(text):
    print("```")
    print(text.rstrip())
    print("```")


run = load(os.path.join(OUT, "run.json"))
m = run["machine"]
print(f"# Benchmarks at `{run['commit']}`{' (with uncommitted changes)' if run['dirty'] else ''}")
print()
print(f"{run['date']}; {m['nproc']} cores ({m['cpu']}), {m['memory_gib']} GiB, Linux {m['kernel']};")
print(f"{m['postgresql'] or 'no PostgreSQL'}; {m['mariadb'] or 'no MariaDB'}.")
if run["quick"]:
    print("\n**QUICK=1: a smoke run with small counts; its figures are not the page's.**")
print("\n| phase | status | seconds |\n|---|---|---|")
for row in PHASES.values():
    status = {"0": "ok", "124": "out of time", "skipped": "skipped"}.get(row["status"], f"exit {row['status']}")
    print(f"| {row['phase']} | {status} | {row['seconds']} |")

# Overhead against no idempotency: the rounds' lines of bench_overhead.sh.
section("Overhead against no idempotency", "overhead-sqlite", "overhead-postgres")
if text := read("wrk-missing.txt"):
    print(f"**{text.strip()}.**\n")
LINE = re.compile(
    r"^(wrk|idemkey bench) round \d+: keyed (\d+) req/s, unkeyed (\d+) req/s, keyed / unkeyed ([\d.]+);"
    r" server CPU µs/req keyed (\d+) · unkeyed (\d+)(?:; database (\d+) · (\d+))?"
)
print("| store | load | keyed / unkeyed | keyed req/s | unkeyed req/s"
      " | server CPU µs/req, keyed · unkeyed | database CPU µs/req, keyed · unkeyed |")
print("|---|---|---|---|---|---|---|")
for store, name in (("SQLite", "overhead-sqlite"), ("PostgreSQL", "overhead-postgres")):
    rows = {}
    for line in (read(name, "log.txt") or "").splitlines():
        if match := LINE.match(line):
            rows.setdefault(match[1], []).append(match.groups()[1:])
    for load_name, rounds in rows.items():
        col = lambda i: " · ".join(r[i] for r in rounds)
        num = lambda i: [float(r[i]) for r in rounds if r[i] is not None]
        db = f"{span(num(5))} · {span(num(6))}" if store == "PostgreSQL" else "—"
        label = "wrk" if load_name == "wrk" else "`idemkey bench`"
        print(f"| {store} | {label} | {col(2)} | {col(0)} | {col(1)}"
              f" | {span(num(3))} · {span(num(4))} | {db} |")

# Charted: scripts/bench.sh's reports.
section("Overhead against no idempotency: charted", "bench")
reports = {}
for store in ("sqlite", "postgres"):
    fresh = load(os.path.join(OUT, "bench", f"{store}-fresh.json"))
    replay = load(os.path.join(OUT, "bench", f"{store}-replay.json"))
    if fresh and replay:
        reports[store] = (fresh, replay)
if os.path.exists(os.path.join(OUT, "bench.svg")):
    print("![bench](bench.svg)\n")
if reports:
    print(read("bench", "bench.md").rstrip())
    print()
    print("; ".join(
        f"{store}: keyed / unkeyed {f['ratio']:.2f}, replay / fresh {r['ratio']:.1f}"
        for store, (f, r) in reports.items()
    ) + ".")

section("Against the peers", "peers")
if state("peers") is None:
    verbatim(read("peers", "log.txt"))

# Replay: from the cache (bench.sh), from the database (bench_scale.sh, SCALE=1).
section("Replay", "bench")
print("| where the answer comes from | store | replay req/s | replay / fresh | p99 replay"
      " | server CPU µs/replay | database CPU µs/replay |")
print("|---|---|---|---|---|---|---|")
for store, (fresh, replay) in reports.items():
    p = phase(replay, "replay")
    print(f"| the replay cache | {store} | {p['requests_per_second']:.0f} | {replay['ratio']:.1f}×"
          f" | {p['p99_ms']:.1f} ms | {us(p.get('server_cpu_us_per_request'))}"
          f" | {us(p.get('database_cpu_us_per_request'))} |")
print("\nFrom the database: the scale run's `db replay` rows (At scale, below).")

# The gateway: bench_gateway.sh's reports, one per label, round and mode.
section("The gateway", "gateway")
print("| contender | fresh req/s | replay req/s | p99 fresh / replay, ms | CPU µs per fresh request: proxy + store |")
print("|---|---|---|---|---|")
labels = {}
for path in sorted(glob.glob(os.path.join(OUT, "gateway", "gateway-*-fresh.json"))):
    label, rnd = re.match(r"gateway-(.+)-(\d+)-fresh\.json$", os.path.basename(path)).groups()
    replay = load(path[: -len("fresh.json")] + "replay.json")
    if replay:
        labels.setdefault(label, []).append((phase(load(path), "fresh"), phase(replay, "replay")))
for label, rounds in labels.items():
    join = lambda f: " · ".join(f(fr, rp) for fr, rp in rounds)
    cpu = lambda fr: us(fr.get("server_cpu_us_per_request")) + (
        f" + {us(fr['database_cpu_us_per_request'])}" if fr.get("database_cpu_us_per_request") else ""
    )
    fresh_rps = join(lambda f, r: f"{f['requests_per_second']:.0f}")
    replay_rps = join(lambda f, r: f"{r['requests_per_second']:.0f}")
    p99 = join(lambda f, r: f"{f['p99_ms']:.1f} / {r['p99_ms']:.1f}")
    print(f"| {label} | {fresh_rps} | {replay_rps} | {p99} | {join(lambda f, r: cpu(f))} |")
if not os.environ.get("PROXY") and "idempotent-proxy" not in labels:
    print("\nidempotent-proxy was not run (PROXY=path/to/idempotent-proxy-server runs it).")

section("MariaDB and a Galera cluster", "mysql")
if text := read("mysql", "bench_mysql.md"):
    print("\n".join(l for l in text.splitlines() if not re.match(r"^(date|machine|commit|command|took): ", l)))

section("At scale", "scale")
if state("scale") is None and (text := read("scale", "scale.md")):
    print(text.rstrip())

# Memory over time: soak.sh's own verdict (its last lines), per store.
section("Memory over 10 minutes (soak)", "soak-sqlite", "soak-postgres")
for store in ("sqlite", "postgres"):
    log = (read(f"soak-{store}", "log.txt") or "").splitlines()
    start = next((i for i, l in enumerate(log) if l.startswith(f"soak, {store}:")), None)
    if start is not None:
        print("\n".join(log[start:]) + "\n")

# What the record costs the database alone.
section("What the record costs the database alone", "sqlite-record", "pgbench-record")
if state("sqlite-record") is None:
    print("**SQLite** (`sqlite_record` example):\n")
    verbatim(read("sqlite-record", "log.txt"))
    print()


def pgbench_rows(name):
    """{variant: [(round, req/s, cpu, ratio)]} from pgbench_record.sh's output lines."""
    rows = {}
    for line in (read(name, "log.txt") or "").splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[0].isdigit():
            rows.setdefault(parts[1], []).append((parts[0], parts[2], int(parts[3]), parts[4]))
    return rows


rows = pgbench_rows("pgbench-record")
if rows:
    variants = list(rows)
    print("**PostgreSQL** (`pgbench_record.sh`):\n")
    print("| round | " + " | ".join(variants) + " |")
    print("|---" * (len(variants) + 1) + "|")
    for i, (rnd, *_rest) in enumerate(rows[variants[0]]):
        cells = [rows[variants[0]][i][1]] + [f"{rows[v][i][1]}, {rows[v][i][3]}" for v in variants[1:]]
        print(f"| {rnd} | " + " | ".join(cells) + " |")
    print("| database CPU µs per request | " + " | ".join(span([r[2] for r in rows[v]]) for v in variants) + " |")
grouped = sorted(
    (int(n.rsplit("-", 1)[1]), n) for n in PHASES if n.startswith("pgbench-grouped-")
)
if grouped:
    print("\n`external_grouped`:\n")
    for _, name in grouped:
        if state(name):
            print(f"{name}: {state(name)}\n")
    print("| writes of each kind a group | " + " | ".join(str(g) for g, _ in grouped) + " |")
    print("|---" * (len(grouped) + 1) + "|")
    cols = [pgbench_rows(name).get("external_grouped", []) for _, name in grouped]
    print("| requests/s | " + " | ".join(" · ".join(r[1] for r in c) or "—" for c in cols) + " |")
    print("| database CPU µs per request | " + " | ".join(" · ".join(str(r[2]) for r in c) or "—" for c in cols) + " |")

# Fingerprinting: criterion's estimates (the middle of each `time:` interval).
section("Fingerprinting", "fingerprint")
name = None
print("| benchmark | time (criterion's estimate) |\n|---|---|")
for line in (read("fingerprint", "log.txt") or "").splitlines():
    if match := re.match(r"^(\S+)?\s+time:\s+\[\S+ \S+ (\S+ \S+) \S+ \S+\]", line):
        print(f"| {match[1] or name} | {match[2]} |")
    elif line and not line.startswith(" ") and " " not in line.strip():
        name = line.strip()
