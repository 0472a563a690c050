"""Resuming a long compacted session reads only its end (issue 27): ``session.messages(recent=True)`` reads,
from the end, the messages from the newest compaction record's range on (``context.read_recent``, a
``Tail``), and a run given them goes on as with the whole transcript: its saves append after the stored
messages it was not given, its indexes stay the stored ones, and whatever reads the session whole
(``session.messages()``, fork) still sees every message. On every store."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine

import agent_sessions as agent
from agent_sessions.context import FIRST_PAGE, Compaction, is_record, read_recent
from agent_sessions.journal import TAIL
from agent_sessions.testing.model_server import ModelServer as Served
from agent_sessions.testing.model_server import request_tokens
from stores import memory, mongodb
from storetest.crossprocess import wait_for
from storetest.stalls import Stalled
from tests import servers
from tests.context_children import digest, store_at
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
def test_a_record_far_back_is_found_by_pages_growing_from_the_end(kind: str, tmp_path: Path) -> None:
    stored = long_transcript(3000, [(1000, 900)])
    with any_store(kind, tmp_path) as store:
        store.save("far", stored)
        counting = Counting(store)
        recent = read_recent(counting, "far")  # type: ignore[arg-type]
        assert isinstance(recent, agent.Tail) and recent.start == 900 - TAIL
        assert list(recent) == stored[recent.start:] and counting.whole == 0
        assert counting.rows < 3000 - recent.start + FIRST_PAGE * 4


def test_the_recent_read_never_starts_at_a_tool_result() -> None:
    """Two messages before the range end is a tool result: the Tail starts at its call."""
    store = memory.Store()
    call = agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("c1", "look", "{}")])
    result = agent.Message(agent.Role.USER, [agent.Content.tool_result("c1", "seen")])
    said = [agent.Message.user("look"), call, result, agent.Message.assistant("done"), agent.Message.user("next"),
            agent.Message.assistant("ok")]
    store.save("tools", [*said, record("looked", 0, 4)])
    recent = read_recent(store, "tools")
    assert isinstance(recent, agent.Tail) and recent.start == 1 and recent[0] == call


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
        msgs = session.messages(recent=True)
        msgs.append(agent.Message.user(kilobyte(n)))
        result = agent.Runner().run(spec, msgs, endpoint(server.url, "openai"))
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
            assert all(a.end == b.start for (_, a), (_, b) in pairwise(records))
            assert all(c.end <= at for at, c in records)
            assert max(request_tokens(r.json) for r in server.requests) <= window
            assert any(is_summary_request(r) for r in server.requests)
            recent = session.messages(recent=True)
            assert isinstance(recent, agent.Tail) and 0 < recent.start == records[-1][1].end - TAIL
    finally:
        server.close()


@agent.tool(needs_approval=True)
def refund(order: str) -> str:
    """Refund an order."""
    return f"refunded {order}"


def refunding(request: Request) -> Reply:
    """Calls ``refund`` when the last message asks for one; answers once the result is in."""
    said = request.json["messages"]
    since = said[max((i for i, m in enumerate(said) if m["role"] == "assistant"), default=0):]
    if any(m["role"] == "tool" for m in since):  # the results, and the steers after them
        return openai("answer: refunded")
    if "refund" in str(said[-1].get("content", "")):
        return openai(calls=[("c1", "refund", '{"order": "1182"}')])
    return openai("answer: noted")


@pytest.mark.parametrize("kind", ["memory", "sqlite", "postgres", "mongodb"])
def test_an_approval_a_steer_and_published_events_keep_the_stored_indexes_from_a_tail(
    kind: str, tmp_path: Path,
) -> None:
    """A turn run from a Tail waits for an approval (its journal at the stored index), is resumed from a
    Tail once approved, and runs the call once; a steer's SteerApplied index, the Saved lengths and the
    published events' pointers are those of the stored transcript."""
    server = Served(windowed(refunding, 20_000))
    try:
        with any_store(kind, tmp_path) as store:
            stored = long_transcript(600, [(300, 250), (501, 451)])
            sid = f"approve-{uuid.uuid4().hex}"
            store.save(sid, stored)
            session = agent.open(sid, store)
            spec = agent.Spec(session=session, tools=[refund], context=Compaction(20_000), publish_events=True)
            ep = endpoint(server.url, "openai")
            recent = session.messages(recent=True)
            assert isinstance(recent, agent.Tail) and recent.start == 451 - TAIL
            seen: list[Any] = []
            waiting = agent.Runner().run(spec, recent + [agent.Message.user("refund order 1182")], ep,  # noqa: RUF005
                                         seen.append)  # (a Tail plus a list is a Tail)
            assert waiting.stop_reason == "awaiting_approval" and len(session.messages()) == 601
            session.steer("and quickly")
            session.approve("c1")
            done = agent.Runner().run(spec, session.messages(recent=True), ep, seen.append)
            assert done.stop_reason == "answered" and done.text == "answer: refunded"
            whole = session.messages()
            assert whole[:601] == [*stored, agent.Message.user("refund order 1182")]
            assert [m.tool_calls[0].name for m in whole if m.tool_calls] == ["refund"]
            assert whole[602].content[0].text == "refunded 1182"  # ran once, right after its call
            applied = [e for e in seen if isinstance(e, agent.events.SteerApplied)]
            assert [(e.text, whole[e.index].text) for e in applied] == [("and quickly", "and quickly")]
            saved = [e.messages for e in seen if isinstance(e, agent.events.Saved)]
            assert saved[-1] == len(whole)
            responses = [e for e in session.events(limit=1000) if e.kind == "model_response"]
            assert responses and all("unresolved" not in e.data for e in responses)
            assert [agent.Message.from_dict(e.data["message"]) for e in responses] == [
                m for m in whole[600:] if m.role is agent.Role.ASSISTANT]
    finally:
        server.close()


