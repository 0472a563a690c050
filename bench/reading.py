"""Reading and managing sessions: what issue #18's speed targets ask, measured the way the rest of the
benchmark is (samples interleaved with their floor, medians and p99 in ms).

- ``transcript``: ``messages()`` of a 1,000-message transcript beside the raw driver's select of the same
  rows plus ``json.loads`` of each (the floor), by the store that wrote it (warm) and by another store object
  on the same data (cold: a process that never saw it). A store keeps no transcript, so the two agree.
- ``tail``: ``messages(last=20)`` of a 10,000-message transcript beside ``messages()`` of a 20-message one.
- ``listing``: with 1,000 and with 100,000 sessions, a ``list_sessions`` page of 50 filtered by a metadata
  key (``user``: 100 sessions each; ``tenant``: a tenth of all sessions each, spread evenly; ``archived``:
  the oldest tenth, a common value no walk from the newest reaches), ``info()``, and the sweep of stranded
  runs with none stranded (``list_sessions(stranded=True, limit=100)``: what ``agent.recover`` reads first,
  every minute; the index of the open sessions holds none of the loaded ones).
- ``prune``: 10,000 idle sessions pruned: in all, and again one batch per call, each call timed; on SQL
  stores the transactions are also timed from inside (see ``TransactionClock``).

The sessions of ``listing`` and ``prune`` are written straight into the store's tables (its public
SQLAlchemy ``metadata``) in large batches, then checked through the store's API, so a schema the loader
does not match fails here rather than measuring nothing. They live in a database of their own
(``<prefix>_bench_life``), dropped afterwards.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import agent_sessions as agent
from agent_sessions import contract, lifecycle

from .workload import clock, summary, transcript

READ_N = 1000
TAIL_N = 10_000
TAIL_LAST = 20
SESSION_COUNTS = (1_000, 100_000)
PER_USER = 100
TENANTS = 10
PRUNE_N = 10_000
LOAD_CHUNK = 5_000
MESSAGES_PER_SESSION = 2
LIFECYCLE_DB = "bench_life"


# -- (a) and (b): reading a transcript ------------------------------------------------------------------------


class RawReader:
    """The floor of ``messages()``: the driver's select of the session's bodies, ``json.loads`` of each."""

    def __init__(self, name: str, where: Any) -> None:
        self.name = name
        if name == "sqlite":
            self.conn = sqlite3.connect(where, isolation_level=None, check_same_thread=False)
            self.sql = "SELECT body FROM agent_messages WHERE session_id = ? ORDER BY idx"
        elif name in ("postgres", "mysql"):
            self.raw = where.raw_connection()
            self.cursor = self.raw.cursor()
            self.sql = "SELECT body FROM agent_messages WHERE session_id = %s ORDER BY idx"
        elif name == "mongodb":
            self.db = where
        else:
            raise ValueError(name)

    def read(self, session: str) -> list[Any]:
        loads = json.loads
        if self.name == "sqlite":
            return [loads(body) for (body,) in self.conn.execute(self.sql, (session,))]
        if self.name == "mongodb":
            # What the store's layout takes: the session document, then the parts its pages name, by _id.
            from stores.mongodb import PARTS, SESSIONS

            doc = self.db[SESSIONS].find_one({"_id": session}, {"tail": 1, "pages": 1})
            ids = [e["p"] for e in doc.get("pages") or []]
            parts = {p["_id"]: p["texts"] for p in self.db[PARTS].find({"_id": {"$in": ids}})} if ids else {}
            bodies = [b for e in doc.get("pages") or [] for b in parts[e["p"]][:e["n"]]] + list(doc.get("tail") or [])
            return [loads(b) for b in bodies]
        self.cursor.execute(self.sql, (session,))
        rows = [loads(body) for (body,) in self.cursor.fetchall()]
        self.raw.commit()  # as the store ends its read transaction
        return rows


def reading_stores(name: str, tmp: str) -> tuple[agent.Store, agent.Store, RawReader] | None:
    """The store, a second one on the same data (a process that never saw it), and the raw reader."""
    from . import backends

    if name == "sqlite":
        from stores import sqlite

        path = Path(tmp) / f"reading-{uuid.uuid4().hex[:8]}.db"
        return sqlite.open(path), sqlite.open(path), RawReader(name, path)
    if name in ("postgres", "mysql"):
        from sqlalchemy import create_engine

        from stores import mysql, postgres

        engine = backends.engine(name)
        cls: Any = postgres.Store if name == "postgres" else mysql.Store
        return cls(engine), cls(engine), RawReader(name, create_engine(backends.sql_url(name)))
    if name == "mongodb":
        from stores import mongodb

        db = backends.mongo_database()
        return mongodb.Store(db), mongodb.Store(db), RawReader(name, db)
    return None


def transcript_rows(name: str, tmp: str, rounds: int) -> dict[str, Any] | None:
    """(a) and (b), each round: the floor, the warm read, the cold read; the tail, then the short read."""
    opened = reading_stores(name, tmp)
    if opened is None:
        return None
    store, cold, raw = opened
    long_id, tail_id, short_id = (f"bench-read-{k}-{uuid.uuid4().hex}" for k in ("1000", "10000", "20"))
    store.save(long_id, transcript(READ_N))
    store.save(tail_id, transcript(TAIL_N))
    store.save(short_id, transcript(TAIL_LAST))
    if len(raw.read(long_id)) != READ_N or len(cold.messages(long_id)) != READ_N:
        raise SystemExit(f"{name}: the raw reader does not read what the store wrote")
    tail_session, short_session = agent.open(tail_id, store), agent.open(short_id, store)
    if tail_session.messages(last=TAIL_LAST) != transcript(TAIL_N)[-TAIL_LAST:]:
        raise SystemExit(f"{name}: messages(last={TAIL_LAST}) is not the transcript's end")
    samples: dict[str, list[float]] = {k: [] for k in ("floor", "warm", "cold", "tail", "short")}
    for _ in range(rounds):
        samples["floor"].append(clock(lambda: raw.read(long_id)))
        samples["warm"].append(clock(lambda: store.messages(long_id)))
        samples["cold"].append(clock(lambda: cold.messages(long_id)))
        samples["tail"].append(clock(lambda: tail_session.messages(last=TAIL_LAST)))
        samples["short"].append(clock(lambda: short_session.messages()))
    return {k: summary(v) for k, v in samples.items()} | {
        "tail_native": isinstance(store, contract.LifecycleStore)}


# -- (c) and (d): many sessions ------------------------------------------------------------------------------


def session_meta(i: int, n: int) -> dict[str, contract.Scalar]:
    meta: dict[str, contract.Scalar] = {"user": f"u-{i // PER_USER}", "tenant": f"t-{i % TENANTS}"}
    if i < n // TENANTS:  # the oldest tenth (sessions are updated in the order of i)
        meta["archived"] = True
    return meta


class Lifecycle:
    """A lifecycle-capable store on a database of its own, filled fast."""

    def __init__(self, name: str, tmp: str) -> None:
        self.name = name
        self.engine: Any = None
        self.admin_url: str | None = None
        if name == "memory":
            from stores import memory

            self.store: Any = memory.Store()
            self.metadata = None
        elif name == "sqlite":
            from sqlalchemy import create_engine

            from stores import sqlite

            path = Path(tmp) / f"life-{uuid.uuid4().hex[:8]}.db"
            self.store = sqlite.open(path)
            self.engine = create_engine(f"sqlite:///{path}")
            self.metadata = getattr(sqlite, "metadata", None)
        elif name == "postgres":
            from sqlalchemy import create_engine

            from stores import postgres
            from tests import servers

            url = servers.database_url(servers.POSTGRES_URL, servers.database_name(LIFECYCLE_DB))
            self.admin_url = url
            self.engine = create_engine(url)
            with self.engine.begin() as conn:
                conn.exec_driver_sql(postgres.SCHEMA)
            self.store = postgres.Store(self.engine)
            self.metadata = getattr(postgres, "metadata", None)
        else:
            raise SystemExit(f"lifecycle rows: {name!r} is not measured (sqlite, postgres, memory)")
        if not isinstance(self.store, contract.LifecycleStore):
            self.close()
            raise NotReady(f"{name} store does not implement LifecycleStore on this branch")

    def close(self) -> None:
        """Drop the database of the 100,000 sessions (PostgreSQL); SQLite's file goes with the tmp dir."""
        if self.engine is not None:
            self.engine.dispose()
        with contextlib.suppress(Exception):
            self.store.engine.dispose()
        if self.admin_url is not None:
            from sqlalchemy import create_engine
            from sqlalchemy.engine import make_url

            target = make_url(self.admin_url)
            admin = create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{target.database}" WITH (FORCE)')
            admin.dispose()

    def load(self, first: int, count: int, updated_from: float, step: float, prefix: str = "s") -> None:
        """Sessions ``first`` .. ``first + count - 1``, ``MESSAGES_PER_SESSION`` messages each, updated
        ``step`` seconds apart from ``updated_from`` on, with ``session_meta`` metadata."""
        bodies = [m.to_json() for m in transcript(MESSAGES_PER_SESSION)]
        if self.metadata is None:  # the memory store: through its API (it has no tables)
            for i in range(first, first + count):
                sid = f"{prefix}-{i:07d}"
                self.store.save(sid, transcript(MESSAGES_PER_SESSION))
                self.store.set_metadata(sid, session_meta(i, count))
            return
        import dataclasses

        from sqlalchemy import insert

        from agent_sessions.backend import empty_row, indexed, new_incarnation

        tables = self.metadata.tables
        sessions, messages, tags = tables["agent_sessions"], tables["agent_messages"], tables["agent_metadata"]
        stamp = _stamp(sessions.c.updated.type)
        for start in range(first, first + count, LOAD_CHUNK):
            rows: list[dict[str, Any]] = []
            msgs: list[dict[str, Any]] = []
            tag_rows: list[dict[str, Any]] = []
            for i in range(start, min(start + LOAD_CHUNK, first + count)):
                sid = f"{prefix}-{i:07d}"
                at = stamp(updated_from + (i - first) * step)
                row = dataclasses.replace(empty_row(sid), exists=True, incarnation=new_incarnation(), created=at,
                                          updated=at, version=1, length=len(bodies), edits=1,
                                          metadata=lifecycle.encode_metadata(session_meta(i, count)))
                rows.append({c.name: getattr(row, {"session_id": "session", "exists_": "exists"}.get(c.name, c.name))
                             for c in sessions.columns})
                msgs.extend({"session_id": sid, "idx": k, "body": b} for k, b in enumerate(bodies))
                tag_rows.extend({"session_id": sid, "name": k, "value": v} for k, v in indexed(row.metadata))
            with self.engine.begin() as conn:
                conn.execute(insert(sessions), rows)
                conn.execute(insert(messages), msgs)
                conn.execute(insert(tags), tag_rows)

    def check(self, total: int, prefix: str = "s") -> None:
        """The loaded sessions are what the store's API shows: else the loader no longer matches the
        schema, and the figures would measure something else."""
        i = total // 2
        sid = f"{prefix}-{i:07d}"
        info = self.store.info(sid)
        if info is None or info.messages != MESSAGES_PER_SESSION or dict(info.metadata) != session_meta(i, total):
            raise SystemExit(f"{self.name}: the loaded session {sid} reads back as {info!r}")
        user = session_meta(i, total)["user"]
        page = self.store.list_sessions(where={"user": user}, limit=50)
        expected = sorted((k for k in range(total) if session_meta(k, total)["user"] == user), reverse=True)[:50]
        if [s.id for s in page] != [f"{prefix}-{k:07d}" for k in expected] or page.next is None:
            raise SystemExit(f"{self.name}: list_sessions(where={{'user': {user!r}}}) does not list the loaded "
                             f"sessions newest first: {[s.id for s in page][:5]}...")


