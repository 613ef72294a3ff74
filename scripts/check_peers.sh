#!/usr/bin/env bash
# Runs `idemkey check` against other idempotency-key libraries, each wrapped as a small server
# (the peers kit: POST /payments with {"amount", "currency"}, GET /effects -> {"count": N}),
# and against `idemkey serve` (SQLite, two tenants, so `scope` runs), then prints one Markdown
# table: peer, library version, storage, exit code, and each check's verdict. Only
# axum-idempotent has a notion of callers (its session cookie); for the others `scope` is
# skipped.
#
#   scripts/check_peers.sh PEERS_DIR IDEMKEY_BIN [OUT_DIR]
#
# PEERS_DIR is the peers kit (node/, python/, rust-axum-idempotent/). What is missing is
# installed into the kit's scratch directories only (node/node_modules, python/.venv,
# rust-axum-idempotent/target, .run): a private redis-server (apt-get if absent) on
# 127.0.0.1:$REDIS_PORT (6399), npm ci, a venv from requirements.lock.txt, and the axum peer
# built from a copy of its sources in .run. OUT_DIR (default PEERS_DIR/.run/check) gets one
# JSON report per configuration, the logs and table.md. ONLY=a,b runs some configurations.
# Loopback only; every wait is bounded and every process started is stopped by its PID.
set -u
[ $# -ge 2 ] || { sed -n 2,16p "$0"; exit 2; }
PEERS=$(cd "$1" && pwd) || exit 2
BIN=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
[ -x "$BIN" ] || { echo "not an executable: $2" >&2; exit 2; }
OUT=${3:-$PEERS/.run/check}
mkdir -p "$OUT" "$PEERS/.run"
OUT=$(cd "$OUT" && pwd)
RUN=$PEERS/.run
PY=$PEERS/python/.venv/bin
AXUM=$PEERS/rust-axum-idempotent/target/release/peer-axum-idempotent
REDIS_PORT=${REDIS_PORT:-6399}
PORT_BASE=${PORT_BASE:-18400}
BODY='{"amount": 100, "currency": "usd"}'
# Python writes no __pycache__ into the kit.
export PYTHONDONTWRITEBYTECODE=1

# name | version source (npm/pip/cargo package) | storage | command | environment | another
# caller's header, for `scope` (axum-idempotent keeps answers per session cookie)
CONFIGS=(
  "nestjs-node-idempotency-memory|npm @node-idempotency/nestjs|memory|node node/node-idempotency-nestjs-server.js|STORAGE=memory"
  "nestjs-node-idempotency-redis|npm @node-idempotency/nestjs|redis|node node/node-idempotency-nestjs-server.js|STORAGE=redis"
  "express-idempotency-memory|npm express-idempotency|memory|node node/express-idempotency-server.js|STORAGE=memory"
  "express-idempotency-redis|npm express-idempotency-redis-adapter|redis|node node/express-idempotency-server.js|STORAGE=redis"
  "powertools-idempotency-redis|npm @aws-lambda-powertools/idempotency|redis|node node/powertools-express-server.js|PT_VALIDATE=0 PT_CONTEXT=1"
  "powertools-idempotency-redis+validation|npm @aws-lambda-powertools/idempotency|redis|node node/powertools-express-server.js|PT_VALIDATE=1 PT_CONTEXT=1"
  "powertools-idempotency-redis-nocontext|npm @aws-lambda-powertools/idempotency|redis|node node/powertools-express-server.js|PT_VALIDATE=0 PT_CONTEXT=0"
  "asgi-idempotency-header-memory|pip asgi-idempotency-header|memory|uvicorn asgi_idempotency_header_app:app|STORAGE=memory"
  "asgi-idempotency-header-redis|pip asgi-idempotency-header|redis|uvicorn asgi_idempotency_header_app:app|STORAGE=redis"
  "fastapi-idempotency-key-memory|pip fastapi-idempotency-key|memory|uvicorn fastapi_idempotency_key_app:app|STORAGE=memory"
  "fastapi-idempotency-key-redis|pip fastapi-idempotency-key|redis|uvicorn fastapi_idempotency_key_app:app|STORAGE=redis"
  "fastapi-idempotency-memory|pip fastapi-idempotency|memory|uvicorn fastapi_idempotency_app:app|STORAGE=memory"
  "django-idempotency-key-memory|pip django-idempotency-key|memory|gunicorn django_peer.wsgi:application|STORAGE=memory"
  "django-idempotency-key-redis|pip django-idempotency-key|redis|gunicorn django_peer.wsgi:application|STORAGE=redis"
  "axum-idempotent-moka|cargo axum-idempotent|memory (moka, 1 shared session)|axum|STORAGE=memory INJECT_SESSION=1|Cookie: session=b3RoZXItY2FsbGVyLXNlcw"
  "axum-idempotent-redis|cargo axum-idempotent|redis (fred, 1 shared session)|axum|STORAGE=redis INJECT_SESSION=1|Cookie: session=b3RoZXItY2FsbGVyLXNlcw"
  "axum-idempotent-moka-nocookie|cargo axum-idempotent|memory (moka, no session cookie)|axum|STORAGE=memory INJECT_SESSION=0"
  "idemkey-serve|idemkey|sqlite|serve|"
)

PIDS=()
stop() { # pid: TERM, up to 5 s, then KILL
  kill "$1" 2>/dev/null || return 0
  for _ in $(seq 50); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$1" 2>/dev/null
  wait "$1" 2>/dev/null
}
cleanup() { for pid in "${PIDS[@]}"; do stop "$pid"; done; }
trap cleanup EXIT
trap 'exit 130' INT TERM

# Install what is missing, in the kit's scratch directories only.
if ! command -v redis-server >/dev/null; then
  (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y redis-server) \
    >"$RUN/apt.log" 2>&1 || echo "redis-server install failed (see $RUN/apt.log)" >&2
fi
if [ ! -d "$PEERS/node/node_modules" ]; then
  (cd "$PEERS/node" && timeout 600 npm ci --no-audit --no-fund) >"$RUN/npm.log" 2>&1 \
    || echo "npm ci failed (see $RUN/npm.log)" >&2
fi
if [ ! -x "$PY/uvicorn" ] || [ ! -x "$PY/gunicorn" ]; then
  (python3 -m venv "$PEERS/python/.venv" && timeout 600 "$PY/pip" install -q \
    -r "$PEERS/python/requirements.lock.txt") >"$RUN/pip.log" 2>&1 \
    || echo "pip install failed (see $RUN/pip.log)" >&2
fi
if [ ! -x "$AXUM" ]; then
  # Built from a copy, so cargo's lock file is written in .run, not in the kit.
  rm -rf "$RUN/axum-src" && mkdir -p "$RUN/axum-src"
  cp -r "$PEERS/rust-axum-idempotent/Cargo.toml" "$PEERS/rust-axum-idempotent/src" "$RUN/axum-src/"
  cp "$PEERS/rust-axum-idempotent/Cargo.lock" "$RUN/axum-src/" 2>/dev/null
  (cd "$RUN/axum-src" && timeout 1200 cargo build --release -q \
    --target-dir "$PEERS/rust-axum-idempotent/target") >"$RUN/cargo-axum.log" 2>&1 \
    || echo "axum peer build failed (see $RUN/cargo-axum.log)" >&2
fi

version() { # kind package
  case "$1" in
    npm) node -p "require('$PEERS/node/node_modules/$2/package.json').version" 2>/dev/null ;;
    pip) "$PY/python" -c "import importlib.metadata as m; print(m.version('$2'))" 2>/dev/null ;;
    cargo) cat "$PEERS/rust-axum-idempotent/Cargo.lock" "$RUN/axum-src/Cargo.lock" 2>/dev/null \
      | sed -n "/^name = \"$2\"/{n;s/version = \"\(.*\)\"/\1/p}" | head -1 ;;
    idemkey) "$BIN" --version | awk '{print $2}' ;;
  esac
}

