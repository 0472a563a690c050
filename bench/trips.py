"""Round trips: what a step costs with the database a network hop away.

A TCP proxy on 127.0.0.1 stands between the store and its server (``Hop``). It counts *exchanges* (each
time a client, having sent, waits for the server: a run of client bytes followed by a run of server bytes,
on any of the store's connections) and can delay each one by an added round-trip time. For each server
store, through it, with connections already open:

- the exchanges of a run's start (``Runner.run`` to its first model request) and of a loop step with an
  idempotent tool, with a non-idempotent tool, and with the event log on (``Spec.publish_events``);
- at an added RTT (1 ms by default), a step's time against the one-statement floor over the same hop (the
  step's two rows as one two-row INSERT in autocommit, or its equivalent: one exchange, durable).

The model answers at once and the tools do nothing: what is left is the store's.
"""

from __future__ import annotations

import itertools
import multiprocessing
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import agent_sessions as agent
from agent_sessions import Content, Message, Role

STEPS = 12
"""Loop steps a measured run makes (the first is left out: it is the run's start)."""


class Hop:
    """A TCP proxy to ``upstream``, adding ``rtt`` seconds to each exchange and counting them. It runs in a
    process of its own, as a network does: its threads, in the measured client's process, would take that
    client's GIL at every packet they forward."""

    def __init__(self, upstream: tuple[str, int], rtt: float = 0.0) -> None:
        self.upstream = upstream
        self.rtt = rtt
        context = multiprocessing.get_context("spawn")
        self._exchanges = context.Value("q", 0)
        ours, theirs = context.Pipe()
        self._process = context.Process(target=_proxy, args=(upstream, rtt, self._exchanges, theirs), daemon=True,
                                        name="hop")
        self._process.start()
        if not ours.poll(30):
            self._process.kill()
            raise RuntimeError("the hop's process did not start within 30 s")
        self.port: int = ours.recv()

    def count(self) -> int:
        with self._exchanges.get_lock():
            return int(self._exchanges.value)

    def close(self) -> None:
        self._process.kill()
        self._process.join(10)