def test_a_tail_run_of_an_erased_session_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    server = Served(windowed(refunding, 20_000))
    try:
        with any_store("sqlite", tmp_path) as store:
            stored = long_transcript(600, [(300, 250), (501, 451)])
            store.save("erased", stored)
            session = agent.open("erased", store)
            recent = session.messages(recent=True)
            session.delete()
            spec = agent.Spec(session=session, context=Compaction(20_000))
            with pytest.raises(agent.TranscriptDeleted):
                recent.append(agent.Message.user("hello?"))
                agent.Runner().run(spec, recent, endpoint(server.url, "openai"))
            assert session.messages() == [] and not server.requests
    finally:
        server.close()


def test_a_tail_is_refused_where_it_cannot_be_saved_as_one(tmp_path: Path) -> None:
    with any_store("sqlite", tmp_path) as store:
        store.save("s", long_transcript(600, [(300, 250)]))
        recent = agent.open("s", store).messages(recent=True)
        assert isinstance(recent, agent.Tail) and recent.start > 0
        ep = endpoint("http://127.0.0.1:9", "openai")
        with pytest.raises(agent.ArgumentError, match="replace_transcript"):
            agent.Runner().run(agent.Spec(session=agent.open("s", store), replace_transcript=True), recent, ep)
        plain = memory.Store()

        class Plain:  # a Session over no RunStore: its save replaces the whole transcript
            def save(self, msgs: Any) -> None:
                plain.save("p", msgs)

            def messages(self) -> list[agent.Message]:
                return plain.messages("p")

            def steer(self, text: str) -> None:
                plain.add_steer("p", text)

            def take_steers(self) -> list[str]:
                return plain.take_steers("p")

        with pytest.raises(agent.ArgumentError, match="TailStore"):
            agent.Runner().run(agent.Spec(session=Plain()), recent, ep)
        with pytest.raises(agent.ArgumentError, match="recent"):
            agent.open("s", store).messages(last=3, recent=True)
        # unpacked, a Tail is a plain list: the whole transcript as far as the run can tell, which the
        # store finds does not extend what it holds
        with pytest.raises(agent.TranscriptConflict):
            agent.Runner().run(agent.Spec(session=agent.open("s", store)), [*recent, agent.Message.user("x")], ep)
        assert len(agent.open("s", store).messages()) == 600


# -- concurrency: other processes while a compaction's summary is asked for ---------------------------------------

SQL_KINDS = ["sqlite", "postgres", "mysql"]


@contextmanager
def shared_store(kind: str, tmp_path: Path) -> Iterator[tuple[Any, str]]:
    """A store of ``kind`` other processes reach too, and where it is (``context_children.store_at``)."""
    if kind == "sqlite":
        where = str(tmp_path / "shared.db")
    else:
        base = servers.POSTGRES_URL if kind == "postgres" else servers.MYSQL_URL
        where = servers.database_url(base, servers.database_name("ctx_shared"))
        servers.create_database(where)
        engine = create_engine(where)
        servers.fresh_schema(engine)
        engine.dispose()
    store = store_at(kind, where)
    try:
        yield store, where
    finally:
        if kind == "sqlite":
            store.close()
        else:
            store.engine.dispose()


def child(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.context_children", *args], text=True,
                            stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1])


def history(turns: int) -> list[agent.Message]:
    return [m for n in range(turns) for m in (agent.Message.user(kilobyte(n)), agent.Message.assistant("ok"))]


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


