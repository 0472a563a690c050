"""Randomised fault trials (issue #25): a conversation's operations (a steer before a turn, the turn, a
steer after it, the next turn, sometimes a delete) reach PostgreSQL, MariaDB or MongoDB through the fault proxy,
which fires one or two faults of random kinds at random statements. Each operation that fails is then
resumed or retried the way docs/reliability.md prescribes (a turn by ``Runner.turn`` with its key, on a
worker that reaches the database directly; a steer with a key, in the trials of even seeds, sent again as
it was whatever the failure, and one without retried unless it may have happened, which is read back
first), and the invariants are checked:

- each steer, each user message, lands exactly once; the transcript is valid (no call without its result);
- a non-idempotent tool ran at most once per call;
- the event log holds no event twice, and no run both ``finished`` and ``failed``;
- nothing is wedged: every resume got the session within ``lease_wait`` + ``lease_ttl``;
- a delete, once it returned, left nothing behind.

A trial is its seed: ``python -m tests.faults.trials --store postgres --seed S`` replays one, ``--trials N``
runs N (the soak: ``scripts/soak --faults N``), printing what fired, the resumes and the checks.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import random
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pymongo
from sqlalchemy import create_engine, make_url, text

import agent_sessions as agent
from stores import mongodb, mysql, postgres
from tests import servers
from tests.model_server import ModelServer, Reply, Request, openai

from .proxy import FaultProxy, Rule

KINDS = ("lose_ack", "cut_before", "cut_inside", "cut_after", "terminate", "delay")
MONGO_KINDS = tuple(k for k in KINDS if k != "terminate")
"""MongoDB has no backend to end from outside (the proxy's ``terminate``)."""
LEASE_TTL = 1.5
RESUME_WAIT = LEASE_TTL * 4
"""A resume waits this long for the lease a failed run may have left held (it expires after the ttl)."""
CALLS = 2
"""The model asks for this many payments, one at a time, before it answers."""
TRANSFER = -1
"""The key of the transfer (a call that waits for approval) among the counts of tools run."""
STATEMENTS = 160
"""Faults fire at a random statement among the first this many a trial sends through the proxy (a trial
sends 30 to 180: a fault past its end does not fire, and is not counted)."""
MONGO_STATEMENTS = 40
"""On MongoDB, where each write is one command (a trial sends about 25 to 45)."""


@dataclass
class Outcome:
    seed: int
    store: str
    fired: list[str] = field(default_factory=list)
    failed_ops: list[str] = field(default_factory=list)
    resumes: int = 0
    checks: int = 0
    statements: int = 0
    violations: list[str] = field(default_factory=list)


class Backend:
    """One database, reached directly and through a fresh fault proxy per trial."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "mongodb":
            self.url = servers.MONGO_URL
            self.port = int(pymongo.uri_parser.parse_uri(self.url)["nodelist"][0][1])
            self.database = servers.database_name("faulttrials")
            with pymongo.MongoClient(self.url) as client:
                for collection in mongodb.COLLECTIONS:
                    client[self.database].drop_collection(collection)
                mongodb.create_indexes(client[self.database])
        else:
            base = servers.POSTGRES_URL if name == "postgres" else servers.MYSQL_URL
            self.url = servers.database_url(base, servers.database_name("faulttrials"))
            self.port = int(make_url(self.url).port or 0)
            self.admin = create_engine(self.url)
            servers.fresh_schema(self.admin)
        self.direct = self.store(None)
        self.model = ModelServer()
        self.paid: collections.Counter[tuple[str, int]] = collections.Counter()
        paid = self.paid

        @agent.tool(idempotent=False)
        def pay(session: str, n: int) -> str:
            """Pay bill n of the session (not idempotent: it must run at most once per call)."""
            paid[(session, n)] += 1
            return f"paid {n}"

        @agent.tool(idempotent=False, needs_approval=True)
        def transfer(session: str) -> str:
            """Transfer the session's money (a person approves it first; it must run at most once)."""
            paid[(session, TRANSFER)] += 1
            return "transferred"

        self.pay = pay
        self.transfer = transfer

    def store(self, port: int | None) -> agent.EventStore:
        if self.name == "mongodb":
            url = self.url if port is None else f"mongodb://127.0.0.1:{port}/?directConnection=true"
            return mongodb.Store(pymongo.MongoClient(url, serverSelectionTimeoutMS=10_000)[self.database])
        url = make_url(self.url)
        engine = create_engine(url if port is None else url.set(port=port), pool_size=2, pool_timeout=10)
        if self.name == "postgres":
            return postgres.Store(engine, lock_wait=1.0, transaction_timeout=3.0)
        return mysql.Store(engine, lock_wait=1.0)

    def terminate(self, backend_id: int) -> None:
        with self.admin.connect() as conn:
            if self.name == "postgres":
                conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": backend_id})
            else:
                conn.exec_driver_sql(f"KILL CONNECTION {int(backend_id)}")

    def close(self) -> None:
        self.model.close()
        _close(self.direct)
        if self.name != "mongodb":
            self.admin.dispose()


def _close(store: Any) -> None:
    if isinstance(store, mongodb.Store):
        store.database.client.close()
    else:
        getattr(store, "close", store.engine.dispose)()


def _policy(session: str) -> Callable[[Request], Reply]:
    """The model, as a function of what it is sent (so a resume on another worker meets the same one):
    a payment per call until ``CALLS`` results are in, then an answer."""

    def reply(request: Request) -> Reply:
        messages = request.json["messages"]
        results = sum(1 for m in messages if m["role"] == "tool")
        if any("transfer" in (m.get("content") or "") for m in messages if m["role"] == "user") and not any(
                m.get("tool_calls") and m["tool_calls"][0]["function"]["name"] == "transfer"
                for m in messages if m["role"] == "assistant"):
            return openai(calls=[(f"transfer-{session}", "transfer", json.dumps({"session": session}))])
        if results < CALLS:
            return openai(calls=[(f"pay-{session}-{results}", "pay", json.dumps({"session": session, "n": results}))])
        return openai("done")

    return reply


def trial(backend: Backend, seed: int) -> Outcome:
    rng = random.Random(seed)
    out = Outcome(seed, backend.name)
    sid = f"t{seed}-{uuid.uuid4().hex[:8]}"
    mongo = backend.name == "mongodb"
    proxy = FaultProxy(backend.name, backend.port, None if mongo else backend.terminate).start()
    rules = [proxy.arm(Rule(kind, nth=rng.randint(1, MONGO_STATEMENTS if mongo else STATEMENTS),
                            seconds=rng.uniform(0.05, 0.4)))
             for kind in rng.sample(MONGO_KINDS if mongo else KINDS, rng.choice((1, 2)))]
    faulty = backend.store(proxy.port)
    endpoint = agent.endpoints.OpenAIChat(backend.model.url + "/v1", "test-model", max_retries=0)
    backend.model._script.clear()
    backend.model.push(*[_policy(sid)] * 200)
    steers = [f"steer {i} of {seed}" for i in range(2)]
    keys = [f"steer-{seed}-{i}" if seed % 2 == 0 else None for i in range(2)]  # no draw: seeds replay as before
    approving = rng.random() < 0.4  # the first turn asks for a transfer, which waits for approval
    turns = [(f"question {i} of {seed}" + (" (transfer)" if approving and i == 0 else ""), f"key-{seed}-{i}")
             for i in range(2)]
    try:
        _steer(out, faulty, backend.direct, sid, steers[0], keys[0])
        _turn(out, backend, faulty, sid, *turns[0], endpoint, waits=approving)
        if approving:
            _approve(out, backend, faulty, sid)
            _turn(out, backend, faulty, sid, *turns[0], endpoint)  # the approved call runs, the turn answers
        _steer(out, faulty, backend.direct, sid, steers[1], keys[1])
        _turn(out, backend, faulty, sid, *turns[1], endpoint)  # takes steer 1 before its first request
        _check(out, backend, sid, steers, [t for t, _ in turns])
        if approving:
            out.checks += 1
            # At most once: a transfer whose journal entry ("started") went unanswered is not run again by
            # the resume, which gives the model its unknown outcome instead (docs/runs/journal.md).
            if backend.paid[(sid, TRANSFER)] > 1:
                out.violations.append(f"the approved transfer ran {backend.paid[(sid, TRANSFER)]} times")
        if rng.random() < 0.3:
            _delete(out, faulty, backend.direct, sid)
    finally:
        out.fired = [f"{r.fault}@{r.nth}" for r in rules if r.fired]
        out.statements = len(proxy.statements)
        proxy.close()
        _close(faulty)
        backend.model._script.clear()
    return out


def _steer(out: Outcome, faulty: agent.Store, direct: agent.LifecycleStore, sid: str, text_: str,
           key: str | None) -> None:
    """The steer, then (when it failed) its retry on a worker that reaches the database directly, as
    docs/reliability.md says: a keyed one sent again as it was (``False``: it had landed)."""
    try:
        agent.open(sid, faulty).steer(text_, key=key)
    except agent.OutcomeUnknown:
        out.failed_ops.append("steer: outcome unknown")
        if key is not None:
            agent.open(sid, direct).steer(text_, key=key)
        # without a key, read back first: a blind retry could double it
        elif text_ not in direct.pending_steers(sid) and all(m.text != text_ for m in direct.messages(sid)):
            direct.add_steer(sid, text_)
    except agent.StoreError:
        out.failed_ops.append("steer: failed")
        agent.open(sid, direct).steer(text_, key=key)


def _turn(out: Outcome, backend: Backend, faulty: agent.EventStore, sid: str, question: str, key: str,
          endpoint: agent.endpoints.OpenAIChat, waits: bool = False) -> None:
    """The turn, then (when it failed) its resume: ``Runner.turn`` with the same key on a worker that
    reaches the database directly. ``waits``: it ends waiting for an approval."""
    expected = "awaiting_approval" if waits else "answered"

    def spec(store: agent.EventStore, wait: float) -> agent.Spec:
        return agent.Spec(session=agent.open(sid, store), tools=[backend.pay, backend.transfer],
                          lease_ttl=LEASE_TTL, lease_wait=wait, publish_events=True)

    try:
        result = agent.Runner().turn(spec(faulty, 0.0), question, key, endpoint)
        if result.stop_reason == expected:
            return
        out.violations.append(f"turn {key!r} ended {result.stop_reason!r} with no fault to explain it")
    except agent.AwaitingApproval:
        if waits:
            return  # its call waits for a decision: what it was to end with
        out.violations.append(f"turn {key!r} found a call waiting that was decided")
    except agent.AgentError as exc:
        out.failed_ops.append(f"turn: {type(exc).__name__}")
    out.resumes += 1
    started = time.monotonic()
    try:
        result = agent.Runner().turn(spec(backend.direct, RESUME_WAIT), question, key, endpoint)
        stop = result.stop_reason
    except agent.AwaitingApproval:
        stop = "awaiting_approval"
    waited = time.monotonic() - started
    out.checks += 2
    if stop != expected:
        out.violations.append(f"the resume of {key!r} ended {stop!r}")
    if waited > RESUME_WAIT + LEASE_TTL + 5:
        out.violations.append(f"the resume of {key!r} took {waited:.1f} s: the session was wedged")


def _approve(out: Outcome, backend: Backend, faulty: agent.EventStore, sid: str) -> None:
    """A person approves the waiting transfer; on a failure, again (safe to repeat: ``AlreadyDecided``
    then means the first landed)."""
    call = f"transfer-{sid}"
    try:
        agent.open(sid, faulty).approve(call)
        return
    except agent.AgentError as exc:
        out.failed_ops.append(f"approve: {type(exc).__name__}")
    try:
        agent.open(sid, backend.direct).approve(call)
    except agent.AlreadyDecided:
        pass
    out.checks += 1
    if agent.open(sid, backend.direct).pending_approvals():
        out.violations.append("the transfer still waits after its approval")


def _check(out: Outcome, backend: Backend, sid: str, steers: list[str], questions: list[str]) -> None:
    msgs = backend.direct.messages(sid)
    texts = [m.text for m in msgs if m.role == agent.Role.USER]
    for t in [*steers, *questions]:
        out.checks += 1
        if texts.count(t) != 1:
            out.violations.append(f"{t!r} is in the transcript {texts.count(t)} times")
    out.checks += 1
    if agent.orphaned_tool_calls(msgs):
        out.violations.append(f"calls without results: {agent.orphaned_tool_calls(msgs)}")
    for n in range(CALLS * len(questions)):
        out.checks += 1
        if backend.paid[(sid, n)] > 1:
            out.violations.append(f"pay({n}) ran {backend.paid[(sid, n)]} times")
    events = agent.open(sid, backend.direct).events(limit=1000)
    seen = [(e.kind, e.at) for e in events]
    out.checks += 2
    if len(seen) != len(set(seen)):
        out.violations.append(f"events written twice: {[k for k in seen if seen.count(k) > 1][:4]}")
    kinds = [e.kind for e in events]
    # A run ends with one of finished and failed. The log does not mark where a run begins, so: a
    # ``failed`` after a ``finished`` with nothing new between them is the same run's (the issue's
    # "finished, model_response, failed": the buffer written again). A new event between them (a decision
    # on an approval, a resumed run's tool call) is the next run's.
    # A ``failed`` right after a ``finished`` is a next run's that failed before its first step (at the
    # turn's read of the session, say: soak seed 2144548783 on MariaDB).
    for i, kind in enumerate(kinds):
        if kind != "finished":
            continue
        for j in range(i + 1, len(kinds)):
            if kinds[j] == "finished":
                break
            if kinds[j] == "failed":
                if j > i + 1 and all(seen[k] in seen[:i] for k in range(i + 1, j)):
                    out.violations.append(f"a run both finished and failed (events {i}, {j})")
                break


def _delete(out: Outcome, faulty: agent.LifecycleStore, direct: agent.LifecycleStore, sid: str) -> None:
    try:
        faulty.delete(sid)
    except agent.AgentError as exc:
        out.failed_ops.append(f"delete: {type(exc).__name__}")
        # Idempotent: safe to repeat as it is. A run whose release failed (its connection cut) leaves its
        # lease to expire, and until then a delete is refused with SessionBusy: wait out the ttl.
        deadline = time.monotonic() + RESUME_WAIT
        while True:
            try:
                direct.delete(sid)
                break
            except agent.SessionBusy:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    out.checks += 1
    if direct.messages(sid) or direct.info(sid) is not None:
        out.violations.append("the session outlived its delete")


def run(store: str, seeds: list[int], report: Callable[[Outcome], None] | None = None) -> dict[str, Any]:
    """Run the trials of ``seeds`` on ``store``; the counts (faults fired per kind, resumes, checks) and the
    violations with their seeds."""
    backend = Backend(store)
    fired: collections.Counter[str] = collections.Counter()
    failed: collections.Counter[str] = collections.Counter()
    totals = {"trials": 0, "faults_fired": 0, "resumes": 0, "checks": 0}
    violations: list[dict[str, Any]] = []
    try:
        for seed in seeds:
            try:
                out = trial(backend, seed)
            except Exception as exc:  # noqa: BLE001 - an error the resume could not absorb is a violation
                out = Outcome(seed, store, fired=["(see the replay)"], violations=[f"{type(exc).__name__}: {exc}"])
            totals["trials"] += 1
            totals["faults_fired"] += len(out.fired)
            totals["resumes"] += out.resumes
            totals["checks"] += out.checks
            fired.update(f.split("@")[0] for f in out.fired)
            failed.update(out.failed_ops)
            if out.violations:
                violations.append({"seed": seed, "fired": out.fired, "violations": out.violations})
            if report is not None:
                report(out)
    finally:
        backend.close()
    return {"store": store, **totals, "fired": dict(fired), "failed_ops": dict(failed), "violations": violations}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=("postgres", "mysql", "mongodb", "all"), default="all",
                        help="all: the SQL stores")
    parser.add_argument("--seed", type=int, help="replay this one trial")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=None, help="seeds from here on (default: random)")
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args(argv)
    # SQLAlchemy's pool logs, at ERROR, each ROLLBACK it could not send on a connection the proxy cut: here
    # that is the point, and thousands of tracebacks would hide the report.
    logging.getLogger("sqlalchemy.pool").setLevel(logging.CRITICAL)
    first = args.first_seed if args.first_seed is not None else random.SystemRandom().randrange(2**31)
    seeds = [args.seed] if args.seed is not None else list(range(first, first + args.trials))
    stores = ["postgres", "mysql"] if args.store == "all" else [args.store]

    def report(out: Outcome) -> None:
        if out.violations or args.seed is not None:
            print(f"seed {out.seed} on {out.store}: fired {out.fired}, failed {out.failed_ops}, "
                  f"resumes {out.resumes}, violations {out.violations}", flush=True)

    results = []
    for store in stores:
        started = time.monotonic()
        result = run(store, seeds, report)
        result["seconds"] = round(time.monotonic() - started, 1)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "violations"}), flush=True)
        print(f"{store}: {len(result['violations'])} trial(s) with violations", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 1 if any(r["violations"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
