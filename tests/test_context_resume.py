"""Resuming a long compacted session reads only its end (issue 27): ``session.messages(recent=True)`` reads,
from the end, the messages from the newest compaction record's range on (``context.read_recent``, a
``Tail``), and a run given them goes on as with the whole transcript: its saves append after the stored
messages it was not given, its indexes stay the stored ones, and whatever reads the session whole
(``session.messages()``, fork) still sees every message. On every store."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import agent_sessions as agent
from agent_sessions.context import FIRST_PAGE, Compaction, is_record, read_recent
from agent_sessions.journal import TAIL
from agent_sessions.testing.model_server import ModelServer as Served
from agent_sessions.testing.model_server import request_tokens
from stores import memory, mongodb
from tests import servers
from tests.model_server import Reply, Request, openai, windowed
from tests.test_context import answering, endpoint, is_summary_request, kilobyte, long_answer, store_on, summarising

STORES = ["memory", "sqlite", "postgres", "mysql", "mongodb"]


@contextmanager
def any_store(kind: str, tmp_path: Path) -> Iterator[agent.RunStore]:
    if kind == "memory":
        yield memory.Store()
        return
    if kind == "mongodb":
        import pymongo

        client: Any = pymongo.MongoClient(servers.MONGO_URL)
        db = client[servers.database_name("context_resume")]
        for collection in mongodb.COLLECTIONS:
            db.drop_collection(collection)
        mongodb.create_indexes(db)
        try:
            yield mongodb.Store(db)
        finally:
            client.close()
        return
    with store_on(kind, tmp_path) as store:
        yield store


def record(text: str, start: int, end: int) -> agent.Message:
    return agent.Message(agent.Role.USER, [agent.Content.compaction(text, start, end)])


def exchange(n: int) -> list[agent.Message]:
    return [agent.Message.user(f"question {n}"), agent.Message.assistant(f"answer {n}")]


def long_transcript(length: int, records: list[tuple[int, int]]) -> list[agent.Message]:
    """``length`` messages of exchanges, with a record standing at each ``at`` of ``records`` ((at, end)
    pairs, in order; ``end`` a question's index), covering from the previous one's end."""
    msgs: list[agent.Message] = []
    start, n = 0, 0
    for at, end in records:
        while len(msgs) < at:
            msgs.extend(exchange(n))
            n += 1
        assert len(msgs) == at and msgs[end].text.startswith("question")
        msgs.append(record(f"summary up to {end}", start, end))
        start = end
    while len(msgs) < length:
        msgs.extend(exchange(n))
        n += 1
    return msgs[:length]


class Counting:
    """A TailStore's ``read_back`` and ``messages``, counted: what a resume read."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.rows = 0
        self.whole = 0

    def read_back(self, session: str, stop: int | None, count: int) -> tuple[int, list[agent.Message]]:
        first, msgs = self.store.read_back(session, stop, count)
        self.rows += len(msgs)
        return first, msgs

    def messages(self, session: str) -> list[agent.Message]:
        self.whole += 1
        return list(self.store.messages(session))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


@pytest.mark.parametrize("kind", STORES)
def test_the_recent_read_starts_at_the_newest_records_range_and_reads_little(kind: str, tmp_path: Path) -> None:
    length = 3000
    newest_end = 2701
    stored = long_transcript(length, [(1000, 900), (2801, newest_end)])
    with any_store(kind, tmp_path) as store:
        assert isinstance(store, agent.TailStore)
        sid = f"resume-{uuid.uuid4().hex}"
        store.save(sid, stored)
        counting = Counting(store)
        recent = read_recent(counting, sid)  # type: ignore[arg-type]
        assert isinstance(recent, agent.Tail) and recent.start == newest_end - TAIL
        assert list(recent) == stored[recent.start:]
        assert counting.whole == 0 and counting.rows <= length - newest_end + FIRST_PAGE * 4
        assert agent.open(sid, store).messages(recent=True) == recent
        # a session with no record is read whole; a store without read_back reads with messages()
        plain = f"plain-{uuid.uuid4().hex}"
        store.save(plain, stored[:900])
        assert agent.open(plain, store).messages(recent=True) == stored[:900]
        assert read_recent(store, "never-saved") == []


@pytest.mark.parametrize("kind", STORES)
def test_read_back_pages_from_the_end(kind: str, tmp_path: Path) -> None:
    stored = long_transcript(100, [])
    with any_store(kind, tmp_path) as store:
        assert isinstance(store, agent.TailStore)
        store.save("paged", stored)
        assert store.read_back("paged", None, 30) == (70, stored[70:])
        assert store.read_back("paged", 70, 30) == (40, stored[40:70])
        assert store.read_back("paged", 10, 30) == (0, stored[:10])
        assert store.read_back("paged", 0, 30) == (0, [])
        assert store.read_back("paged", 500, 3) == (97, stored[97:])
        assert store.read_back("nobody", None, 5) == (0, [])
        with pytest.raises(agent.ArgumentError):
            store.read_back("paged", None, 0)
        with pytest.raises(agent.ArgumentError):
            store.read_back("paged", -1, 3)


def summarised_session(kind: str, store: agent.RunStore, server: Served, turns: int) -> agent.StoreSession:
    session = agent.open(f"long-{uuid.uuid4().hex}", store)
    spec = agent.Spec(session=session, system="You answer.", context=Compaction(4000))
    for n in range(turns):
        result = agent.Runner().run(spec, session.messages(recent=True) + [agent.Message.user(kilobyte(n))],
                                    endpoint(server.url, "openai"))
        assert result.stop_reason == "answered"
    return session


@pytest.mark.parametrize("kind", STORES)
def test_runs_resumed_from_the_recent_read_lose_nothing(kind: str, tmp_path: Path) -> None:
    """Every turn a run given only the end of the transcript: the store holds every message in order,
    the records' ranges are the stored indexes, contiguous, each before the record, and no request passed
    the window."""
    window = 4000
    server = Served(windowed(answering(summarising(long_answer)), window))
    try:
        with any_store(kind, tmp_path) as store:
            turns = 40
            session = summarised_session(kind, store, server, turns)
            stored = session.messages()
            records = [(i, m.content[0]) for i, m in enumerate(stored) if is_record(m)]
            said = [m for m in stored if not is_record(m)]
            assert len(records) >= 3 and len(said) == 2 * turns
            assert [m.text for m in said[::2]] == [kilobyte(n) for n in range(turns)]
            assert records[0][1].start == 0
            assert all(a.end == b.start for (_, a), (_, b) in zip(records, records[1:], strict=False))
            assert all(c.end <= at for at, c in records)
            assert max(request_tokens(r.json) for r in server.requests) <= window
            assert any(is_summary_request(r) for r in server.requests)
            recent = session.messages(recent=True)
            assert isinstance(recent, agent.Tail) and 0 < recent.start == records[-1][1].end - TAIL
    finally:
        server.close()
