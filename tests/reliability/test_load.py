"""16 processes leave 200 steers each on one session while a run drains them: every steer reaches the
transcript exactly once, each sender's in the order it sent them."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from typing import Any

import agent_sessions as agent
from storetest.crossprocess import assert_each_taken_once

from . import children, figures
from .backends import Backend

SENDERS = int(os.environ.get("AGENT_SESSIONS_LOAD_SENDERS", "16"))
PER_SENDER = int(os.environ.get("AGENT_SESSIONS_LOAD_STEERS", "200"))


def test_sixteen_processes_steer_one_running_session(backend: Backend, processes: Any) -> None:
    store = backend.factory()
    sid = f"load-{uuid.uuid4().hex[:12]}"
    session = agent.open(sid, store)
    expected = SENDERS * PER_SENDER
    barrier = processes.Barrier(SENDERS + 1)
    senders = [processes.Process(target=children.add_steers, args=(backend.factory, sid, i, PER_SENDER, barrier))
               for i in range(SENDERS)]
    for p in senders:
        p.start()
    spec = agent.Spec(session=session, tools=[children.work_tool(0.002)], max_steps=1_000_000)
    run = agent.Runner().start(spec, [agent.Message.user(children.QUESTION)], children.UntilSteers(expected))
    try:
        barrier.wait(children.BARRIER_TIMEOUT)
        started = time.monotonic()
        deadline = started + 300
        for p in senders:
            p.join(max(0.0, deadline - time.monotonic()))
            assert p.exitcode == 0, f"a sending process failed (exit code {p.exitcode}; None: still running)"
        sent_in = time.monotonic() - started
        result = run.wait(300)
        drained_in = time.monotonic() - started
    finally:
        # On a failure, nothing else would end these: the run waits for steers that will never come (and
        # its thread is not a daemon), the senders for a barrier. Left running, they keep pytest from exiting.
        if not run.done():
            run.cancel()
            with contextlib.suppress(Exception):
                run.wait(60)
        for p in senders:
            if p.is_alive():
                p.kill()
                p.join(30)
    steers = [m.text for m in result.messages[1:] if m.role is agent.Role.USER and m.text]
    assert_each_taken_once([steers], "p", SENDERS, PER_SENDER)  # once each, each sender's in order
    assert store.messages(sid) == result.messages
    assert store.take_steers(sid) == []
    figures.record("load", backend.name, senders=SENDERS, steers_sent=expected, steers_delivered=len(steers),
                   model_requests=result.steps, sent_in_s=round(sent_in, 2), drained_in_s=round(drained_in, 2))
