"""The operator's console at scale: how long its pages take, over HTTP, from `runserver` on PostgreSQL, with
100,000 sessions in the store and one session of 100,000 messages (with compaction records, and an event
log of 10,000 events), beside a session of 20 messages.

    eval "$(scripts/servers start)"      # or any PostgreSQL the tests would use (AGENT_SESSIONS_POSTGRES_URL)
    .venv/bin/python -m bench.console [--rounds 20]

Prints a table (median, p99 and slowest, in ms) and asserts nothing: the console's pages read a page of the
store's indexed listing and a page of a transcript from its end, so the figures should not grow with the
store or the transcript. The database (``<prefix>_bench_life``) is dropped afterwards.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import agent_sessions as agent
from agent_sessions import eventlog

from .context import compacted
from .reading import Lifecycle
from .workload import summary

SESSIONS = 100_000
LONG = 100_000
EVENTS = 10_000
CHUNK = 5_000
ROOT = Path(__file__).resolve().parents[1]


def fill(life: Lifecycle) -> None:
    """100,000 sessions (two messages and metadata each, written straight into the tables), then a session
    of 100,000 messages and one of 20 (through the store), the long one with an event log."""
    now = time.time()
    started = time.perf_counter()
    life.load(0, SESSIONS, now - SESSIONS - 60, 1.0)
    life.check(SESSIONS)
    store = life.store
    msgs = compacted(LONG)
    for end in range(CHUNK, LONG + CHUNK, CHUNK):
        store.save("bench-long", msgs[:end])
    store.save("bench-short", compacted(20))
    holder = store.acquire("bench-long", agent.Holder("bench", os.getpid(), "bench-token-" + "0" * 20, 0.0), 60)
    for first in range(0, EVENTS, 1000):
        store.append_events("bench-long", holder, [eventlog.encode("text", {"step": 1, "text": f"piece {i}"})
                                                   for i in range(first, first + 1000)], keep=EVENTS)
    store.release("bench-long", holder)
    print(f"loaded {SESSIONS:,} sessions, a session of {LONG:,} messages and {EVENTS:,} events in "
          f"{time.perf_counter() - started:.0f} s", flush=True)


def timed(client: Any, url: str, rounds: int, expect: str) -> dict[str, float]:
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        response = client.get(url, timeout=60)
        samples.append((time.perf_counter() - started) * 1000)
        if response.status_code != 200 or expect not in response.text:
            raise SystemExit(f"GET {url}: {response.status_code}, without {expect!r}")
    return summary(samples) | {"max_ms": max(samples)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.console", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="requests of each page (default 20)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.test_console import MAKE_USERS, PASSWORD, logged_in, manage, serve, stop

    with tempfile.TemporaryDirectory() as tmp:
        life = Lifecycle("postgres", tmp)
        try:
            assert life.admin_url is not None
            env = {**os.environ, "CONSOLE_DB_URL": life.admin_url.replace("postgresql+psycopg", "postgresql"),
                   "CONSOLE_STATE": tmp, "AGENT_MODEL_URL": "http://127.0.0.1:9/v1", "PYTHONPATH": str(ROOT)}
            env.pop("DJANGO_SETTINGS_MODULE", None)
            manage(env, "migrate", "--noinput")
            manage(env, "shell", "-c", MAKE_USERS.format(users={"bench": None}, password=PASSWORD))
            fill(life)
            server, base = serve(env, Path(tmp) / "runserver.log")
            try:
                site: Any = type("Site", (), {"url": lambda self, path: base + path})()
                client = logged_in(site, "bench")
                sessions = "/admin/agent_sessions/session/"
                rows = {
                    f"list, first page ({SESSIONS:,} sessions)": (sessions, "s-0099999"),
                    "list, a metadata search (user=u-500)": (sessions + "?q=user%3Du-500", "s-0050099"),
                    "list, stranded": (sessions + "?state=stranded", "console-sessions"),
                    f"list, a state no store indexes (reads {500} sessions)": (sessions + "?state=waiting",
                                                                                "sessions read for this page"),
                    f"session of {LONG:,} messages, newest page": (sessions + "bench-long/change/", "#100000"),
                    f"session of {LONG:,} messages, a page half-way": (sessions + "bench-long/change/?before=50000",
                                                                      "#50000"),
                    "session of 20 messages": (sessions + "bench-short/change/", "#20"),
                }
                report = {name: timed(client, base + url, args.rounds, expect) for name, (url, expect) in rows.items()}
            finally:
                stop(server)
        finally:
            life.close()
    width = max(len(name) for name in report)
    print(f"\nThe console's pages over HTTP (runserver, PostgreSQL), {args.rounds} requests each, ms:\n")
    print(f"| {'page':<{width}} | median | p99 | slowest |\n|{'-' * (width + 2)}|---|---|---|")
    for name, s in report.items():
        print(f"| {name:<{width}} | {s['median_ms']:.1f} | {s['p99_ms']:.1f} | {s['max_ms']:.1f} |")


if __name__ == "__main__":
    main()
