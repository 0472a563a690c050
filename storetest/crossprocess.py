"""Across OS processes (storetest/processes.py): processes racing on one session (``in_processes``), and a
run in one process cancelled or stopped from another."""

from __future__ import annotations

import os
import queue
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent_sessions import LeaseLost, Message, Runner, Spec, Store, tool
from agent_sessions import open as open_session

from .mixin import no_orphans
from .processes import context as process_context
from .scripted import ToolsThenAnswer


def _add_or_take(store: Store, i: int, barrier: Any, sid: str, adders: int, per_adder: int, adding: Any
                 ) -> tuple[float, float, list[str]]:
    """Process i < ``adders`` adds its steers; the others take until the adders are done and nothing is left:
    when it began and ended (one clock for the host's processes), and what it took."""
    began = time.monotonic()
    taken: list[str] = []
    if i < adders:
        for j in range(per_adder):
            store.add_steer(sid, f"p{i}-{j:04d}")
        with adding.get_lock():
            adding.value -= 1
        return began, time.monotonic(), taken
    while time.monotonic() < began + 600:  # an orphan (its parent gone) does not spin forever
        finished = adding.value == 0
        batch = store.take_steers(sid)
        taken.extend(batch)
        if not batch and finished:
            break
    return began, time.monotonic(), taken


def exactly_once_across_processes(
    factory: Callable[[], Store], sid: str, *, adders: int, takers: int, per_adder: int, timeout: float = 180
) -> float:
    """Assert every steer was taken exactly once; the seconds from all being ready to the last steer taken."""
    adding = process_context(factory).Value("i", adders)
    reports = in_processes(factory, adders + takers, _add_or_take, sid, adders, per_adder, adding, timeout=timeout)
    assert_each_taken_once([taken for _, _, taken in reports[adders:]], "p", adders, per_adder)
    seconds: float = max(ended for _, ended, _ in reports) - min(began for began, _, _ in reports)
    return seconds


def _child(work: Callable[..., Any], factory: Callable[[], Any], i: int, barrier: Any, out: Any,
           args: tuple[Any, ...]) -> None:
    try:
        store = factory()
        barrier.wait(300)
        out.put(("done", i, work(store, i, barrier, *args)))
    except BaseException:  # noqa: BLE001 - reported by the parent
        out.put(("error", i, [traceback.format_exc()]))
        barrier.abort()  # the others stop waiting for this process


def in_processes(factory: Callable[[], Any], processes: int, work: Callable[..., Any], *args: Any,
                 timeout: float = 180) -> list[Any]:
    """``work(store, i, barrier, *args)`` (a module's function, for pickling) in ``processes`` processes, each
    with a store of its own, once all are ready: what each returned, by i (one that raised fails the test)."""
    ctx = process_context(factory)
    barrier, out = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(work, factory, i, barrier, out, args)) for i in range(processes)]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    try:
        for _ in range(processes):
            kind, i, detail = out.get(timeout=timeout)
            assert kind == "done", detail[0]
            done[i] = detail
    except queue.Empty:
        raise AssertionError(f"processes did not report within {timeout} s{_failures(out, procs)}") from None
    finally:
        for p in procs:
            _stop(p)
    return [done[i] for i in range(processes)]


def _failures(out: Any, procs: list[Any]) -> str:
    """Why processes never reached the barrier: the errors they reported and how the others ended."""
    errors: list[str] = []
    while True:
        try:
            kind, i, detail = out.get(timeout=1)
        except queue.Empty:
            break
        if kind == "error":
            errors.append(f"process {i}: {detail[0]}")
    codes = [p.exitcode for p in procs]
    return f"; exit codes {codes}" + "".join(f"\n{e}" for e in errors)


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


# -- a run in one process, cancelled from another -------------------------------------------


def counted(path: str, sleep: float = 0.0) -> Callable[..., str]:
    """A tool's function noting each run in the file at ``path`` (fsynced, for a parent process), then sleeping."""

    def tool(n: int = 0) -> str:
        """Count this run."""
        with open(path, "a") as f:
            f.write("ran\n")
            f.flush()
            os.fsync(f.fileno())
        time.sleep(sleep)
        return f"done {n}"

    return tool