class NotReady(Exception):
    """The store lacks what a row measures (on this branch): the row is left out, and the report says so."""


def _stamp(column_type: Any) -> Callable[[float], Any]:
    """How the sessions table keeps a time: seconds since 1970 (schema 3 as designed) or a datetime."""
    try:
        python_type = column_type.python_type
    except NotImplementedError:
        python_type = float
    if python_type is datetime:
        return lambda seconds: datetime.fromtimestamp(seconds, UTC)
    return float


def listing_rows(name: str, tmp: str, rounds: int) -> dict[str, Any]:
    """(c): at each size, a filtered page by a small key (``user``), by a large one (``tenant``), by a large
    one of only the oldest sessions (``archived``), and ``info()``, interleaved; then the ratio of the
    largest size to the smallest."""
    out: dict[str, Any] = {}
    for total in SESSION_COUNTS:
        life = Lifecycle(name, tmp)
        try:
            started = time.perf_counter()
            now = time.time()
            life.load(0, total, now - total, 1.0)  # the newest ones: updated in the last `total` seconds
            load_s = time.perf_counter() - started
            life.check(total)
            store = life.store
            samples: dict[str, list[float]] = {"user_page": [], "tenant_page": [], "old_page": [], "info": [],
                                               "sweep": []}
            if list(store.list_sessions(limit=100, stranded=True)):
                raise SystemExit(f"{name}: the loaded (finished) sessions are listed as stranded")
            for r in range(rounds):
                i = (r * 7919) % total
                user, tenant = session_meta(i, total)["user"], session_meta(i, total)["tenant"]
                sid = f"s-{i:07d}"
                samples["user_page"].append(clock(partial(store.list_sessions, where={"user": user}, limit=50)))
                samples["tenant_page"].append(clock(partial(store.list_sessions, where={"tenant": tenant}, limit=50)))
                samples["old_page"].append(clock(partial(store.list_sessions, where={"archived": True}, limit=50)))
                samples["info"].append(clock(partial(store.info, sid)))
                samples["sweep"].append(clock(partial(store.list_sessions, limit=100, stranded=True, grace=10.0)))
            out[str(total)] = {k: summary(v) for k, v in samples.items()} | {"load_s": load_s}
        finally:
            life.close()
    return out