def _proxy(upstream: tuple[str, int], rtt: float, exchanges: Any, started: Any) -> None:
    """The hop's process: accept on a port of its own (sent through ``started``), and for each connection
    pump both ways, counting a turn from server bytes to client bytes as an exchange."""
    listener = socket.create_server(("127.0.0.1", 0))
    started.send(listener.getsockname()[1])

    def pump(source: socket.socket, sink: socket.socket, state: _Conn, outbound: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                with state.lock:
                    turned = state.last is not outbound
                    state.last = outbound
                if turned:
                    if outbound:
                        with exchanges.get_lock():
                            exchanges.value += 1
                    if rtt:
                        time.sleep(rtt / 2)  # half the round trip each way
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    while True:
        client, _ = listener.accept()
        server = socket.create_connection(upstream)
        for sock in (client, server):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        state = _Conn()
        threading.Thread(target=pump, args=(client, server, state, True), daemon=True).start()
        threading.Thread(target=pump, args=(server, client, state, False), daemon=True).start()


@dataclass
class _Conn:
    lock: threading.Lock = field(default_factory=threading.Lock)
    last: bool | None = None
    """The direction of the connection's last bytes: True outbound (client to server)."""


@agent.tool(name="lookup")
def lookup(n: int) -> str:
    """Look something up (idempotent)."""
    return "found"


@agent.tool(name="charge", idempotent=False)
def charge(n: int) -> str:
    """Charge (not idempotent)."""
    return "charged"


class Noting:
    """A model calling ``tool`` on every request until ``steps`` were made, then answering; it notes the
    hop's count and the clock at each request."""

    def __init__(self, hop: Hop, tool: str, steps: int) -> None:
        self.hop, self.tool, self.steps = hop, tool, steps
        self.seen: list[tuple[int, float]] = []

    def complete(self, system: str, messages: Sequence[Message], tools: object) -> Message:
        self.seen.append((self.hop.count(), time.perf_counter()))
        if len(self.seen) >= self.steps:
            return Message.assistant("done")
        return Message(Role.ASSISTANT, [Content.tool_call(f"c{len(self.seen)}", self.tool, '{"n": 1}')])


@dataclass
class Measured:
    start: int
    """Exchanges from ``Runner.run`` to the first model request."""
    step: float
    """Exchanges per loop step (median over the run's steps)."""
    durations: list[float]
    """Each step's time, milliseconds."""

    @property
    def step_ms(self) -> float:
        """Median time of a step, milliseconds."""
        return statistics.median(self.durations)


def run_once(store: Any, hop: Hop, tool: Callable[..., str], publish: bool = False) -> Measured:
    """One run of ``STEPS`` steps on a new session of ``store`` (whose connections go through ``hop``)."""
    sid = f"trips-{uuid.uuid4().hex}"
    model = Noting(hop, tool.__name__ if not isinstance(tool, agent.Tool) else tool.name, STEPS)
    spec = agent.Spec(session=agent.open(sid, store), tools=[tool], max_steps=STEPS + 1, lease_ttl=600.0,
                      publish_events=publish)
    before = hop.count()
    agent.Runner().run(spec, [Message.user("go")], model)
    counts = [c for c, _ in model.seen]
    times = [t for _, t in model.seen]
    steps = [b - a for a, b in itertools.pairwise(counts[1:])]
    durations = [(b - a) * 1000 for a, b in itertools.pairwise(times[1:])]
    return Measured(counts[0] - before, statistics.median(steps), durations)


ROUNDS = 10
"""Runs of the idempotent step at the added RTT, each followed by as many rounds of the floor: the two are
measured interleaved, so a busy stretch of the machine weighs on both alike."""


def measure(store: Any, hop: Hop, floor: Callable[[], object] | None = None) -> dict[str, Any]:
    """The store's exchanges, and with ``floor`` the step times at the hop's RTT beside the floor's (``ROUNDS``
    runs of the idempotent step interleaved with the floor's rounds): a warm-up run first, so connections are
    open and statements prepared, as in a worker that has served a turn."""
    run_once(store, hop, lookup)
    idempotent = run_once(store, hop, lookup)
    floors: list[float] = []
    for _ in range(ROUNDS if floor is not None else 0):
        floors += floor_samples(floor, STEPS)  # type: ignore[arg-type]
        idempotent.durations += run_once(store, hop, lookup).durations
    non_idempotent = run_once(store, hop, charge)
    events = run_once(store, hop, lookup, publish=True)
    return {"start": idempotent.start, "idempotent": idempotent.step, "non_idempotent": non_idempotent.step,
            "events": events.step, "events_extra": events.step - idempotent.step,
            "step_ms": idempotent.step_ms, "non_idempotent_ms": non_idempotent.step_ms,
            "events_ms": events.step_ms, "floor_ms": statistics.median(floors) if floors else None}


def floor_samples(append: Callable[[], object], rounds: int) -> list[float]:
    """The times of ``rounds`` calls of ``append`` (the one-statement floor through the hop), milliseconds,
    after one not timed."""
    append()
    samples = []
    for _ in range(rounds):
        began = time.perf_counter()
        append()
        samples.append((time.perf_counter() - began) * 1000)
    return samples


# -- the stores, through a hop each ------------------------------------------------------------------------

SERVERS = ("postgres", "mysql", "mongodb", "redis")


def _upstream(name: str) -> tuple[str, int]:
    from urllib.parse import urlsplit

    from tests import servers

    url = {"postgres": servers.POSTGRES_URL, "mysql": servers.MYSQL_URL, "mongodb": servers.MONGO_URL,
           "redis": servers.REDIS_URL}[name]
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or {"postgres": 5432, "mysql": 3306, "mongodb": 27017,
                                                          "redis": 6379}[name]


def _through(hop: Hop, url: str) -> str:
    """``url`` with its host and port the hop's."""
    from sqlalchemy import make_url

    return make_url(url).set(host="127.0.0.1", port=hop.port).render_as_string(hide_password=False)


def store_through(name: str, hop: Hop) -> tuple[Any, Callable[[], object], Callable[[], None]]:
    """The store ``name`` with its connections through ``hop``, the one-statement floor over the same hop (the
    step's two rows in one statement, autocommit), and how to close both."""
    from . import backends

    if name in ("postgres", "mysql"):
        from sqlalchemy import create_engine, text

        from stores import mysql, postgres

        direct = backends.engine(name)  # fresh tables, made without the hop
        with direct.begin() as conn:  # emptied: a run's floor is not slowed by earlier runs' rows
            conn.execute(text("CREATE TABLE IF NOT EXISTS trips_floor (session_id VARCHAR(64), body TEXT)"))
            conn.execute(text("DELETE FROM trips_floor"))
        direct.dispose()
        engine = create_engine(_through(hop, backends.sql_url(name)))
        store = postgres.Store(engine) if name == "postgres" else mysql.Store(engine)
        floor_engine = create_engine(_through(hop, backends.sql_url(name)), isolation_level="AUTOCOMMIT")
        floor_conn = floor_engine.connect()
        raw = floor_conn.connection.driver_connection
        assert raw is not None
        cursor = raw.cursor()
        insert = "INSERT INTO trips_floor (session_id, body) VALUES (%s, %s), (%s, %s)"

        def floor() -> object:
            return cursor.execute(insert, ("s", "a" * 200, "s", "b" * 1000))

        def close() -> None:
            floor_conn.close()
            floor_engine.dispose()
            store.close()
            engine.dispose()

        return store, floor, close
    if name == "mongodb":
        import pymongo

        from stores import mongodb

        backends.mongo_database()  # fresh collections
        client: Any = pymongo.MongoClient(f"mongodb://127.0.0.1:{hop.port}/?directConnection=true")
        db = client[backends.bench_db()]
        db.trips_floor.drop()  # as the store's collections: a run's floor is not slowed by earlier runs' documents
        return (mongodb.Store(db), lambda: db.trips_floor.insert_many([{"a": "a" * 200}, {"b": "b" * 1000}]),
                client.close)
    import redis as redis_py

    from stores import redis
    from tests import servers

    client = redis_py.Redis(port=hop.port)
    prefix = f"{servers.REDIS_KEY_PREFIX}trips:{uuid.uuid4().hex[:8]}:"

    def drop() -> None:
        direct = redis_py.Redis(host=hop.upstream[0], port=hop.upstream[1])
        for key in direct.scan_iter(match=f"{prefix}*", count=1000):
            direct.delete(key)
        direct.close()
        client.close()

    return (redis.Store(client, prefix=prefix), lambda: client.rpush(f"{prefix}floor", "a" * 200, "b" * 1000),
            drop)


# -- the peers, through the same hop ------------------------------------------------------------------------


def _peer_step(name: str, hop: Hop) -> tuple[Callable[[int], object], Callable[[], None]]:
    """A peer's loop step on PostgreSQL through ``hop`` (a session made and warmed first), as bench/peers.py
    does it: OpenAI's ``add_items`` of the step's two items; LangGraph's two nodes, each checkpointed."""
    import asyncio

    from . import backends, peers

    url = _through(hop, backends.sql_url("postgres"))
    sid = f"trips-peer-{uuid.uuid4().hex}"
    if name == "openai-agents":
        from agents.extensions.memory.sqlalchemy_session import SQLAlchemySession
        from sqlalchemy.ext.asyncio import create_async_engine

        loop = asyncio.new_event_loop()
        engine = create_async_engine(url)
        session = SQLAlchemySession(sid, engine=engine, create_tables=True, sessions_table="openai_agents_sessions",
                                    messages_table="openai_agents_messages")
        loop.run_until_complete(session.add_items(peers._openai_prefix(3)))

        def close_openai() -> None:
            loop.run_until_complete(engine.dispose())
            loop.close()

        return lambda i: loop.run_until_complete(session.add_items(peers._openai_items(i))), close_openai
    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.postgres import PostgresSaver
    from sqlalchemy import make_url

    conninfo = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    context = PostgresSaver.from_conn_string(conninfo)
    saver = context.__enter__()
    saver.setup()
    graph = peers._react_graph(saver)
    config = {"configurable": {"thread_id": sid}}
    graph.invoke({"messages": [HumanMessage(content="review the lease code")]}, config, durability="sync")
    return (lambda i: graph.invoke({"messages": []}, config, durability="sync"),
            lambda: context.__exit__(None, None, None))


def peer_row(name: str, rtt: float) -> dict[str, Any]:
    """A peer's exchanges per step (no delay) and its step's time at ``rtt``, on PostgreSQL."""
    row: dict[str, Any] = {}
    for delay in (0.0, rtt):
        hop = Hop(_upstream("postgres"), delay)
        step, close = _peer_step(name, hop)
        try:
            step(0)
            counts, times = [], []
            for i in range(1, STEPS + 1):
                before, began = hop.count(), time.perf_counter()
                step(i)
                counts.append(hop.count() - before)
                times.append((time.perf_counter() - began) * 1000)
            if delay:
                row["step_ms"] = statistics.median(times)
            else:
                row["step"] = statistics.median(counts)
        finally:
            close()
            hop.close()
    return row


PEER_LABELS = {"openai-agents": "OpenAI Agents SQLAlchemySession (PostgreSQL)",
               "langgraph": "LangGraph ReAct + PostgresSaver"}


def run(names: Sequence[str], rtt: float = 0.001) -> dict[str, Any]:
    """Per store: the exchanges (counted with no added delay) and, at ``rtt``, a step's time beside the
    floor's over the same hop."""
    out: dict[str, Any] = {"rtt_ms": rtt * 1000, "stores": {}}
    for name in names:
        print(f"... trips: {name}", flush=True)
        row: dict[str, Any] = {}
        for delay in (0.0, rtt):
            hop = Hop(_upstream(name), delay)
            store, floor, close = store_through(name, hop)
            try:
                measured = measure(store, hop, floor if delay else None)
                if delay:
                    row.update({k: measured[k] for k in ("step_ms", "non_idempotent_ms", "events_ms", "floor_ms")})
                else:
                    row.update({k: measured[k] for k in ("start", "idempotent", "non_idempotent", "events")})
            finally:
                close()
                hop.close()
        row["x_floor"] = row["step_ms"] / row["floor_ms"]
        out["stores"][name] = row
    if "postgres" in names:
        from . import peers

        out["peers"] = {}
        for peer in peers.available():
            print(f"... trips: {peer}", flush=True)
            out["peers"][PEER_LABELS[peer]] = peer_row(peer, rtt)
    return out


def tables(report: dict[str, Any]) -> str:
    lines = [f"Round trips (exchanges a client waits for; counted by a TCP hop), and a loop step at RTT "
             f"+{report['rtt_ms']:g} ms beside the one-statement floor over the same hop", "",
             "| store | run's start | step, idempotent tool | non-idempotent | event log on | step ms at +RTT | "
             "floor ms | x floor |", "|---|---|---|---|---|---|---|---|"]
    for name, r in report["stores"].items():
        lines.append(f"| {name} | {r['start']} | {r['idempotent']:g} | {r['non_idempotent']:g} | "
                     f"{r['events']:g} | {r['step_ms']:.2f} | {r['floor_ms']:.2f} | {r['x_floor']:.2f}x |")
    for label, r in report.get("peers", {}).items():
        floor = report["stores"]["postgres"]["floor_ms"]
        lines.append(f"| {label} | | {r['step']:g} | | | {r['step_ms']:.2f} | {floor:.2f} | "
                     f"{r['step_ms'] / floor:.2f}x |")
    return "\n".join(lines)