def lines(path: Path) -> list[str]:
    """The lines a child process has appended to ``path`` so far (none before it exists)."""
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def wait_for(check: Callable[[], bool], what: str, timeout: float = 60, pause: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(pause)


def _run_until_cancelled(factory: Callable[[], Store], sid: str, workdir: str, out: Any) -> None:
    try:
        spec = Spec(session=open_session(sid, factory()), max_steps=10_000,
                    tools=[tool(name="step")(counted(str(Path(workdir) / "steps"), 0.05))])
        model = ToolsThenAnswer(["step"], rounds=10**9, log=str(Path(workdir) / "requests"))
        result = Runner().run(spec, [Message.user("work until told to stop")], model)
        out.put(("result", result.stop_reason))
    except BaseException:  # noqa: BLE001 - reported by the parent
        out.put(("error", traceback.format_exc()))


def cancel_from_another_process(factory: Callable[[], Store], sid: str, workdir: str) -> None:
    """A child runs; this process waits for its third request and cancels: the run stops within one step (at
    most one request after the cancel), its lease released, no call left without its result."""
    ctx = process_context(factory)
    out = ctx.Queue()
    child = ctx.Process(target=_run_until_cancelled, args=(factory, sid, workdir, out))
    child.start()
    requests = Path(workdir) / "requests"
    try:
        wait_for(lambda: len(lines(requests)) >= 3, "the child's third model request")
        session = open_session(sid, factory())
        holder = session.holder()
        assert holder is not None and holder.pid == child.pid, f"the lease is held by {holder}, not the child"
        assert session.cancel() is True
        at_cancel = len(lines(requests))
        kind, value = out.get(timeout=60)
        assert kind == "result", value
        child.join(30)
        assert session.holder() is None, "the cancelled run kept its lease"
        assert (value, len(lines(requests)) - at_cancel <= 1) == ("cancelled", True), (value, at_cancel)
        no_orphans(session.messages())
    finally:
        _stop(child)


def _stop(process: Any) -> None:
    process.join(timeout=5)
    if process.is_alive():
        process.kill()
        process.join(timeout=10)


# -- a run stopped with SIGSTOP past its lease, taken over, then continued ----------------------------------


def _run_then_stall(factory: Callable[[], Store], sid: str, workdir: str, out: Any) -> None:
    try:
        spec = Spec(session=open_session(sid, factory()), tools=[tool(name="step")(counted(
            str(Path(workdir) / "entered"), 1.0))], lease_ttl=1.0, max_steps=5)
        result = Runner().run(spec, [Message.user("step until stopped")], ToolsThenAnswer(["step"], rounds=3))
        out.put(("stale", f"finished: {result.stop_reason}"))
    except LeaseLost:
        out.put(("stale", "LeaseLost"))
    except BaseException:  # noqa: BLE001 - reported by the parent
        out.put(("stale", traceback.format_exc()))


def _take_over(factory: Callable[[], Store], sid: str, workdir: str, out: Any) -> None:
    try:
        session = open_session(sid, factory())
        charge = tool(name="charge", idempotent=False)(counted(str(Path(workdir) / "charges")))
        spec = Spec(session=session, tools=[charge], lease_ttl=30.0, lease_wait=30.0)
        msgs = [*session.messages(), Message.user("charge the card instead")]
        result = Runner().run(spec, msgs, ToolsThenAnswer(["charge"]))
        out.put(("newer", [m.to_json() for m in result.messages]))
    except BaseException:  # noqa: BLE001 - reported by the parent
        out.put(("newer-error", traceback.format_exc()))


def stopped_past_ttl_then_taken_over(factory: Callable[[], Store], sid: str, workdir: str) -> None:
    """A child is stopped with SIGSTOP inside a tool; once its 1 s lease has expired a second child takes the
    session over and finishes a turn; continued, the first must end with LeaseLost, having written nothing."""
    ctx = process_context(factory)
    out = ctx.Queue()
    entered = Path(workdir) / "entered"
    stale = ctx.Process(target=_run_then_stall, args=(factory, sid, workdir, out))
    stale.start()
    newer_process = None
    try:
        wait_for(lambda: len(lines(entered)) >= 1, "the first child to enter its tool")
        os.kill(stale.pid or 0, signal.SIGSTOP)
        store = factory()
        session = open_session(sid, store)
        wait_for(lambda: session.holder() is None, "the stopped child's lease to expire", timeout=60)
        newer_process = ctx.Process(target=_take_over, args=(factory, sid, workdir, out))
        newer_process.start()
        kind, value = out.get(timeout=90)
        assert kind == "newer", value
        newer = [Message.from_json(m) for m in value]
        newer_process.join(30)
        run_store: Any = store
        before = (session.messages(), run_store.journal(sid))
        os.kill(stale.pid or 0, signal.SIGCONT)
        kind, said = out.get(timeout=90)
        assert kind == "stale", said
        stale.join(30)
        after = (session.messages(), run_store.journal(sid))
        assert said == "LeaseLost", said
        assert before[0] == newer and after == before
        assert len(lines(Path(workdir) / "charges")) == 1
        no_orphans(after[0])
    finally:
        if stale.pid is not None and stale.is_alive():
            os.kill(stale.pid, signal.SIGCONT)
        _stop(stale)
        if newer_process is not None:
            _stop(newer_process)
