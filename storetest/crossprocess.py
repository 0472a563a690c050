"""Exactly-once across OS processes: separate interpreters (spawned, never forked, so no connection is
shared) adding and taking steers on one session at once."""

from __future__ import annotations

import multiprocessing
import queue
import traceback
from collections.abc import Callable
from typing import Any

from agent_sessions import Store


def _adder(factory: Callable[[], Store], sid: str, i: int, n: int, barrier: Any, out: Any) -> None:
    try:
        store = factory()
        barrier.wait()
        for j in range(n):
            store.add_steer(sid, f"p{i}-{j:04d}")
        out.put(("added", i, []))
    except BaseException:  # noqa: BLE001 - reported by the parent
        out.put(("error", i, [traceback.format_exc()]))


def _taker(factory: Callable[[], Store], sid: str, i: int, barrier: Any, adders_done: Any, out: Any) -> None:
    try:
        store = factory()
        barrier.wait()
        taken: list[str] = []
        while True:
            finished = adders_done.is_set()
            batch = store.take_steers(sid)
            taken.extend(batch)
            if not batch and finished:
                break
        out.put(("taken", i, taken))
    except BaseException:  # noqa: BLE001 - reported by the parent
        out.put(("error", i, [traceback.format_exc()]))


def exactly_once_across_processes(
    factory: Callable[[], Store], sid: str, *, adders: int, takers: int, per_adder: int, timeout: float = 180
) -> list[list[str]]:
    """Run the processes, assert every steer was taken exactly once, return what each taker took."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(adders + takers)
    adders_done = ctx.Event()
    out = ctx.Queue()
    add_procs = [ctx.Process(target=_adder, args=(factory, sid, i, per_adder, barrier, out)) for i in range(adders)]
    take_procs = [
        ctx.Process(target=_taker, args=(factory, sid, i, barrier, adders_done, out)) for i in range(takers)
    ]
    for p in add_procs + take_procs:
        p.start()
    reports: list[tuple[str, int, list[str]]] = []
    try:
        while len([r for r in reports if r[0] != "taken"]) < adders:
            reports.append(out.get(timeout=timeout))
            assert reports[-1][0] != "error", reports[-1][2][0]
        adders_done.set()
        while len(reports) < adders + takers:
            reports.append(out.get(timeout=timeout))
            assert reports[-1][0] != "error", reports[-1][2][0]
    except queue.Empty:
        raise AssertionError(f"processes did not report within {timeout} s") from None
    finally:
        for p in add_procs + take_procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    taken = [r[2] for r in reports if r[0] == "taken"]
    assert_each_taken_once(taken, "p", adders, per_adder)
    return taken


def assert_each_taken_once(taken: list[list[str]], prefix: str, senders: int, per_sender: int) -> None:
    """``taken`` holds, per taker, everything it took in order; sender i added f"{prefix}{i}-{j:04d}"
    for j in order. Every steer was taken once, and no taker saw one sender's steers out of order."""
    everything = [s for t in taken for s in t]
    assert len(everything) == len(set(everything)), "a steer was handed over twice"
    assert set(everything) == {f"{prefix}{i}-{j:04d}" for i in range(senders) for j in range(per_sender)}
    for t in taken:
        for i in range(senders):
            mine = [s for s in t if s.startswith(f"{prefix}{i}-")]
            assert mine == sorted(mine), f"a taker received one sender's steers out of order: {mine}"
