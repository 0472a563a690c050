"""A ``delete(force=True)`` of a session that has no row yet, beside a run that makes the session (acquire,
then its first save) while the delete's transaction is between its statements: the fault proxy holds the
delete's statement after its row lock. On PostgreSQL ``FOR UPDATE`` of a missing row locks nothing, and a
later statement of the delete sees the run's commit: the delete once removed the run's new row but kept its
messages, so the session read as empty while its compare-and-swap counted a message stored (every later run
failed with TranscriptConflict; found by the model test, seed 3494613216). Either order must leave one
whole session. The delete is now one statement (a call of ``agent_sessions_write``: PostgreSQL's function,
MySQL's procedure), so there is no between: held before the server has it, it lands after the run, and
removes the whole session, which the next run begins again."""

from __future__ import annotations

import threading
import uuid

from sqlalchemy import Engine, create_engine, make_url

import agent_sessions as agent
from agent_sessions.lease import Lease
from stores import mysql, postgres

from .proxy import FaultProxy, Rule, pg_write

DATABASE = "faultdelete"
"""This module's database (conftest.py's ``database`` fixture)."""


def _store(database: tuple[str, str, Engine], port: int | None = None) -> agent.RunStore:
    url = make_url(database[1])
    engine = create_engine(url if port is None else url.set(port=port), pool_size=2)
    return (postgres.Store if database[0] == "postgres" else mysql.Store)(engine)


def test_a_run_that_makes_the_session_during_its_delete_keeps_it_whole(
    database: tuple[str, str, Engine], proxy: FaultProxy
) -> None:
    sid = f"delnew-{uuid.uuid4().hex[:12]}"
    deleting, running = _store(database, proxy.port), _store(database)
    try:
        deleting.add_steer(sid, "before the delete")  # a row-less session holds only waiting steers
        held = proxy.arm(Rule("delay", pg_write("delete"), seconds=2.0))
        outcome: list[object] = []

        def delete() -> None:
            try:
                outcome.append(deleting.delete(sid, force=True))
            except BaseException as exc:  # noqa: BLE001 - recorded for the test
                outcome.append(exc)

        worker = threading.Thread(target=delete, daemon=True)
        worker.start()
        while not held.fired and worker.is_alive():
            worker.join(0.01)
        assert held.fired, proxy.statements
        # Inside the delete's transaction, after its row lock: the run makes the session and saves.
        with Lease(running, sid, ttl=30, wait=5) as lease:
            running.save_fenced(sid, lease.holder, [agent.Message.user("the run's question")], take_steers=False)
        worker.join(15)
        assert not worker.is_alive()
        assert outcome == [True]  # it deleted the waiting steer, and then the run's session
        kept: list[str] = []  # the delete, one statement held before the server had it, landed after the run

        fresh = _store(database)
        try:
            stored = fresh.messages(sid)
            assert [m.text for m in stored] == kept
            with Lease(fresh, sid, ttl=30, wait=5) as lease:  # the next run extends what it read
                fresh.save_fenced(sid, lease.holder, [*stored, agent.Message.assistant("an answer")],
                                  take_steers=True)
            assert [m.text for m in fresh.messages(sid)] == [*kept, "an answer"]
            assert fresh.take_steers(sid) == []
        finally:
            fresh.engine.dispose()  # type: ignore[attr-defined]
    finally:
        for store in (deleting, running):
            getattr(store, "close", store.engine.dispose)()  # type: ignore[attr-defined]
