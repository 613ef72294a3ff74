#!/usr/bin/env python3
"""A TCP proxy that sends every new connection to the current PostgreSQL primary.

The "proxy in front" of docs/guide/operating.md ("Failover"): `idemkey serve` uses
sqlx, which cannot follow a multi-host URL with `target_session_attrs=read-write`, so
`scripts/failover.sh` points `serve` at this proxy instead. Every ~200 ms the proxy asks the
pg_auto_failover monitor which node is the primary (`pgautofailover.get_primary()`, through
`psql`), and forwards each new client connection there. When the primary changes (or the
monitor names none, during a failover) the connections it had forwarded to the old one are
closed: a client (idemkey's pool) sees a lost connection and reconnects, now to the new
primary. The production equivalent is HAProxy with a health check that only passes on the
primary (e.g. an HTTP check against `pg_autoctl`'s state, or `pg_is_in_recovery()`) and
`on-marked-down shutdown-sessions`.

Loopback only, stdlib only (asyncio). Prints one line per change of primary, with a Unix
timestamp, so the caller can tell when the proxy switched:

    pg_primary_proxy.py --listen 127.0.0.1:PORT --monitor 'postgres://...@127.0.0.1:P/pg_auto_failover'
"""

import argparse
import asyncio
import sys
import time

POLL_SECONDS = 0.2


class State:
    def __init__(self):
        self.primary = None  # (host, port) or None while the monitor names no primary
        self.connections = {}  # (host, port) -> set of client writers forwarded there


def log(message):
    print(f"{time.time():.3f} {message}", flush=True)


async def ask_monitor(monitor_url):
    """The primary's (host, port), or None (no primary, or the monitor did not answer)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            "psql", "-XAtq", "-d", monitor_url, "-c",
            "SELECT primary_host || ':' || primary_port FROM pgautofailover.get_primary()",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )
    except OSError:
        return None
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=1.0)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return None
    line = out.decode().strip()
    if proc.returncode != 0 or ":" not in line:
        return None
    host, port = line.rsplit(":", 1)
    return host, int(port)


async def follow(state, monitor_url):
    while True:
        primary = await ask_monitor(monitor_url)
        if primary != state.primary:
            old = state.primary
            state.primary = primary
            log(f"primary {format_node(old)} -> {format_node(primary)}")
            if old is not None:
                # The old node is no longer the primary: cut what went there.
                for writer in list(state.connections.get(old, ())):
                    writer.close()
        await asyncio.sleep(POLL_SECONDS)


def format_node(node):
    return "none" if node is None else f"{node[0]}:{node[1]}"


async def pipe(reader, writer):
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def handle(state, client_reader, client_writer):
    target = state.primary
    if target is None:
        client_writer.close()
        return
    try:
        upstream_reader, upstream_writer = await asyncio.wait_for(
            asyncio.open_connection(*target), timeout=2.0)
    except (OSError, asyncio.TimeoutError):
        client_writer.close()
        return
    tracked = state.connections.setdefault(target, set())
    tracked.add(client_writer)
    tracked.add(upstream_writer)
    try:
        await asyncio.gather(pipe(client_reader, upstream_writer),
                             pipe(upstream_reader, client_writer))
    finally:
        tracked.discard(client_writer)
        tracked.discard(upstream_writer)


async def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT (loopback)")
    parser.add_argument("--monitor", required=True, help="the monitor's database URL")
    args = parser.parse_args()
    host, port = args.listen.rsplit(":", 1)
    state = State()
    server = await asyncio.start_server(
        lambda r, w: handle(state, r, w), host, int(port))
    log(f"listening on {args.listen}")
    async with server:
        await asyncio.gather(server.serve_forever(), follow(state, args.monitor))


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