up() { # port pid path: true once GET path answers a 2xx, within 20 s
  for _ in $(seq 100); do
    kill -0 "$2" 2>/dev/null || return 1
    curl -sf -o /dev/null --max-time 1 "http://127.0.0.1:$1/$3" && return 0
    sleep 0.2
  done
  return 1
}

REDIS_URL=redis://127.0.0.1:$REDIS_PORT
if command -v redis-server >/dev/null; then
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$RUN" \
    >"$OUT/redis.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 50); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
fi

: >"$OUT/rows"
idx=0
for config in "${CONFIGS[@]}"; do
  IFS='|' read -r name source storage cmd envs caller <<<"$config"
  idx=$((idx + 1))
  if [ -n "${ONLY:-}" ] && ! echo ",$ONLY," | grep -q ",$name,"; then continue; fi
  port=$((PORT_BASE + idx))
  ver=$(version $source)
  base=http://127.0.0.1:$port
  if curl -s -o /dev/null --max-time 1 "$base/"; then
    echo "$name: port $port is taken, skipped" >&2
    continue
  fi
  redis-cli -p "$REDIS_PORT" flushall >/dev/null 2>&1
  check=(--body "$BODY" --effects "$base/effects" --json "$OUT/$name.json" --timeout 10s)
  [ -n "$caller" ] && check+=(--other-caller "$caller")
  url=$base/payments
  ready=effects
  dir=$PEERS
  case "$cmd" in
    uvicorn*) dir=$PEERS/python
      cmd="$PY/$cmd --host 127.0.0.1 --port $port --no-access-log --loop uvloop --http httptools --log-level warning" ;;
    gunicorn*) dir=$PEERS/python
      cmd="$PY/gunicorn -w 1 -k gthread --threads 32 --log-level warning -b 127.0.0.1:$port ${cmd#gunicorn }" ;;
    axum) cmd=$AXUM ;;
    serve) rm -f "$OUT"/serve.db*
      cmd="$BIN serve --listen 127.0.0.1:$port --database-url sqlite:$OUT/serve.db --api-key acme=tok_acme --api-key globex=tok_globex"
      url=$base/v1/payments
      ready=healthz
      check=(--body '{"amount": 100, "currency": "USD", "customer": "c1"}'
        --header 'Authorization: Bearer tok_acme' --other-caller 'Authorization: Bearer tok_globex'
        --effects "$base/v1/payments?limit=1" --json "$OUT/$name.json" --timeout 10s) ;;
  esac
  echo "== $name ($ver, $storage) on :$port" >&2
  # shellcheck disable=SC2086
  (cd "$dir" && exec env PORT="$port" HOST=127.0.0.1 EFFECT_DELAY_MS=20 REDIS_URL="$REDIS_URL" \
    $envs $cmd) >"$OUT/$name.log" 2>&1 &
  pid=$!
  PIDS+=("$pid")
  rm -f "$OUT/$name.json"
  if up "$port" "$pid" "$ready"; then
    timeout 120 "$BIN" check "$url" "${check[@]}" >"$OUT/$name.txt" 2>&1
    echo "   exit code $?" >&2
  else
    echo "   did not start (see $OUT/$name.log)" >&2
  fi
  stop "$pid"
  echo "$name|$ver|$storage" >>"$OUT/rows"
