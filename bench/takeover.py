"""Takeover time (issue 26): from a worker's SIGKILL in the middle of a turn (inside its model request) to
the first model request of the run that finishes the turn, made either

- ``--by sweep``: by ``agent.recover`` running every ``--interval`` seconds in a process of its own
  (``grace=0``), nobody redelivering the task; or
- ``--by redelivery``: by the task delivered again at once (Celery's ``acks_late`` with
  ``reject_on_worker_lost``, whose worker requeues a task whose pool process died): a new process calls
  ``Runner.turn`` with the same text and key and a ``lease_wait`` that outlasts ``lease_ttl`` (the
  documented recipe), which waits for the dead run's lease and continues its turn.

    python -m bench.takeover [--by sweep,redelivery] [--stores sqlite,postgres,mysql] [--kills 50]
                             [--lease-ttl 2] [--interval 1]

The killed run's lease lapses between two thirds of ``lease_ttl`` and ``lease_ttl`` after the kill (its
heartbeat renews it every third); the sweep looks within ``interval`` after that, and then takes the lease
and asks the model: so the target (issue 26's, for both ways) is ``lease_ttl + interval + 1 s``. A
redelivered task polls the lease itself (backing off to twice a second), so it needs no sweep's interval.
Kills come in batches of ``--batch`` turns at once (the sweep finishes them in one pass, one after another).
Times are this host's clock, read in the killing process and in the one that takes over.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing
import os
import signal
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import agent_sessions as agent
from agent_sessions import Message

SPEC = "takeover"


def _log(folder: str, sid: str, line: str) -> None:
    with open(Path(folder) / f"{sid}.log", "a") as f:
        f.write(line + "\n")


def _lines(folder: str, sid: str) -> list[str]:
    try:
        return (Path(folder) / f"{sid}.log").read_text().splitlines()
    except FileNotFoundError:
        return []


class Hanging:
    """The killed worker's model: says it was asked, then never answers (the parent kills it meanwhile)."""

    def __init__(self, folder: str, sid: str) -> None:
        self.folder, self.sid = folder, sid

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[agent.Tool]) -> Message:
        _log(self.folder, self.sid, f"asked {time.time()}")
        time.sleep(120)
        raise AssertionError("not killed")


class Answering:
    """The sweep's model: notes when it was asked (the takeover's end), and answers."""

    def __init__(self, folder: str, sid: str) -> None:
        self.folder, self.sid = folder, sid

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[agent.Tool]) -> Message:
        _log(self.folder, self.sid, f"taken {time.time()}")
        return Message.assistant("done")


def _turn(factory: Callable[[], agent.Store], folder: str, sid: str, ttl: float) -> None:
    spec = agent.Spec(session=agent.open(sid, factory()), name=SPEC, lease_ttl=ttl, max_steps=2)
    agent.Runner().turn(spec, "answer me", f"turn-{sid}", Hanging(folder, sid))


def _redelivered(factory: Callable[[], agent.Store], folder: str, sid: str, ttl: float) -> None:
    """The task delivered again: the same turn (text and key), waiting for the dead run's lease."""
    spec = agent.Spec(session=agent.open(sid, factory()), name=SPEC, lease_ttl=ttl, max_steps=2,
                      lease_wait=3 * ttl + 5)
    agent.Runner().turn(spec, "answer me", f"turn-{sid}", Answering(folder, sid))


def _sweep(factory: Callable[[], agent.Store], folder: str, ttl: float, interval: float, stop: str) -> None:
    store = factory()
    assert isinstance(store, agent.LifecycleStore)

    def resolve(info: agent.SessionInfo) -> tuple[agent.Spec, agent.Endpoint] | None:
        if info.spec != SPEC:
            return None
        return agent.Spec(name=SPEC, lease_ttl=ttl, max_steps=2), Answering(folder, info.id)

    while not os.path.exists(stop):
        agent.recover(store, resolve, grace=0)
        time.sleep(interval)


