"""The event log (issue #20): what publishing costs a run, and how soon a follower elsewhere sees an event.

- ``loop``: a loop step (the model and the tool answer at once, as in ``ours.loop_step``) with
  ``Spec(publish_events=True)`` beside the same step without it, runs interleaved one by one so both see
  the same load; the ratio is the cost of the log. Target: within 1.25x on SQLite and PostgreSQL.
- ``latency``: a writer process appends one event at a time (fenced, as a run does), stamping its
  ``time.time()`` in the event; a follower in another process (``session.follow``) notes when each
  arrives. Same machine, same clock. Target: median under 50 ms on PostgreSQL (LISTEN/NOTIFY), under
  250 ms on the stores that poll.
"""

from __future__ import annotations

import itertools
import multiprocessing
import random
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import agent_sessions as agent
from agent_sessions import contract, eventlog

from . import backends
from .ours import InstantModel, StepClock, grep
from .workload import summary, transcript

LOOP_N = 100
STEPS_PER_RUN = 11
LATENCY_EVENTS = 100
LATENCY_GAP = 0.02
"""Seconds between the writer's events: a follower that caught up waits for each, as a browser does."""


def loop_cost(store: agent.Store, rounds: int) -> dict[str, Any]:
    """Runs with the log off and on in pairs, each pair in a random order, so neither always follows the
    other (the one after a run meets the caches and the database as that run left them)."""
    samples: dict[bool, list[float]] = {False: [], True: []}
    while any(len(steps) < rounds for steps in samples.values()):
        for publish in random.sample([False, True], 2):
            samples[publish].extend(_run(store, publish=publish))
    return {"loop": summary(samples[False][:rounds]), "loop_published": summary(samples[True][:rounds])}


def _run(store: agent.Store, publish: bool) -> list[float]:
    steps = StepClock()
    session = agent.open(f"bench-events-{uuid.uuid4().hex}", store)
    msgs = transcript(LOOP_N)
    session.save(msgs)
    spec = agent.Spec(session=session, tools=[grep], max_steps=STEPS_PER_RUN, publish_events=publish)
    agent.Runner().run(spec, msgs, InstantModel(grep.name), steps)
    return [(b - a) * 1000 for a, b in itertools.pairwise(steps.starts)]


def _writer(factory: Callable[[], agent.Store], sid: str, ready: Any, go: Any, n: int, gap: float) -> None:
    store = factory()
    assert isinstance(store, contract.EventStore)
    holder = store.acquire(sid, agent.Holder("bench", 1, uuid.uuid4().hex, 0.0), 60.0)
    ready.set()
    go.wait(60)
    for i in range(n):
        store.append_events(sid, holder, [eventlog.encode("bench", {"i": i, "t": time.time()})], keep=10_000)
        time.sleep(gap)
    store.release(sid, holder)


def _follower(factory: Callable[[], agent.Store], sid: str, ready: Any, n: int, out: Any) -> None:
    session = agent.open(sid, factory())
    ready.set()
    delays: list[float] = []
    for event in session.follow(after=0, timeout=60 + n * LATENCY_GAP * 4):
        delays.append((time.time() - float(event.data["t"])) * 1000)
        if len(delays) == n:
            break
    out.put(delays)


def latency(factory: Callable[[], agent.Store], n: int = LATENCY_EVENTS) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    sid = f"bench-follow-{uuid.uuid4().hex}"
    out = ctx.Queue()
    writer_ready, follower_ready, go = ctx.Event(), ctx.Event(), ctx.Event()
    follower = ctx.Process(target=_follower, args=(factory, sid, follower_ready, n, out))
    writer = ctx.Process(target=_writer, args=(factory, sid, writer_ready, go, n, LATENCY_GAP))
    follower.start()
    writer.start()
    try:
        assert writer_ready.wait(60) and follower_ready.wait(60), "the writer or the follower did not start"
        time.sleep(0.5)  # the follower is in its first wait
        go.set()
        delays: list[float] = out.get(timeout=120)
    finally:
        for p in (writer, follower):
            p.join(30)
            if p.is_alive():
                p.kill()
    return {"events": len(delays), **summary(delays), "max_ms": max(delays), "mean_ms": statistics.fmean(delays)}


def run(names: list[str], tmp: str, rounds: int) -> dict[str, Any]:
    report: dict[str, Any] = {"loop": {}, "latency": {}}
    for name in names:
        store = backends.open_store(name, tmp)
        if not isinstance(store, contract.EventStore):
            print(f"... events: {name} keeps no event log; skipped", flush=True)
            continue
        print(f"... events: {name}", flush=True)
        report["loop"][name] = loop_cost(store, rounds)
        factory = backends.store_factory(name, tmp)
        if factory is not None:
            report["latency"][name] = latency(factory)
    return report


def tables(report: dict[str, Any]) -> str:
    lines = ["Event log: a loop step with publish_events=True beside the same step without, interleaved "
             f"(N={LOOP_N}); median (p99) ms", "", "| | off | on | on / off |", "|---|---|---|---|"]
    for name, row in report["loop"].items():
        off, on = row["loop"], row["loop_published"]
        lines.append(f"| {name} | {off['median_ms']:.3f} ({off['p99_ms']:.2f}) | {on['median_ms']:.3f} "
                     f"({on['p99_ms']:.2f}) | {on['median_ms'] / off['median_ms']:.2f}x |")
    lines += ["", f"Event log: from an event's write to a follower in another process ({LATENCY_EVENTS} events, "
              f"one every {LATENCY_GAP * 1000:.0f} ms), ms", "", "| | median | p99 | max |", "|---|---|---|---|"]
    for name, row in report["latency"].items():
        lines.append(f"| {name} | {row['median_ms']:.1f} | {row['p99_ms']:.1f} | {row['max_ms']:.1f} |")
    return "\n".join(lines)