@pytest.mark.parametrize("kind", SQL_KINDS)
def test_steers_and_a_replicas_reads_from_other_processes_while_a_summary_is_asked_for(
    kind: str, tmp_path: Path,
) -> None:
    """While run A's summary request is in flight, three processes post a steer each and a fourth reads the
    session over and over, whole and from the end. The steers are each delivered once, right after the
    record, in the request it was saved for; every read saw the session as one of A's saves left it (or
    as it was before them), never part of a save."""
    posted = [f"steer {i} while compacting" for i in range(3)]
    out, stop = tmp_path / "reads.jsonl", tmp_path / "stop"
    before = history(10)
    with shared_store(kind, tmp_path) as (store, where):
        sid = f"busy-{uuid.uuid4().hex}"
        store.save(sid, before)
        reader: list[subprocess.Popen[str]] = []

        def respond(request: Request) -> Reply:
            if is_summary_request(request) and not reader:
                reader.append(child("read", kind, where, sid, str(out), str(stop)))
                wait_for(lambda: len(lines(out)) >= 3, "the replica's first reads", timeout=60)
                steering = [child("steer", kind, where, sid, text) for text in posted]
                assert all(p.wait(timeout=60) == 0 for p in steering)
                seen = len(lines(out))
                wait_for(lambda: len(lines(out)) >= seen + 3, "the replica's reads after the steers", timeout=60)
                return openai("turns seen: 0-9")
            return openai("ok")

        server = Served(windowed(respond, 3000))
        try:
            session = agent.open(sid, store)
            spec = agent.Spec(session=session, context=Compaction(3000))
            events: list[Any] = []
            result = agent.Runner().run(spec, [*before, agent.Message.user("A's question")],
                                        endpoint(server.url, "openai"), events.append)
            assert result.stop_reason == "answered"
            seen = len(lines(out))
            wait_for(lambda: len(lines(out)) >= seen + 2, "the replica's reads after the run", timeout=60)
        finally:
            stop.touch()
            for p in reader:
                p.wait(timeout=60)
            server.close()
        stored = session.messages()
        at = next(i for i, m in enumerate(stored) if is_record(m))
        assert [m.text for m in stored if m.text in posted] == [m.text for m in stored[at + 1:at + 4]]
        assert sorted(m.text for m in stored[at + 1:at + 4]) == posted  # each once, right after the record
        asked = [r for r in server.requests if not is_summary_request(r)]
        assert all(text in json.dumps(asked[0].json["messages"]) for text in posted)
        assert session.pending_steers() == []
        saves = {len(before), *(e.messages for e in events if isinstance(e, agent.events.Saved))}
        reads = lines(out)
        assert reads and any(r["length"] == len(before) for r in reads)  # it read while the summary was asked for
        for r in reads:
            assert r["length"] in saves and r["digest"] == digest(stored[:r["length"]])
            end = r["start"] + r["recent"]
            assert end in saves and r["recent_digest"] == digest(stored[r["start"]:end])


@pytest.mark.parametrize("kind", SQL_KINDS)
def test_a_run_superseded_by_another_process_during_its_compaction_writes_nothing(
    kind: str, tmp_path: Path,
) -> None:
    """Run A's lease lapses while its summary request is in flight (its renewals held back, as a stopped
    process's would be); a run in another process takes the session and answers a turn. A's save, which
    would have carried the record, is refused (LeaseLost): the session is as the other process left it."""
    before = history(10)
    with shared_store(kind, tmp_path) as (store, where):
        sid = f"taken-{uuid.uuid4().hex}"
        store.save(sid, before)
        stalled = Stalled(store)
        taken: list[dict[str, Any]] = []

        def respond(request: Request) -> Reply:
            if is_summary_request(request) and not taken:
                stalled.freeze()
                wait_for(lambda: store.holder(sid) is None, "A's lease to lapse", timeout=30)
                other = child("answer", kind, where, sid, server.url)
                said, _ = other.communicate(timeout=120)
                assert other.returncode == 0
                taken.append(json.loads(said))
                return openai("turns seen: 0-9")
            return openai("ok")

        server = Served(windowed(respond, 3000))
        try:
            spec = agent.Spec(session=agent.open(sid, stalled), context=Compaction(3000), lease_ttl=0.6)
            with pytest.raises(agent.LeaseLost):
                agent.Runner().run(spec, [*before, agent.Message.user("A's question")], endpoint(server.url, "openai"))
        finally:
            stalled.thaw()
            server.close()
        stored = store.messages(sid)
        assert taken and (len(stored), digest(stored)) == (taken[0]["length"], taken[0]["digest"])
        assert not any(is_record(m) for m in stored) and "A's question" not in [m.text for m in stored]
        assert [m.text for m in stored[-2:]] == ["B's question", "ok"]