def _factory(name: str, tmp: str) -> Callable[[], agent.Store]:
    from tests import servers

    from . import backends

    if name == "sqlite":
        from stores import sqlite

        path = str(Path(tmp) / f"takeover-{uuid.uuid4().hex[:8]}.db")
        sqlite.open(path).close()
        return functools.partial(sqlite.open, path)
    backends.engine(name).dispose()  # fresh tables in the benchmark's database
    if name == "postgres":
        return functools.partial(servers.postgres_store, backends.sql_url(name))
    if name == "mysql":
        return functools.partial(servers.mysql_store, backends.sql_url(name))
    raise SystemExit(f"takeover: {name!r} is not measured (sqlite, postgres, mysql)")


def _wait(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"takeover: timed out waiting for {what}")
        time.sleep(0.002)


def measure(name: str, kills: int, ttl: float, interval: float, batch: int, by: str = "sweep") -> dict[str, Any]:
    ctx = multiprocessing.get_context("forkserver")
    with tempfile.TemporaryDirectory() as tmp:
        factory = _factory(name, tmp)
        stop = str(Path(tmp) / "stop")
        sweeper = ctx.Process(target=_sweep, args=(factory, tmp, ttl, interval, stop))
        if by == "sweep":
            sweeper.start()
        redelivered: list[multiprocessing.process.BaseProcess] = []
        seconds: list[float] = []
        try:
            while len(seconds) < kills:
                sids = [f"takeover-{uuid.uuid4().hex[:10]}" for _ in range(min(batch, kills - len(seconds)))]
                children = {sid: ctx.Process(target=_turn, args=(factory, tmp, sid, ttl)) for sid in sids}
                for child in children.values():
                    child.start()
                killed: dict[str, float] = {}
                for sid, child in children.items():
                    _wait(lambda s=sid: any(x.startswith("asked") for x in _lines(tmp, s)), f"{sid}'s request")
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child.pid or 0, signal.SIGKILL)
                    killed[sid] = time.time()
                    if by == "redelivery":
                        again = ctx.Process(target=_redelivered, args=(factory, tmp, sid, ttl))
                        again.start()
                        redelivered.append(again)
                for child in children.values():
                    child.join(30)
                for sid, at in killed.items():
                    _wait(lambda s=sid: any(x.startswith("taken") for x in _lines(tmp, s)), f"the {by} to take {sid}")
                    taken = float(next(x for x in _lines(tmp, sid) if x.startswith("taken")).split()[1])
                    seconds.append(taken - at)
        finally:
            Path(stop).touch()
            for process in [*redelivered, *([sweeper] if by == "sweep" else [])]:
                process.join(60)
                if process.is_alive():
                    process.kill()
    ordered = sorted(seconds)
    return {"by": by, "kills": len(ordered), "lease_ttl": ttl, "interval": interval if by == "sweep" else None,
            "p50": statistics.median(ordered), "p99": ordered[min(len(ordered) - 1, round(len(ordered) * 0.99))],
            "max": ordered[-1], "min": ordered[0], "target": ttl + interval + 1.0}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.takeover", description=__doc__.split("\n\n")[0])
    parser.add_argument("--by", default="sweep,redelivery", help="sweep, redelivery, or both (comma-separated)")
    parser.add_argument("--stores", default="sqlite,postgres,mysql")
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--lease-ttl", type=float, default=2.0)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    report: dict[str, dict[str, Any]] = {}
    print("| store | taken over by | kills | lease_ttl | sweep interval | p50 | p99 | max "
          "| target (ttl + interval + 1 s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in [s for s in args.stores.split(",") if s]:
        for by in [b for b in args.by.split(",") if b]:
            if by not in ("sweep", "redelivery"):
                raise SystemExit(f"takeover: --by {by!r}: sweep or redelivery")
            r = report.setdefault(name, {})[by] = measure(name, args.kills, args.lease_ttl, args.interval,
                                                          args.batch, by)
            every = "-" if r["interval"] is None else f"{r['interval']:g} s"
            print(f"| {name} | {by} | {r['kills']} | {r['lease_ttl']:g} s | {every} | {r['p50']:.2f} s | "
                  f"{r['p99']:.2f} s | {r['max']:.2f} s | {r['target']:g} s |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