done

# One row per configuration: the verdict of each check; a configuration the checker could not
# run against gets `-` and its error below the table.
python3 - "$OUT" <<'EOF' | tee "$OUT/table.md"
import json, os, sys
out = sys.argv[1]
rows = [line.rstrip("\n").split("|") for line in open(os.path.join(out, "rows"))]
def read(name, ext):
    try:
        text = open(os.path.join(out, name + ext)).read()
        return json.loads(text) if ext == ".json" else text
    except (OSError, ValueError):
        return None
reports = {name: read(name, ".json") for name, _, _ in rows}
ids = []
for r in reports.values():
    for c in (r or {}).get("checks", []):
        if c["id"] not in ids:
            ids.append(c["id"])
print("| peer | version | storage | exit | " + " | ".join(ids) + " |")
print("|---" * (4 + len(ids)) + "|")
errors = []
for name, ver, storage in rows:
    r = reports[name]
    if r is None:
        text = (read(name, ".txt") or "").strip()
        errors.append(f"- {name}: {text.splitlines()[-1] if text else 'did not start'}")
        print(f"| {name} | {ver} | {storage} | 2 | " + " | ".join(["-"] * len(ids)) + " |")
        continue
    verdict = {c["id"]: c["verdict"] for c in r["checks"]}
    cells = ["**FAIL**" if verdict.get(i) == "fail" else verdict.get(i, "-") for i in ids]
    print(f"| {name} | {ver} | {storage} | {r['exit_code']} | " + " | ".join(cells) + " |")
if errors:
    print()
    print("\n".join(errors))
EOF