class TransactionClock:
    """Times every transaction of a SQL store in this thread from inside, without touching the store: SQLAlchemy's
    begin/commit/rollback events on the store's engine (SQLite's BEGIN IMMEDIATE follows the begin at once),
    from the transaction's start to its COMMIT, which is when the lock is held."""

    def __init__(self, store: Any) -> None:
        self.spans: list[float] = []
        self._began: float | None = None
        self._store = store
        self._thread = threading.get_ident()  # prune's: the engine's events also fire for other threads

    def _begin(self, *_: Any) -> None:
        if threading.get_ident() == self._thread:
            self._began = time.perf_counter()

    def _end(self, *_: Any) -> None:
        if self._began is not None and threading.get_ident() == self._thread:
            self.spans.append((time.perf_counter() - self._began) * 1000)
            self._began = None

    @contextlib.contextmanager
    def watching(self) -> Iterator[TransactionClock]:
        from sqlalchemy import event

        engine = getattr(self._store, "engine", None)
        hooks = (("begin", self._begin), ("commit", self._end), ("rollback", self._end)) if engine else ()
        for name, fn in hooks:
            event.listen(engine, name, fn)
        try:
            yield self
        finally:
            for name, fn in hooks:
                event.remove(engine, name, fn)


class WriterProbe:
    """Another thread saving a small session over and over while prune runs: its slowest save is how
    long a writer waited behind prune (on SQLite, whose write lock is the whole file, that is the
    longest batch's hold of it)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        sid = f"probe-{uuid.uuid4().hex}"
        msgs = transcript(3)
        while not self._stop.is_set():
            self.samples.append(clock(partial(self.store.save, sid, msgs)))
            msgs = msgs[:1] if len(msgs) > 2 else transcript(3)  # a rewrite, then a whole save again
            time.sleep(0.002)

    def __enter__(self) -> WriterProbe:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def prune_rows(name: str, tmp: str, batch: int) -> dict[str, Any]:
    """(d): 10,000 sessions idle for two days beside 1,000 fresh ones: ``prune(idle_for=1 day)`` in one
    call (its transactions timed from inside, a writer probing beside it), then the same load pruned
    ``batch`` at a time, each call timed."""
    out: dict[str, Any] = {"sessions": PRUNE_N, "batch_per_call": batch}
    if name == "memory":
        raise NotReady("the memory store cannot be given sessions idle for days")
    for mode in ("one_call", "per_batch"):
        life = Lifecycle(name, tmp)
        try:
            now = time.time()
            life.load(0, PRUNE_N, now - 2 * 86400, 0.001, prefix="idle")
            life.load(0, 1000, now - 1000, 1.0, prefix="fresh")
            store = life.store
            if mode == "one_call":
                with TransactionClock(store).watching() as tx, WriterProbe(store) as probe:
                    started = time.perf_counter()
                    deleted = store.prune(idle_for=86400)
                    total_ms = (time.perf_counter() - started) * 1000
                out["one_call"] = {"deleted": deleted, "total_ms": total_ms, "transactions": len(tx.spans),
                                   "longest_transaction_ms": max(tx.spans, default=0.0),
                                   "probe_saves": len(probe.samples),
                                   "probe_longest_ms": max(probe.samples, default=0.0)}
            else:
                calls: list[float] = []
                deleted = 0
                while True:
                    started = time.perf_counter()
                    n = store.prune(idle_for=86400, limit=batch)
                    calls.append((time.perf_counter() - started) * 1000)
                    deleted += n
                    if n < batch:
                        break
                out["per_batch"] = {"deleted": deleted, "calls": len(calls), "total_ms": sum(calls),
                                    "longest_call_ms": max(calls), "median_call_ms": summary(calls)["median_ms"]}
            left = len(store.list_sessions(prefix="idle", limit=10))
            fresh = len(store.list_sessions(prefix="fresh", limit=1000))
            if deleted != PRUNE_N or left or fresh != 1000:
                raise SystemExit(f"{name}: prune deleted {deleted} of {PRUNE_N} idle sessions, left {left} of "
                                 f"them and {fresh} of 1,000 fresh ones")
        finally:
            life.close()
    return out


# -- the section ---------------------------------------------------------------------------------------------


def run(names: list[str], tmp: str, rounds: int, lifecycle_names: list[str], prune_batch: int) -> dict[str, Any]:
    report: dict[str, Any] = {"transcript": {}, "listing": {}, "prune": {}, "not_ready": {}}
    for name in names:
        print(f"... reading {name}", flush=True)
        rows = transcript_rows(name, tmp, rounds)
        if rows is not None:
            report["transcript"][name] = rows
    for name in lifecycle_names:
        print(f"... listing and prune, {name}", flush=True)
        try:
            report["listing"][name] = listing_rows(name, tmp, rounds)
            report["prune"][name] = prune_rows(name, tmp, prune_batch)
        except NotReady as exc:
            report["not_ready"][name] = str(exc)
    return report


def _cell(s: dict[str, float]) -> str:
    return f"{s['median_ms']:.3f} ({s['p99_ms']:.2f})"


def tables(report: dict[str, Any]) -> str:
    lines = [f"Reading a transcript, median (p99) ms. Floor: the driver's select of the {READ_N:,} bodies and "
             "json.loads of each, interleaved. Warm: the store that wrote it; cold: another store object on the "
             "same data (a process that never saw it).", "",
             f"| | floor | messages(), warm | x floor | messages(), cold | x floor | messages(last={TAIL_LAST}) "
             f"of {TAIL_N:,} | messages() of {TAIL_LAST} | x |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["transcript"].items():
        floor = r["floor"]["median_ms"]
        tail = "" if r["tail_native"] else " (no tail: reads all)"
        lines.append(f"| {name} | {_cell(r['floor'])} | {_cell(r['warm'])} | {r['warm']['median_ms'] / floor:.2f}x | "
                     f"{_cell(r['cold'])} | {r['cold']['median_ms'] / floor:.2f}x | {_cell(r['tail'])}{tail} | "
                     f"{_cell(r['short'])} | {r['tail']['median_ms'] / r['short']['median_ms']:.2f}x |")
    if report["listing"]:
        small, large = (str(n) for n in SESSION_COUNTS)
        lines += ["", f"Managing many sessions, median (p99) ms, at {int(small):,} and {int(large):,} sessions "
                  f"(page of 50; user: {PER_USER} sessions each; tenant: {TENANTS} values, a tenth of all "
                  "sessions each; archived: the oldest tenth)", "",
                  f"| | call | {int(small):,} | {int(large):,} | x |", "|---|---|---|---|---|"]
        for name, r in report["listing"].items():
            for key, label in (("user_page", "list_sessions(where=user)"),
                               ("tenant_page", "list_sessions(where=tenant)"),
                               ("old_page", "list_sessions(where=archived)"), ("info", "info()"),
                               ("sweep", "list_sessions(stranded=True), none stranded")):
                if key in r[small]:  # reports from before the archived row lack it
                    ratio = r[large][key]["median_ms"] / r[small][key]["median_ms"]
                    lines.append(f"| {name} | {label} | {_cell(r[small][key])} | {_cell(r[large][key])} | "
                                 f"{ratio:.2f}x |")
            if "user_page" in r[large]:
                tenant_x = r[large]["tenant_page"]["median_ms"] / r[large]["user_page"]["median_ms"]
                lines.append(f"| {name} | tenant page / user page at {int(large):,} | | | {tenant_x:.2f}x |")
    if report["prune"]:
        lines += ["", f"prune of {PRUNE_N:,} idle sessions (beside 1,000 fresh ones)", "",
                  "| | one call: ms | transactions | longest (inside) ms | writer beside it: longest save ms | "
                  "limit=batch calls | longest call ms |", "|---|---|---|---|---|---|---|"]
        for name, r in report["prune"].items():
            one, per = r["one_call"], r["per_batch"]
            lines.append(f"| {name} | {one['total_ms']:.0f} | {one['transactions']} | "
                         f"{one['longest_transaction_ms']:.1f} | {one['probe_longest_ms']:.1f} | "
                         f"{per['calls']} x {r['batch_per_call']} | {per['longest_call_ms']:.1f} |")
    for name, why in report["not_ready"].items():
        lines.append(f"\n({name}: listing and prune not measured: {why})")
    return "\n".join(lines)
