"""Runs SIGKILLed at random points (mid-save, mid-tool, mid-request), resumed by another process: the
stored transcript is always one the run could have saved, and every steer arrives exactly once."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import agent_sessions as agent
from storetest.crossprocess import lines, wait_for

from . import check, children, figures
from .backends import Backend

KILLS = int(os.environ.get("AGENT_SESSIONS_KILLS", "50"))
STEPS = 8
EVENTS_PER_STEP = 5  # saving, requesting, answered, in a tool, after a tool
LEASE_TTL = 0.1  # how long a killed child's lease blocks the resume


def _reached(log: Path, events: int, child: Any) -> bool:
    return len(lines(log)) >= events or not child.is_alive()


def _ended(process: Any, timeout: float) -> int | None:
    """Join ``process`` for at most ``timeout`` seconds; kill it if it is still running then (it is not a
    daemon: left running, it would keep the suite from exiting). Its exit code, None if it was killed."""
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join(30)  # SIGKILL cannot be refused: this only reaps it
        return None
    return int(process.exitcode)


def test_runs_killed_at_random_points_resume_from_a_valid_prefix_and_lose_no_steer(
    backend: Backend, processes: Any, tmp_path: Path
) -> None:
    rng = random.Random(f"crash-{backend.name}")
    store = backend.factory()
    where: Counter[str] = Counter()
    sent_total = delivered = cycle = 0
    while cycle - where["finished"] < KILLS:  # a run that finished before its kill does not count
        cycle += 1
        sid = f"crash-{cycle}-{uuid.uuid4().hex[:8]}"
        session = agent.open(sid, store)
        sent = [f"before-{cycle}-a", f"before-{cycle}-b"]
        for text in sent:
            session.steer(text)
        log = tmp_path / f"phases-{cycle}"
        args = (backend.factory, sid, str(log), STEPS, LEASE_TTL)
        child = processes.Process(target=children.run_steps, args=args)
        child.start()
        # Kill after a random number of the run's events, a random moment into whatever comes next.
        target = rng.randint(1, STEPS * EVENTS_PER_STEP)
        wait_for(functools.partial(_reached, log, target, child), "the child's run", pause=0.002)
        text = f"during-{cycle}"
        session.steer(text)
        sent.append(text)
        with contextlib.suppress(ProcessLookupError):  # it may have finished (and been reaped) first
            os.kill(child.pid, signal.SIGKILL)
        _ended(child, 30)  # SIGKILLed (or finished) already: this only reaps it
        seen = lines(log)
        where[seen[-1] if seen else "starting"] += 1
        check.run_transcript(session.messages(), STEPS, sent, complete=False)  # never half a save

        resumer = processes.Process(target=children.run_steps, args=args)
        resumer.start()
        code = _ended(resumer, 120)
        assert code == 0, f"the resuming process failed (exit code {code}; None: still running after 120 s)"
        delivered += len(check.run_transcript(session.messages(), STEPS, sent, complete=True))
        assert store.take_steers(sid) == []
        sent_total += len(sent)
    assert delivered == sent_total
    killed = {k: v for k, v in where.items() if k != "finished"}
    figures.record("crash and resume", backend.name, runs_killed=sum(killed.values()), killed_while=killed,
                   finished_before_the_kill=where["finished"], resumes=cycle, steers_sent=sent_total,
                   steers_delivered=delivered)
