"""The model-based concurrency machine's parts: the operations it issues (all public API), the reference
model of what may have happened, and the invariants checked against it (``storetest.model`` runs it per
store; ``tests/soak.py`` loops it for hours). docs/reliability.md, "The model-based concurrency test", says
how a program is drawn, what is watched and each invariant.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import agent_sessions as agent
from agent_sessions import Content, Message, Role, Store, Tool
from agent_sessions.context import Compaction
from agent_sessions.contract import ApprovalStore, CancelWatcher, EventStore, LifecycleStore, RunStore
from agent_sessions.journal import Journal

from . import processes
from .capabilities import Capability
from .mixin import Crash

HOLD = 20.0
"""Seconds a held operation waits to be let go, and the scheduler waits for it to reach its point."""
ROUND = 120.0
"""Seconds a round's operations have, all together, to end; past it the program stops with a violation."""
COMPACT_AT = 700
"""The context, in tokens (of 4 bytes), of a session that compacts: a turn or two of the scripted model's
and the tools' schemas fill it, so a session's third or fourth turn asks for its first summary."""
CHILD = 90.0
"""Seconds a child process has to reach its tool, and then to report."""

RUNS = ("run", "turn", "redeliver", "resume", "crash", "kill", "freeze")
"""The kinds that run the loop (and so take the lease)."""
KINDS = (*RUNS, "recover", "steer", "steer_again", "cancel", "approve", "deny", "delete", "delete_force", "prune",
         "fork")
POLICIES = ("queue", "steer", "interrupt", "reject")
"""``Runner.turn``'s ``if_busy`` policies (docs/runs/busy.md): a turn draws one, its redeliveries keep it."""
EXEMPT = ("resume", "usable")
"""Kinds whose model requests may go on with a turn that ended: a resume is a person asking for exactly that
(``Runner.run`` on the stored transcript), and the program's last check is one."""

KNOWN: dict[str, str] = {}
"""The operation mixes that meet a bug still open on this branch, by name, each saying what it meets: what
``ModelContract.model_skip`` and ``scripts/soak --skip known`` leave out (or the check they relax)."""

FILTERS: dict[str, str] = {  # the operations of each mix: docs/reliability.md, "Mixes left out"
    "delete_near_run": "issue 29 #1: a delete or a prune in a round with a run of the session (any, for prune)",
    "redeliver_after_cancel": "issue 29 #2: a redelivery of a turn a cancel or max_steps stopped",
    "cancel_near_approval": "issue 29 #3: a cancel beside a run of a session whose turn waits for approval",
    "duplicate_call_ids": "issue 29 #4: a reply with two tool calls of one id: the second never runs",
    "surrogate_events": "issue 29 #5: a lone surrogate in a message of a run with publish_events",
    "absorbed_conflict": "issue 29 #7: a Runner.turn meeting another run's save reports failed, then finished",
    "delete_near_cancel": "NEW: a delete or a prune beside a cancel(): the SQL stores' acquire asserted the row",
    "concurrent_first_save": "issue 29 #11: two writers of a session that does not exist yet, in one round",
}
"""The mixes the machine left out while the bugs they met were open, all fixed now: kept so that a regression
seed replays the very program it failed (a mix left out makes its round drawn again)."""

ENDS = ("answered", "max_steps", "cancelled", "superseded")
"""The stop reasons that end a turn (``awaiting_approval`` does not: the turn goes on once decided)."""

INVARIANTS = ("pay_at_most_once", "approved_before_paid", "one_result_per_call", "steer_once",
              "no_reappearance", "cancel_stops_turn", "events_end_once", "typed_errors", "usable", "bounded",
              "turn_ends_once", "own_answer", "answered_or_waits", "within_budget", "compaction_in_range")


# -- the ledger: what the model and the tools did, from any thread or process ------------------------------


class Ledger:
    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, **record: Any) -> None:
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one write(2) of a short line in O_APPEND: never interleaved with another
        finally:
            os.close(fd)

    def read(self) -> list[dict[str, Any]]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        # What follows the last newline is a line still being written: a read(2) may see part of a write(2)
        # in progress (another thread's, a child's), never a line after it (O_APPEND writes come in turn).
        return [json.loads(line) for line in text.split("\n")[:-1] if line]


now = time.monotonic_ns
"""The machine's clock: CLOCK_MONOTONIC, one for every process of the host, so child processes' ledger lines
compare with the parent's."""


# -- the store, watched ------------------------------------------------------------------------------------


_PROTOCOLS: tuple[type, ...] = (Store, RunStore, ApprovalStore, LifecycleStore, EventStore, CancelWatcher)
_METHODS = sorted({n for p in _PROTOCOLS for n, v in vars(p).items() if callable(v) and not n.startswith("_")})


class _Watched:
    """Every call goes to the store under test. Noted on the calling thread: when the run last asked the
    store whether it was cancelled (``_CHECKING``; where the store pushes cancels, ``_Heeded``), and whether
    the current operation was refused the lease (it waits for it, or fails with SessionBusy)."""

    def __init__(self, store: Store, holds: list[Hold] | None = None) -> None:
        self._store = store
        self._local = threading.local()
        self.holds: list[Hold] = [] if holds is None else holds
        """Every lease an operation took through this proxy, in order."""

    def begin(self, op: Op | None) -> None:
        self._local.op = op
        self._local.checked = None

    def checked(self) -> int | None:
        value: int | None = getattr(self._local, "checked", None)
        return value

    def acquire(self, session: str, holder: agent.Holder, ttl: float) -> agent.Holder:
        got: agent.Holder = self._store.acquire(session, holder, ttl)  # type: ignore[attr-defined]
        op: Op | None = getattr(self._local, "op", None)
        if op is not None:
            (op.refused if got.token != holder.token else op.acquired).set()
            if got.token == holder.token:
                self.holds.append(Hold(session, op.n, got.token, now()))
                op.pause("acquire")  # "between acquire and the first save"
        return got

    def release(self, session: str, holder: agent.Holder) -> None:
        for hold in self.holds:
            if hold.token == holder.token and hold.released is None:
                hold.released = now()
        self._store.release(session, holder)  # type: ignore[attr-defined]

    def watch_cancel(self, session: str, holder: agent.Holder) -> Any:
        return _Heeded(self, self._store.watch_cancel(session, holder))  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"watched({self._store!r})"


class _Heeded:
    """A run's cancel watch, through ``_Watched``: an exact ``False`` (nothing was committed since the run's
    last read, SQLite) counts as a check made as it was asked; a pushed one (PostgreSQL) only says no
    notification was heard, so the last read stays the check (the documented bound)."""

    def __init__(self, proxy: _Watched, watch: Any) -> None:
        self._proxy = proxy
        self._watch = watch
        self._exact = bool(getattr(watch, "exact", False))

    def listening(self) -> object | None:
        listening: object | None = self._watch.listening()
        return listening

    def cancelled(self, since: object | None) -> bool | None:
        asked = now()  # before the answer: a cancel committed after this may go unseen, as after a read
        answer: bool | None = self._watch.cancelled(since)
        if answer is False and self._exact:
            self._proxy._local.checked = asked
        return answer

    def close(self) -> None:
        self._watch.close()


_CHECKING = {"check", "put_journal", "save_fenced", "save_fenced_events"}
"""The calls that answer whether the run was cancelled: each notes when it was made."""


def _passing(name: str) -> Callable[..., Any]:
    def method(self: _Watched, *args: Any, **kwargs: Any) -> Any:
        if name in _CHECKING:
            self._local.checked = now()
        return getattr(self._store, name)(*args, **kwargs)

    method.__name__ = name
    return method


def watched(store: Store, holds: list[Hold] | None = None) -> _Watched:
    """``store`` behind a ``_Watched`` offering exactly the protocol methods ``store`` has (so the library's
    isinstance checks answer as they would for the store itself)."""
    own = {"acquire", "release", "watch_cancel"}
    names = [n for n in _METHODS if callable(getattr(store, n, None))]
    cls = type("Watched", (_Watched,), {n: _passing(n) for n in names if n not in own})
    for name in own - set(names):
        setattr(cls, name, None)  # the store lacks it: so must the proxy  # pragma: no cover
    made: _Watched = cls(store, holds)
    return made


@dataclass
class Hold:
    """A lease an operation held: taken (the time noted just after), released (just before; ``None``: it
    was lost, or the run died holding it)."""

    sid: str
    op: int
    token: str
    acquired: int
    released: int | None = None


# -- operations --------------------------------------------------------------------------------------------


@dataclass
class Op:
    n: int
    kind: str
    sid: str
    worker: int
    script: str = "answer"
    hold: str | None = None
    """"acquire" (just after the lease is taken), "model" or "tool" (inside the first): the operation
    stops there until the scheduler lets it go."""
    crash: str | None = None
    lease_wait: float = 0.0
    text: str = ""
    key: str = ""
    publish: bool = False
    max_steps: int = 0
    """The spec's budget (0: not drawn yet). A redelivery has its turn's: the task is the same."""
    target: str = ""
    at: int | None = None
    policy: str = "queue"
    """A turn's ``if_busy`` (a redelivery's is its turn's)."""
    answer: str | None = None
    """The text of the answer a turn or a run returned (``stop_reason == "answered"``)."""
    end_tag: str | None = None
    """The input the op's run ended on (a turn's own message, a run's last input): that turn has ended."""
    also_ended: str | None = None
    """A steer a turn's run took after its own message, the newest input when it ended: ended with it."""
    swept: list[tuple[str, str, str, str | None]] = field(default_factory=list)
    """A sweep's sessions: (session, outcome, the run's stop reason, the input it ended on)."""
    began: int = 0
    ended: int = 0
    outcome: str = ""
    """"ok: <what>" or "error: <type>: <message>"."""
    error: BaseException | None = None
    stop_reason: str = ""
    steps: int = -1
    events: list[tuple[str, str]] = field(default_factory=list)
    """(event class, its stop reason or error type): what the op's events callable received."""
    reached: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)
    refused: threading.Event = field(default_factory=threading.Event)
    acquired: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def describe(self) -> str:
        extra = [f"script={self.script}" if self.kind in RUNS else "",
                 f"if_busy={self.policy}" if self.kind in ("turn", "redeliver") and self.policy != "queue" else "",
                 f"max_steps={self.max_steps}" if self.max_steps else "", f"text={self.text}" if self.text else "",
                 f"hold={self.hold}" if self.hold else "", f"crash={self.crash}" if self.crash else "",
                 f"lease_wait={self.lease_wait}" if self.lease_wait else "", f"key={self.key}" if self.key else "",
                 "publish_events" if self.publish else "", f"target={self.target} at={self.at}" if self.target else ""]
        return (f"op {self.n} [{self.kind} {self.sid[-2:]} w{self.worker}] " + " ".join(e for e in extra if e)
                + f" -> {self.outcome}")

    def pause(self, where: str) -> None:
        if self.hold == where and not self.reached.is_set():
            self.reached.set()
            self.go.wait(HOLD)


SCRIPTS: dict[str, tuple[int, list[tuple[str, bool]]]] = {
    "answer": (0, []),
    "pay": (1, [("pay", False)]),
    "lookup_pay": (1, [("lookup", False), ("pay", False)]),
    "pay_twice": (2, [("pay", False)]),
    "approve_pay": (1, [("lookup", False), ("pay", True)]),
    "duplicate_ids": (1, [("pay", False), ("pay", False)]),
    "charge_on": (99, [("pay", False)]),
}
"""Per script: how many replies of a turn call tools, and the calls of each (tool, needs approval)."""


TAGS = ("u-", "t-", "s-")


def last_tag(messages: Sequence[Message]) -> str | None:
    """The tag of the newest message the test gave (``u-`` a run's, ``t-`` a turn's, ``s-`` a steer's) in
    ``messages``: which input a model request answers. A compaction record is no input."""
    for m in reversed(messages):
        if m.role is Role.USER and m.text.startswith(TAGS) and not any(
                c.type is agent.ContentType.COMPACTION for c in m.content):
            return m.text.split()[0]
    return None


def turn_of(messages: Sequence[Message]) -> tuple[str | None, int]:
    """The turn the transcript is in (the tag of the last message the test itself gave: ``u-`` from a run,
    ``t-`` from Runner.turn; steers are ``s-``) and how many replies with tool calls it has had."""
    made = 0
    for m in reversed(messages):
        if m.role is Role.ASSISTANT and m.tool_calls:
            made += 1
        elif m.role is Role.USER and m.text.startswith(("u-", "t-")):
            return m.text.split()[0], made
    return None, made


class Scripted:
    """The model of one operation. Picklable (a child process gets one)."""

    def __init__(self, op: Op | None, ledger: Ledger, sid: str, n: int, script: str, crash: str | None,
                 kind: str = "") -> None:
        self.op = op
        self.kind = kind
        self.ledger = ledger
        self.sid = sid
        self.n = n
        self.script = script
        self.crash = crash
        self.asked = 0
        """Requests made: names each call apart, though one operation may serve two turns (one left unfinished
        before its own)."""

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "op": None}

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[Tool]) -> Message:
        # the request is made here: noted before the hold, so a request in flight when another op ended its
        # turn is seen as made before that end
        self.ledger.write(t="ask", sid=self.sid, turn=last_tag(messages), op=self.n, kind=self.kind,
                          crash=self.crash == "model", at=now())
        if self.op is not None:
            self.op.pause("model")
        if self.crash == "model":
            raise Crash("killed while waiting for the model")
        tag, made = turn_of(messages)
        self.asked += 1
        rounds, calls = SCRIPTS[self.script]
        if tag is None or made >= rounds:
            odd = " lone \ud800 surrogate" if self.op is not None and "\ud800" in self.op.text else ""
            return Message.assistant(f"a-{self.n}-{made} {tag}{odd}")  # the surrogate mix: in the reply too
        content = []
        for i, (name, ask) in enumerate(calls):
            order = f"c{self.n}-{self.asked}-{i}"  # what the call is for: its own, even where two calls share an id
            call_id = f"c{self.n}-{self.asked}-0" if self.script == "duplicate_ids" else order
            self.ledger.write(t="reply", sid=self.sid, call=order, turn=tag, input=last_tag(messages), op=self.n,
                              kind=self.kind, at=now())
            content.append(Content.tool_call(call_id, name, json.dumps(
                {"sid": self.sid, "turn": tag, "order": order, "ask": ask})))
        return Message(Role.ASSISTANT, content)


class Summariser:
    """The summary model of a run under ``Compaction``: a short summary, or (every third request of an
    operation) a failed request, which leaves the transcript as it was and the run going on."""

    def __init__(self, ledger: Ledger, sid: str, n: int) -> None:
        self.ledger, self.sid, self.n, self.asked = ledger, sid, n, 0

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[Tool]) -> Message:
        self.asked += 1
        self.ledger.write(t="summary", sid=self.sid, op=self.n, at=now())
        if (self.n + self.asked) % 3 == 0:
            raise agent.EndpointError("the summary model is down")
        return Message.assistant(f"sum-{self.n}-{self.asked}")


def _order(arguments: str) -> str:
    """What a call of the scripted model is for (its ``order`` argument): the ledger's name of the call,
    which stays its own where the library gave a call of a repeated id an id of its own."""
    return str(json.loads(arguments)["order"])


def tools_of(store: _Watched, ledger: Ledger, op: Op | None, n: int, kind: str, crash: str | None,
             hang: str | None = None, workdir: str = "") -> list[Tool]:
    """``pay`` (not idempotent; needs approval when its call says ``ask``) and ``lookup`` (idempotent):
    each start goes to the ledger with the time the run last checked for a cancel before it."""

    def effect(tool: str, done: str) -> Callable[..., str]:
        def run(sid: str, turn: str, order: str, ask: bool = False) -> str:
            ledger.write(t="start", tool=tool, sid=sid, call=order, turn=turn, ask=ask, op=n, kind=kind,
                         checked=store.checked(), at=now())
            if op is not None:
                op.pause("tool")
            if crash == "tool":
                raise Crash("killed inside a tool")
            if hang == "kill":
                time.sleep(CHILD)  # SIGKILLed in here
            elif hang == "freeze":
                go = Path(workdir) / f"go-{n}"
                deadline = time.monotonic() + CHILD
                while not go.exists() and time.monotonic() < deadline:  # SIGSTOPped in here, then let go
                    time.sleep(0.01)
            return f"{done} {order}"

        return run

    pay = agent.tool(name="pay", idempotent=False, needs_approval=lambda a: bool(a.get("ask")))
    return [pay(effect("pay", "paid")), agent.tool(name="lookup")(effect("lookup", "found"))]


def _summary(event: object) -> tuple[str, str]:
    if isinstance(event, agent.events.Finished):
        return "Finished", event.result.stop_reason
    if isinstance(event, agent.events.Failed):
        return "Failed", type(event.error).__name__
    return type(event).__name__, ""


# -- a child process: the run that is killed or frozen inside its tool ---------------------------------------


def child_run(factory: Callable[[], Store], sid: str, workdir: str, n: int, kind: str, text: str, out: Any,
              max_steps: int = 4) -> None:
    events: list[tuple[str, str]] = []
    try:
        store = watched(factory())
        ledger = Ledger(Path(workdir) / "ledger")
        spec = agent.Spec(session=agent.open(sid, store), max_steps=max_steps, lease_ttl=1.0,  # type: ignore[arg-type]
                          lease_wait=3.0, name="model:pay",
                          tools=tools_of(store, ledger, None, n, kind, None, hang=kind, workdir=workdir))
        msgs = [*store.messages(sid), Message.user(text)]  # type: ignore[attr-defined]
        result = agent.Runner().run(spec, msgs, Scripted(None, ledger, sid, n, "pay", None, kind),
                                    lambda e: events.append(_summary(e)))
        out.put(("ok", result.stop_reason, result.steps, last_tag(result.messages) or "", events))
    except agent.AgentError as exc:
        out.put(("error", type(exc).__name__, -1, str(exc), events))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which counts it a violation
        out.put(("error", type(exc).__name__, -1, traceback.format_exc(), events))


# -- the machine ---------------------------------------------------------------------------------------------


@dataclass
class Report:
    """What programs tried and checked; ``merge`` adds another's."""

    programs: int = 0
    tried: Counter[str] = field(default_factory=Counter)
    checks: Counter[str] = field(default_factory=Counter)
    left_out: Counter[str] = field(default_factory=Counter)
    violations: list[tuple[int, str, str]] = field(default_factory=list)
    """(seed, invariant, detail)."""

    def merge(self, other: Report) -> None:
        self.programs += other.programs
        self.tried.update(other.tried)
        self.checks.update(other.checks)
        self.left_out.update(other.left_out)
        self.violations.extend(other.violations)

    def to_json(self) -> dict[str, Any]:
        return {"programs": self.programs, "tried": dict(sorted(self.tried.items())),
                "checks": dict(sorted(self.checks.items())), "left_out": dict(sorted(self.left_out.items())),
                "violations": [{"seed": s, "invariant": i, "detail": d} for s, i, d in self.violations]}


_EXPECTED: dict[str, tuple[type[BaseException], ...]] = {
    # Conflict: SessionBusy, LeaseLost, TranscriptConflict, AwaitingApproval: each says why the run did not go on.
    **{k: (agent.Conflict,) for k in ("run", "turn", "redeliver", "resume", "kill", "freeze")},
    "crash": (agent.Conflict, Crash),
    **{k: () for k in ("steer", "steer_again", "recover", "cancel", "delete_force", "prune")},
    **{k: (agent.AlreadyDecided, agent.UnknownApproval) for k in ("approve", "deny")},
    "delete": (agent.SessionBusy,),
    "fork": (agent.ArgumentError, agent.SessionExists),  # the source was deleted meanwhile
}


class Machine:
    """One program: ``run()`` draws and runs ``ops`` operations from ``seed`` and returns its Report."""

    def __init__(self, seed: int, make_store: Callable[[], Store], capabilities: frozenset[Capability],
                 process_factory: Callable[[], Store] | None, workdir: Path, ops: int, skip: frozenset[str],
                 replay: bool = False) -> None:
        unknown = skip - set(KNOWN) - set(FILTERS)
        if unknown:
            raise agent.ArgumentError(f"model_skip names no known mix: {sorted(unknown)} "
                                      f"(known: {sorted(KNOWN) + sorted(FILTERS)})")
        self.new = not replay
        """Draw every operation. A replay (a regression seed) draws only those the machine had when the seed
        failed, with the same draws: the same seed is then the same program."""
        self.seed = seed
        self.rng = random.Random(seed)
        self.factory = process_factory if Capability.PROCESSES in capabilities else None
        self.workdir = workdir
        self.ops = ops
        self.skip = skip
        self.ledger = Ledger(workdir / "ledger")
        durable = Capability.DURABLE in capabilities
        first = make_store()
        self.workers = 3
        self.holds: list[Hold] = []
        self.stores = [watched(first, self.holds)] + [watched(make_store() if durable else first, self.holds)
                                                      for _ in range(self.workers - 1)]
        self.checker: Any = self.stores[0]
        self.lifecycle = Capability.LIFECYCLE in capabilities and isinstance(first, LifecycleStore)
        self.approvals = Capability.APPROVALS in capabilities and isinstance(first, ApprovalStore)
        self.events = Capability.EVENTS in capabilities and isinstance(first, EventStore)
        self.tag = uuid.uuid4().hex[:8]
        self.sessions = [f"model-{self.tag}-{i}" for i in range(self.rng.choice([2, 2, 3]))]
        self.budget: dict[str, int] = {}
        """Per session, the ``max_steps`` of every spec that runs it (a run's, a turn's, the sweep's): the
        application's one spec for the conversation, so a turn's budget is the same whoever runs it."""
        self.compact: dict[str, bool] = {}
        """Per session: its specs compact (``Compaction`` with a summary model of its own)."""
        for sid in self.sessions if self.new else ():
            self.budget[sid] = self.rng.choice([1, 2, 3, 4, 4])
            self.compact[sid] = self.rng.random() < 0.35
        self.report = Report(programs=1)
        self.log: list[str] = []
        self.count = 0
        # the reference model
        self.steers: dict[str, list[tuple[str, int]]] = {}
        self.steers_gone: dict[str, int] = {}
        """When each session was last deleted (or may have been pruned): steers posted before may be gone."""
        self.keys: dict[str, list[Op]] = {}
        self.cancels: list[tuple[str, int, int, frozenset[str]]] = []
        """cancel() calls that returned True: session, called, returned, the calls of a turn waiting for
        approval then (which that cancel closed)."""
        self.cancel_rounds: dict[str, list[int]] = {}
        self.dead: dict[str, list[tuple[set[str], int]]] = {}
        self.stopped_turns: dict[tuple[str, str], list[tuple[int, int, str]]] = {}
        """Per turn, the ops whose run it stopped short of an answer: (op, ended, stop reason)."""
        self.given: dict[tuple[str, str], list[int]] = {}
        """Per (session, user text), when each op that gave it ended. A text of a deleted session may come back
        with an op still in flight at the delete (or begun after it): a delivery reading the session after the
        delete, or one whose read found it empty, begins the conversation anew with its own message, which it
        never read from the erased session. Everything else of the erased session it cannot bring back."""
        self.decisions: dict[tuple[str, str], tuple[bool, int]] = {}
        self.ended: dict[tuple[str, str], list[tuple[int, int, str, int]]] = {}
        """Per (session, input tag), the runs that returned having ended on it: (when, op, stop reason, when the op
        began: a delete since then may have erased what it ended, and a delivery then begins anew). No
        model request or tool start of that input may come after (``turn_ends_once``)."""
        self.accepted: dict[tuple[str, str], tuple[str, int]] = {}
        """Per (session, key) of a turn's message or a keyed steer the store took: (its text, when the first
        delivery began)."""
        self.keyed_steers: dict[str, list[Op]] = {}
        self.began_of: dict[int, int] = {}
        self.interrupts: dict[str, int] = {}
        """Per session: how many cancels (a cancel() that said True, an "interrupt") it has had."""
        self.stopped = False
        self.seen: set[tuple[str, object]] = set()

    # -- drawing ---------------------------------------------------------------------------------------

    def _kinds(self) -> list[tuple[str, float]]:
        if self.new:
            kinds = [("run", 3), ("turn", 4), ("redeliver", 2.5), ("resume", 1), ("crash", 1.2), ("steer", 2),
                     ("steer_again", 1), ("cancel", 1.5), ("fork", 0.7)]
            if self.lifecycle:
                kinds += [("recover", 2.5), ("delete", 0.7), ("delete_force", 0.5), ("prune", 0.4)]
            if self.approvals:
                kinds += [("approve", 2.5), ("deny", 0.7)]
            if self.factory is not None:
                kinds += [("kill", 0.4), ("freeze", 0.4)]
            return kinds
        kinds = [("run", 4), ("turn", 3), ("redeliver", 2), ("resume", 2), ("crash", 1.5), ("steer", 3),
                 ("cancel", 2.5), ("fork", 1)]
        if self.approvals:
            kinds += [("approve", 2.5), ("deny", 1)]
        if self.lifecycle:
            kinds += [("delete", 1), ("delete_force", 1), ("prune", 0.7)]
        if self.factory is not None:
            kinds += [("kill", 0.4), ("freeze", 0.4)]
        return kinds

    def _draw_op(self, worker: int, near: str | None) -> Op:
        kinds = self._kinds()
        kind = self.rng.choices([k for k, _ in kinds], [w for _, w in kinds])[0]
        self.count += 1
        n = self.count
        # the round's later ops mostly meet its first one's session: that is where the races are
        sid = near if near is not None and self.rng.random() < 0.6 else self.rng.choice(self.sessions)
        op = Op(n, kind, sid, worker)
        if kind in ("run", "turn", "resume", "crash", "redeliver"):
            scripts = [("answer", 2), ("pay", 3), ("lookup_pay", 2), ("pay_twice", 1)]
            if self.new:
                scripts.append(("charge_on", 2))
            if self.approvals:
                scripts.append(("approve_pay", 3))
            if "duplicate_call_ids" not in self.skip:
                scripts.append(("duplicate_ids", 1))
            op.script = self.rng.choices([s for s, _ in scripts], [w for _, w in scripts])[0]
            op.lease_wait = self.rng.choice([0.0, 3.0])
            op.publish = self.events and self.rng.random() < 0.3
        if kind == "crash":
            op.crash = self.rng.choice(["model", "tool"])
        if kind in ("run", "kill", "freeze"):
            op.text = f"u-{self.tag}-{n}"
            if kind == "run" and op.publish and "surrogate_events" not in self.skip and self.rng.random() < 0.3:
                op.text += " lone \ud800 surrogate"
        if kind in ("turn", "crash"):
            op.text, op.key = f"t-{self.tag}-{n}", f"k-{self.tag}-{n}"
        if kind == "turn" and self.new:
            op.policy = self.rng.choices(POLICIES, [4, 3, 2, 1.5])[0]
        if kind == "steer":
            op.text = f"s-{self.tag}-{n}"
            if self.new and self.rng.random() < 0.5:
                op.key = f"sk-{self.tag}-{n}"
        if kind == "fork":
            op.target = f"model-{self.tag}-f{n}"
            op.at = self.rng.choice([None, None, 1, 3])
            if self.new and op.target not in self.budget:  # the same conversation: the same spec
                self.budget[op.target] = self.budget.get(sid, 4)
                self.compact[op.target] = self.compact.get(sid, False)
        return op

    def _pick_redelivery(self, op: Op, round_ops: list[Op]) -> bool:
        """Point a redelivery at an earlier turn of its session (drawn at the round's start); False when
        there is none it may use."""
        turns = self.keys.get(op.sid, [])
        if "redeliver_after_cancel" in self.skip:
            if any(o.kind == "cancel" and o.sid == op.sid for o in round_ops):
                return False
            cancelled_since = self.cancel_rounds.get(op.sid, [])
            turns = [t for t in turns if t.stop_reason not in ("cancelled", "max_steps")
                     and not any(c >= t.began for c in cancelled_since)]
        if not turns:
            return False
        turns = sorted(turns, key=lambda t: t.n)  # stopped turns more often: what a redelivery must not go on with
        first = self.rng.choices(turns, [3 if t.stop_reason in ("cancelled", "max_steps") else 1 for t in turns])[0]
        op.text, op.key, op.max_steps, op.policy = first.text, first.key, first.max_steps, first.policy
        return True

    def _pick_steer(self, op: Op) -> bool:
        """Point a steer sent again at an earlier keyed steer of its session; False when there is none."""
        sent = self.keyed_steers.get(op.sid, [])
        if not sent:
            return False
        first = self.rng.choice(sent)
        op.text, op.key = first.text, first.key
        return True

    def _mix(self, ops: list[Op], journals: dict[str, bool], empty: dict[str, bool]) -> str | None:
        """The known mix (in ``self.skip``) this round would meet, or None."""
        runs = [o for o in ops if o.kind in RUNS]
        cancels = [o for o in ops if o.kind == "cancel"]
        pruned = any(o.kind == "prune" for o in ops)
        deleted = {o.sid for o in ops if o.kind in ("delete", "delete_force")}
        for mix, near in (("delete_near_run", runs), ("delete_near_cancel", cancels)):
            if mix in self.skip and near and (pruned or any(o.sid in deleted for o in near)):
                return mix
        if "cancel_near_approval" in self.skip:
            for c in cancels:
                near = [r for r in runs if r.sid == c.sid]
                if near and (journals.get(c.sid) or any(r.script == "approve_pay" for r in near)):
                    return "cancel_near_approval"
        if "concurrent_first_save" in self.skip:
            writers = Counter(o.sid for o in ops if o.kind in (*RUNS, "steer"))
            if any(n > 1 and empty.get(sid, True) for sid, n in writers.items()):
                return "concurrent_first_save"
        return None

    def _draw_round(self) -> list[Op]:
        journals = {s: self.checker.journal(s) is not None for s in self.sessions}
        empty = {s: not self.checker.messages(s) for s in self.sessions}
        size = self.rng.choice([1, 2, 2, 3, 3])
        ops: list[Op] = []
        for worker in range(size):
            for _ in range(20):
                op = self._draw_op(worker, ops[0].sid if ops else None)
                candidate = [*ops, op]
                if op.kind == "redeliver" and not self._pick_redelivery(op, candidate):
                    self.report.left_out["redeliver: no turn to redeliver"] += 1
                    continue
                if op.kind == "steer_again" and not self._pick_steer(op):
                    self.report.left_out["steer_again: no keyed steer to send again"] += 1
                    continue
                mix = self._mix(candidate, journals, empty)
                if mix is None:
                    ops.append(op)
                    break
                self.report.left_out[mix] += 1
        children = [o for o in ops if o.kind in ("kill", "freeze")]
        if children:  # one child process per round, first: the others land while it is in its tool
            ops = [children[0], *(o for o in ops if o.kind not in ("kill", "freeze"))]
            for i, o in enumerate(ops):
                o.worker = i
        if self.new and ops[0].kind == "recover" and len(ops) < 3 and self.rng.random() < 0.6:
            # sweeps from several workers at once, as every replica of a deployment runs one
            self.count += 1
            ops.append(Op(self.count, "recover", ops[0].sid, len(ops)))
        holdable = ("run", "turn", "redeliver", "resume", *(("recover",) if self.new else ()))
        if len(ops) > 1 and ops[0].kind in holdable and self.rng.random() < 0.7:
            ops[0].hold = self.rng.choice(["acquire", "model", "tool"])
        return ops

    # -- running -----------------------------------------------------------------------------------------

    def run(self) -> Report:
        try:
            done = 0
            while done < self.ops and not self.stopped:
                ops = self._draw_round()
                done += len(ops)
                self._run_round(ops)
                self.check_all()
            if not self.stopped:
                self.check_usable()
                self.check_all()
            if self.new and self.lifecycle and not self.stopped:
                for sid in self.sessions:  # the next program's sweeps list only their own
                    self.checker.delete(sid, force=True)
        except Exception:  # noqa: BLE001 - the machine's own failure is a violation with its seed, not a crash
            self.violate("bounded", "the machine itself raised:\n" + traceback.format_exc())
        return self.report

    def violate(self, invariant: str, detail: str, key: object = None) -> None:
        """Record a violation once: a later round seeing the same one again (``key``) adds nothing."""
        if key is not None:
            if (invariant, key) in self.seen:
                return
            self.seen.add((invariant, key))
        self.report.violations.append((self.seed, invariant, detail))

    def _run_round(self, ops: list[Op]) -> None:
        for op in ops:
            self.report.tried[op.kind] += 1
            if op.hold:
                self.report.tried[f"{op.kind} held in {op.hold}"] += 1
        threads = [threading.Thread(target=self._execute, args=(op,), name=f"model-op-{op.n}", daemon=True)
                   for op in ops]
        held, others = ops[0], ops[1:]
        deadline = time.monotonic() + ROUND
        threads[0].start()
        if held.hold or held.kind in ("kill", "freeze"):
            _wait(lambda: held.reached.is_set() or held.done.is_set(), HOLD if held.hold else CHILD)
        for t in threads[1:]:
            t.start()
        # let the held one go once every other op has ended or waits for the lease it holds
        _wait(lambda: all(o.done.is_set() or (o.refused.is_set() and not o.acquired.is_set()) for o in others),
              HOLD)
        held.go.set()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [op for op, t in zip(ops, threads, strict=True) if t.is_alive()]
        for op in ops:
            self.log.append(op.describe())
            self._absorb(op)
        if stuck:
            self.violate("bounded", f"ops {[o.n for o in stuck]} did not end within {ROUND} s")
            self.stopped = True
        self.report.checks["bounded"] += 1

    def _spec(self, op: Op, store: _Watched, sid: str | None = None) -> agent.Spec:
        sid = sid or op.sid
        if self.new:
            op.max_steps = self.budget.get(sid, 4)
        elif not op.max_steps:
            # a turn stopped at max_steps, which its redelivery (the same task: the same spec) must not go on with
            op.max_steps = 1 if op.kind == "turn" and op.script != "answer" and op.n % 4 == 1 else 4
        context = Compaction(COMPACT_AT, endpoint=Summariser(self.ledger, sid, op.n)) if self.compact.get(sid) else None
        return agent.Spec(session=agent.open(sid, store),  # type: ignore[arg-type]
                          tools=tools_of(store, self.ledger, op, op.n, op.kind, op.crash),
                          max_steps=op.max_steps, lease_ttl=5.0, lease_wait=op.lease_wait, publish_events=op.publish,
                          name=f"model:{op.script}" if self.new else None, context=context)

    def _execute(self, op: Op) -> None:
        store = self.stores[op.worker]
        store.begin(op)
        op.began = now()
        session = agent.open(op.sid, store)  # type: ignore[arg-type]
        try:
            op.outcome = "ok: " + self._perform(op, store, session)
        except BaseException as exc:  # noqa: BLE001 - judged by typed_errors
            op.error = exc
            op.outcome = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            if not isinstance(exc, _EXPECTED[op.kind]):
                op.outcome += "\n" + traceback.format_exc()
        finally:
            op.ended = now()
            op.reached.set()
            op.done.set()
            store.begin(None)

    def _perform(self, op: Op, store: _Watched, session: agent.StoreSession) -> str:
        events: Callable[[object], None] = lambda e: op.events.append(_summary(e))  # noqa: E731
        endpoint = Scripted(op, self.ledger, op.sid, op.n, op.script, op.crash, op.kind)
        if op.kind == "run":
            result = agent.Runner().run(self._spec(op, store), [*session.messages(), Message.user(op.text)],
                                        endpoint, events)
        elif op.kind in ("turn", "redeliver", "crash"):
            result = agent.Runner().turn(self._spec(op, store), op.text, op.key, endpoint, events, op.policy)  # type: ignore[arg-type]
        elif op.kind == "resume":
            msgs = session.messages()
            if not msgs:
                return "nothing to resume"
            result = agent.Runner().run(self._spec(op, store), msgs, endpoint, events)
        elif op.kind in ("kill", "freeze"):
            return self._child(op, session)
        elif op.kind == "steer":
            self.steers.setdefault(op.sid, []).append((op.text, now()))  # before: a delete may come between
            if op.key:
                self.keyed_steers.setdefault(op.sid, []).append(op)
                return f"{op.text}: {session.steer(op.text, key=op.key)}"
            session.steer(op.text)
            return op.text
        elif op.kind == "steer_again":
            return f"{op.text} again: {session.steer(op.text, key=op.key)}"
        elif op.kind == "recover":
            return self._sweep(op, store)
        elif op.kind == "cancel":
            closing = frozenset(self._waiting_calls(op.sid))
            a = now()
            got = session.cancel()
            if got:
                self.cancels.append((op.sid, a, now(), closing))
                self.interrupts[op.sid] = self.interrupts.get(op.sid, 0) + 1
            return str(got)
        elif op.kind in ("approve", "deny"):
            waiting = session.pending_approvals()
            if not waiting:
                return "nothing waits"
            call = waiting[0].call_id
            began = now()
            decision = session.approve(call) if op.kind == "approve" else session.deny(call, "model says no")
            self.decisions[(op.sid, _order(waiting[0].arguments))] = (decision.approved, began)
            return f"{op.kind}d {call}"
        elif op.kind in ("delete", "delete_force", "prune"):
            victims = [op.sid] if op.kind != "prune" else list(self.sessions)
            before = {s: texts(self.checker.messages(s)) for s in victims}
            if op.kind == "prune":
                pruned = session.store.prune(idle_for=self.rng.choice([0.0, 0.0, 0.2]))  # type: ignore[attr-defined]
                gone = [s for s in victims if before[s] and not self.checker.messages(s)]
                outcome = f"pruned {pruned}: {[s[-2:] for s in gone]}"
            else:
                deleted = session.delete(force=op.kind == "delete_force")
                gone = [op.sid] if deleted else []
                outcome = f"deleted {deleted}"
            for s in gone:
                self.dead.setdefault(s, []).append((before[s], now()))
            for s in victims if op.kind == "prune" else gone:
                self.steers_gone[s] = now()  # the steers waiting then may have gone with the session
            return outcome
        elif op.kind == "fork":
            session.fork(op.target, op.at, allow_unanswered=False)
            if op.target not in self.sessions and len(self.sessions) < 5:
                self.sessions.append(op.target)
            return f"forked to {op.target[-3:]}"
        else:  # pragma: no cover
            raise AssertionError(op.kind)
        op.stop_reason, op.steps = result.stop_reason, result.steps
        if result.stop_reason == "answered":
            op.answer = result.text
        # the input the run ended on: a turn's own message (the answer that covers it, for a steer), else the
        # newest input its transcript holds; a turn that ran also ends the steers it took (its transcript's
        # newest input). One that returned a stored outcome (no request) may read another turn's input since.
        own = op.text.split()[0] if op.kind in ("turn", "redeliver", "crash") else None
        op.end_tag = own or last_tag(result.messages)
        if own and result.steps and last_tag(result.messages) not in (None, own):
            op.also_ended = last_tag(result.messages)
        return f"{result.stop_reason} after {result.steps} steps"

    def _sweep(self, op: Op, store: _Watched) -> str:
        """``agent.recover``, as a replica's sweep does (``grace=0``), finishing this program's sessions only (a
        store the suite shares holds other tests' sessions)."""
        def resolve(info: agent.SessionInfo) -> tuple[agent.Spec, Scripted] | None:
            if info.id not in self.sessions:
                return None
            script = (info.spec or "model:pay").split(":", 1)[-1]
            script = script if script in SCRIPTS else "pay"
            endpoint = Scripted(op, self.ledger, info.id, op.n, script, None, "recover")
            return self._spec(op, store, info.id), endpoint

        for r in agent.recover(store, resolve, grace=0.0):  # type: ignore[arg-type]
            if r.session not in self.sessions:
                continue
            result = r.result
            op.swept.append((r.session, r.outcome, result.stop_reason if result else "",
                             last_tag(result.messages) if result else None))
            self.report.tried[f"recover: {r.outcome}"] += 1
            if r.outcome == "failed" and not isinstance(r.error, agent.AgentError):
                op.error = r.error
        return ", ".join(f"{s[-2:]} {o} {why}".strip() for s, o, why, _ in op.swept) or "nothing stranded"

    def _waiting_calls(self, sid: str) -> list[str]:
        """The calls of the reply waiting in the journal for decisions, if one waits."""
        text = self.checker.journal(sid)
        if text is None:
            return []
        journal = Journal.from_json(text, sid)
        return [_order(c.arguments) for c in journal.reply.tool_calls] if journal.approvals else []

    def _child(self, op: Op, session: agent.StoreSession) -> str:
        assert self.factory is not None
        ctx = processes.context(self.factory)
        out = ctx.Queue()
        op.max_steps = self.budget.get(op.sid, 4)
        child = ctx.Process(target=child_run, args=(self.factory, op.sid, str(self.workdir), op.n, op.kind, op.text,
                                                    out, op.max_steps), daemon=True)
        child.start()
        try:
            in_tool = _wait(lambda: any(r["t"] == "start" and r["op"] == op.n for r in self.ledger.read())
                            or not child.is_alive(), CHILD)
            if not in_tool or not child.is_alive():
                return self._reported(op, out, "ended before its tool")
            try:  # it may have ended since it was seen alive (its tool done): then it is past its tool
                os.kill(child.pid or 0, signal.SIGKILL if op.kind == "kill" else signal.SIGSTOP)
            except ProcessLookupError:
                return self._reported(op, out, "ended before the signal")
            if op.kind == "kill":
                child.join(10)
                op.reached.set()
                return "killed in its tool"
            _wait(lambda: session.holder() is None, 15)  # its 1 s lease lapses on the store's clock
            op.reached.set()
            op.go.wait(HOLD)  # the round's other ops run now
            (self.workdir / f"go-{op.n}").touch()
            os.kill(child.pid or 0, signal.SIGCONT)
            return "frozen, continued: " + self._reported(op, out, "")
        finally:
            if child.is_alive():
                os.kill(child.pid or 0, signal.SIGCONT)
                child.join(CHILD)
            if child.is_alive():
                child.kill()
                child.join(10)

    def _reported(self, op: Op, out: Any, how: str) -> str:
        try:
            kind, what, steps, detail, events = out.get(timeout=CHILD)
        except Exception:  # noqa: BLE001 - queue.Empty, or the child died before it could say
            return f"{how}: no report"
        op.events = [(str(a), str(b)) for a, b in events]
        if kind == "ok":
            op.stop_reason, op.steps, op.end_tag = what, steps, detail or None
            return f"{how} {what}"
        if what not in ("SessionBusy", "LeaseLost", "TranscriptConflict", "AwaitingApproval"):
            op.error = RuntimeError(f"{what}: {detail}")
        else:
            op.error = agent.Conflict(f"{what}: {detail}")
        return f"{how} error {what}"

    def _absorb(self, op: Op) -> None:
        """Fold what the finished op did into the reference model, and judge its own outcome."""
        self.began_of[op.n] = op.began
        # a steer sent again after a delete is stored again: new input, as a delivery's message is
        if op.kind in ("run", "turn", "redeliver", "crash", "kill", "freeze", "steer_again") and op.text:
            self.given.setdefault((op.sid, op.text), []).append(op.ended)
        if op.kind in ("turn", "crash"):
            self.keys.setdefault(op.sid, []).append(op)
        if op.kind == "redeliver":
            for t in self.keys.get(op.sid, []):
                if t.key == op.key and op.stop_reason:
                    t.stop_reason = op.stop_reason
        if op.stop_reason in ("cancelled", "max_steps") and op.text:
            self.stopped_turns.setdefault((op.sid, op.text.split()[0]), []).append((op.n, op.ended, op.stop_reason))
        if op.kind == "cancel" and op.outcome == "ok: True":
            self.cancel_rounds.setdefault(op.sid, []).append(op.began)
        if op.kind in ("turn", "redeliver") and op.policy == "interrupt":
            self.interrupts[op.sid] = self.interrupts.get(op.sid, 0) + 1
        for on in (op.end_tag, op.also_ended) if op.stop_reason in ENDS else ():
            if on:
                self.ended.setdefault((op.sid, on), []).append((op.ended, op.n, op.stop_reason, op.began))
        for swept, _, why, ended_on in op.swept:
            if why in ENDS and ended_on:
                self.ended.setdefault((swept, ended_on), []).append((op.ended, op.n, why, op.began))
        if op.kind in ("turn", "redeliver", "crash", "steer", "steer_again") and op.key:
            self._accept(op)
        if op.answer is not None:
            self._check_own_answer(op)
        if op.kind == "fork" and op.error is None and op.at is None:
            # the whole transcript: the turns that had ended before it ended there too
            for (s, on), ends in list(self.ended.items()):
                if s == op.sid and any(at < op.began for at, _, _, _ in ends):
                    # a cancel is the source's: the fork's copy of that turn is open, to go on with
                    # and not one whose source was erased since it began (a delivery began anew)
                    self.ended.setdefault((op.target, on), []).extend(
                        e for e in ends if e[0] < op.began and e[2] != "cancelled"
                        and not self._erased(op.sid, e[3], op.began))
        self.report.checks["typed_errors"] += 1
        if op.error is not None and not isinstance(op.error, _EXPECTED[op.kind]):
            self.violate("typed_errors", f"{op.describe()}")
        self._check_events(op)

    def _erased(self, sid: str, since: int, until: int | None = None) -> bool:
        """Was the session deleted or pruned between ``since`` and ``until`` (or now)?"""
        return any(since < at and (until is None or at < until) for _, at in self.dead.get(sid, []))

    def _count(self, sid: str, key: str, text: str, msgs: Sequence[Message] | None = None,
               queued: Sequence[str] | None = None, pending: Sequence[str] | None = None) -> int:
        """How many times the message of ``key`` (``text``) is in the session: in its transcript (by its key, or
        its text where a steer lost its key), in its queue, among its steers waiting."""
        msgs = self.checker.messages(sid) if msgs is None else msgs
        queued = self.checker.queued(sid) if queued is None else queued
        pending = self.checker.pending_steers(sid) if pending is None else pending
        stored = sum(1 for m in msgs if m.role is Role.USER and (m.key == key or m.text == text))
        return stored + list(queued).count(key) + list(pending).count(text)

    def _accept(self, op: Op) -> None:
        """Note a message the store took: the op said so, or it is there."""
        if (op.sid, op.key) in self.accepted:
            return
        said = op.error is None or isinstance(op.error, agent.StillQueued)
        if said or self._count(op.sid, op.key, op.text):
            self.accepted[(op.sid, op.key)] = (op.text, op.began)

    def _check_own_answer(self, op: Op) -> None:
        """``own_answer`` (docs/reliability.md, "The invariants")."""
        if (op.kind not in ("run", "turn", "redeliver", "crash") or not op.text or "\ud800" in op.text
                or self._erased(op.sid, op.began)):
            return
        self.report.checks["own_answer"] += 1
        msgs = self.checker.messages(op.sid)
        mine = [i for i, m in enumerate(msgs)
                if m.role is Role.USER and ((op.key and m.key == op.key) or m.text == op.text)]
        after = msgs[mine[0] + 1:] if mine else []
        answer = next((m.text for m in after if m.role is Role.ASSISTANT and not m.tool_calls), None)
        if answer != op.answer:
            self.violate("own_answer", f"{op.describe()}: returned the answer {op.answer!r}; its message "
                         f"{'is not in the transcript' if not mine else f'(at {mine[0]}) is answered by {answer!r}'}",
                         (op.sid, op.n))

    def _check_events(self, op: Op) -> None:
        if op.kind not in RUNS or op.outcome == "ok: nothing to resume" or op.outcome.startswith("ok: killed"):
            return
        self.report.checks["events_end_once"] += 1
        events = op.events
        terminals = [e for e in events if e[0] in ("Finished", "Failed")]
        turn = op.kind in ("turn", "redeliver", "crash")
        if turn and not events and (op.steps == 0 or op.error is not None):
            return  # Runner.turn returned the stored answer, or refused before any run: no run, no events
        if "absorbed_conflict" in self.skip and turn and terminals and terminals[0] == ("Failed", "TranscriptConflict"):
            # the turn's own runs that met another delivery's save: drop their events, judge what is left
            self.report.left_out["absorbed_conflict (check relaxed)"] += 1
            last = max(i for i, e in enumerate(events) if e == ("Failed", "TranscriptConflict"))
            events = events[last + 1:]
            terminals = [e for e in events if e[0] in ("Finished", "Failed")]
            if not events and op.steps == 0:
                return
        ok = (len(terminals) == 1 and events[-1] == terminals[0]
              and (terminals[0] == ("Finished", op.stop_reason) if op.error is None
                   else terminals[0][0] == "Failed"))
        if not ok:
            self.violate("events_end_once", f"{op.describe()}: events {events}")

    # -- checking ------------------------------------------------------------------------------------------

    def check_all(self) -> None:
        ledger = self.ledger.read()
        transcripts = {s: self.checker.messages(s) for s in self.sessions}
        self._check_ledger(ledger)
        self._check_turns(ledger)
        for sid, msgs in transcripts.items():
            self._check_transcript(sid, msgs)
        if self.lifecycle:
            self._check_waiting(transcripts)

    def _check_turns(self, ledger: list[dict[str, Any]]) -> None:
        """``turn_ends_once`` and ``within_budget`` (docs/reliability.md, "The invariants")."""
        # a tool start is of the input its reply answered; a reply a resume made is the resume's to go on with
        inputs = {(r["sid"], r["call"]): None if r.get("kind") in EXEMPT else r.get("input")
                  for r in ledger if r["t"] == "reply"}
        self.report.checks["turn_ends_once"] += 1
        for r in ledger:
            if r["t"] not in ("ask", "start") or r["kind"] in EXEMPT:
                continue
            tag = r["turn"] if r["t"] == "ask" else inputs.get((r["sid"], r["call"]))
            for ended, n, why, began in self.ended.get((r["sid"], tag), []) if tag else []:
                if r["at"] > ended and not self._erased(r["sid"], began, r["at"]):
                    what = "asked the model" if r["t"] == "ask" else f"started {r['tool']} {r['call']}"
                    self.violate("turn_ends_once", f"session {r['sid']}: op {n} returned {why} on input {tag}, then "
                                 f"op {r['op']} ({r['kind']}) {what} for it", (r["sid"], tag, r["op"], r["t"]))
        self.report.checks["within_budget"] += 1
        total: Counter[tuple[str, str, int]] = Counter()
        lost: Counter[tuple[str, str, int]] = Counter()
        each: Counter[tuple[int, str, str]] = Counter()
        for r in ledger:
            if r["t"] != "ask" or not r["turn"]:
                continue
            sid, tag = r["sid"], r["turn"]
            each[(r["op"], sid, tag)] += 1
            if r["kind"] not in EXEMPT:
                epoch = sum(1 for _, at in self.dead.get(sid, []) if at < r["at"])
                total[(sid, tag, epoch)] += 1
                # a request of a worker that crashed may be lost with it (a crash raised in a tool unwinds the
                # run, which may drop its reply): the turn asks again
                lost[(sid, tag, epoch)] += int(r["crash"] or r["kind"] == "crash")
        for (sid, tag, epoch), asked in total.items():
            budget = self.budget.get(sid, 4)
            if asked > budget + lost[(sid, tag, epoch)]:
                self.violate("within_budget", f"session {sid}: input {tag} had {asked} model requests (max_steps "
                             f"{budget}, {lost[(sid, tag, epoch)]} lost with a crash)", (sid, tag, epoch))
        for (n, sid, tag), asked in each.items():
            if asked > self.budget.get(sid, 4) + 1:
                self.violate("within_budget", f"session {sid}: op {n} made {asked} model requests for input {tag}",
                             (sid, tag, n))

    def _check_waiting(self, transcripts: dict[str, list[Message]]) -> None:
        """``answered_or_waits`` (docs/reliability.md, "The invariants")."""
        queues = {s: self.checker.queued(s) for s in transcripts}
        pendings = {s: self.checker.pending_steers(s) for s in transcripts}
        for (sid, key), (text, began) in self.accepted.items():
            if sid not in transcripts or self._erased(sid, began) or self.steers_gone.get(sid, -1) > began:
                continue  # deleted or pruned since (a prune takes a session that holds only steers, too)
            self.report.checks["answered_or_waits"] += 1
            n = self._count(sid, key, text, transcripts[sid], queues[sid], pendings[sid])
            if n != 1:
                self.violate("answered_or_waits", f"session {sid}: the message {text} ({key}) the store took is "
                             f"there {n} times (transcript, queue, steers waiting)", (sid, key, n))
        for sid, msgs in transcripts.items():
            info = self.checker.info(sid)
            if info is None or info.holder is not None or self._waiting_calls(sid):
                continue
            last = msgs[-1] if msgs else None
            tag = last_tag(msgs)
            unanswered = last is not None and not (last.role is Role.ASSISTANT and not last.tool_calls)
            ended = tag is not None and (sid, tag) in self.ended
            if unanswered and not ended:  # spent its budget (a fork's, a sweep's "finished"): ended where it is
                begun = max((i for i, m in enumerate(msgs) if m.role is Role.USER and m.text.startswith(TAGS)),
                            default=-1)
                ended = sum(1 for m in msgs[begun + 1:] if m.role is Role.ASSISTANT) >= self.budget.get(sid, 4)
            self.report.checks["answered_or_waits"] += 1
            hidden = queues[sid] or (unanswered and not ended and not self.interrupts.get(sid))
            if info.open_since is None and hidden:
                what = f"messages queued {queues[sid]}" if queues[sid] else f"its turn on {tag} is open"
                self.violate("answered_or_waits", f"session {sid}: {what}, and nothing shows it (open_since is "
                             "None, no holder): no sweep answers it", (sid, "hidden", tag, tuple(queues[sid])))

    def _check_ledger(self, ledger: list[dict[str, Any]]) -> None:
        starts = [r for r in ledger if r["t"] == "start"]
        pays = Counter((r["sid"], r["call"]) for r in starts if r["tool"] == "pay")
        self.report.checks["pay_at_most_once"] += 1
        for (sid, call), n in pays.items():
            if n > 1:
                self.violate("pay_at_most_once", f"session {sid}: pay for call {call} ran {n} times", (sid, call))
        self.report.checks["approved_before_paid"] += 1
        for r in starts:
            if r["tool"] == "pay" and r["ask"]:
                decided = self.decisions.get((r["sid"], r["call"]))
                if decided is None or not decided[0] or decided[1] > r["at"]:
                    self.violate("approved_before_paid", f"session {r['sid']}: pay {r['call']} (needs approval) ran "
                                 f"by op {r['op']} with decision {decided}", (r["sid"], r["call"]))
        self.report.checks["cancel_stops_turn"] += 1
        for r in starts:
            checked = r["checked"] if r["checked"] is not None else r["at"]
            why = self._cancelled(r, checked)
            if why:
                self.violate("cancel_stops_turn", f"session {r['sid']}: {why}, then {r['tool']} {r['call']} of turn "
                             f"{r['turn']} started (op {r['op']}, {r['kind']})", (r["sid"], r["call"]))

    def _cancelled(self, start: dict[str, Any], checked: int) -> str:
        """Why the tool start ``start`` (its run last checked for a cancel at ``checked``) must not have
        happened, or "". Three ways: a cancel() returned True while the run held the lease throughout; it
        returned True closing the turn waiting for approval that the call belongs to; or the turn was
        stopped by a cancel or max_steps, and a redelivery (not a resume the person asked for) went on."""
        sid = start["sid"]
        for csid, called, returned, waiting in self.cancels:
            if csid != sid or checked <= returned:
                continue
            if start["call"] in waiting:
                return "cancel() returned True while this call's turn waited for approval"
            for hold in self.holds:  # the lease the run started the tool under (an op may take several)
                if (hold.sid == sid and hold.op == start["op"] and hold.acquired < called
                        and (hold.released is None or hold.released > returned)
                        and hold.acquired <= start["at"] and (hold.released is None or start["at"] <= hold.released)):
                    return "cancel() returned True while this run held the lease"
        if start["kind"] in ("turn", "redeliver", "crash"):
            erased = [at for _, at in self.dead.get(sid, [])]
            for n, ended, reason in self.stopped_turns.get((sid, start["turn"]), []):
                # A turn erased since (delete, prune) is gone with its session: a redelivery begins it anew.
                began = self.began_of.get(n, ended)  # erased while it ran: what it stopped went with the session
                if checked > ended and n != start["op"] and not any(began < at < checked for at in erased):
                    return f"op {n} had stopped the turn ({reason})"
        return ""

    def _check_transcript(self, sid: str, msgs: list[Message]) -> None:
        for i, m in enumerate(msgs):  # a compaction record summarises messages before it, one range after another
            for c in m.content:
                if c.type is agent.ContentType.COMPACTION:
                    self.report.checks["compaction_in_range"] += 1
                    if not 0 <= c.start < c.end <= i:
                        self.violate("compaction_in_range", f"session {sid}: the record at {i} summarises "
                                     f"[{c.start}, {c.end})", (sid, i))
        self.report.checks["one_result_per_call"] += 1
        calls = [c.id for m in msgs for c in m.tool_calls]
        results = [c.tool_call_id for m in msgs for c in m.content if c.type is agent.ContentType.TOOL_RESULT]
        orphans = agent.orphaned_tool_calls(msgs)
        if orphans or len(calls) != len(set(calls)) or len(results) != len(set(results)):
            twice = tuple(sorted({c for c in calls if calls.count(c) > 1}))
            self.violate("one_result_per_call", f"session {sid}: calls {calls}, results {results}, "
                         f"orphans {[c.id for c in orphans]}", (sid, twice, tuple(c.id for c in orphans)))
        have = Counter(m.text for m in msgs if m.role is Role.USER)
        pending: list[str] | None = self.checker.pending_steers(sid) if self.lifecycle else None
        self.report.checks["steer_once"] += 1
        gone = self.steers_gone.get(sid, -1)
        for text, posted in self.steers.get(sid, []):
            n = have[text] + (pending.count(text) if pending is not None else 0)
            if n > 1 or (pending is not None and n != 1 and posted > gone):
                self.violate("steer_once", f"session {sid}: steer {text} is {have[text]} times in the transcript and "
                             f"{'?' if pending is None else pending.count(text)} times waiting", (sid, text))
        self.report.checks["no_reappearance"] += 1
        now_texts = texts(msgs)
        for dead, at in self.dead.get(sid, []):
            back = [t for t in now_texts & dead if not any(e > at for e in self.given.get((sid, t), []))]
            if back:
                self.violate("no_reappearance", f"session {sid}: deleted or pruned, and then {sorted(back)} "
                             "came back", (sid, at))

    def check_usable(self) -> None:
        """``usable`` (docs/reliability.md, "The invariants")."""
        for sid in list(self.sessions):
            self.count += 1
            op = Op(self.count, "run", sid, 0, lease_wait=10.0, text=f"u-{self.tag}-{self.count} last")
            store = self.stores[0]
            store.begin(op)
            session = agent.open(sid, store)  # type: ignore[arg-type]
            self.report.checks["usable"] += 1
            endpoint = Scripted(None, self.ledger, sid, op.n, "answer", None, "usable")
            try:
                try:
                    result = agent.Runner().run(self._spec(op, store), [*session.messages(), Message.user(op.text)],
                                                endpoint)
                except agent.AwaitingApproval:
                    for waiting in session.pending_approvals():
                        try:
                            session.deny(waiting.call_id, "the model's last check")
                        except agent.AlreadyDecided:
                            pass
                    agent.Runner().run(self._spec(op, store), session.messages(), endpoint)
                    result = agent.Runner().run(self._spec(op, store), [*session.messages(), Message.user(op.text)],
                                                endpoint)
                if result.stop_reason != "answered":
                    self.violate("usable", f"session {sid}: a last run stopped with {result.stop_reason}")
            except Exception as exc:  # noqa: BLE001 - that is the violation
                self.violate("usable", f"session {sid}: a last run failed: {type(exc).__name__}: {exc}")
            finally:
                store.begin(None)


def texts(msgs: Sequence[Message]) -> set[str]:
    """What makes a transcript recognisable: its non-empty message texts and its tool call ids (all unique
    to the operation that made them)."""
    return {m.text for m in msgs if m.text} | {c.id for m in msgs for c in m.tool_calls}


def _wait(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def run_program(seed: int, make_store: Callable[[], Store], capabilities: frozenset[Capability],
                process_factory: Callable[[], Store] | None, workdir: Path, ops: int,
                skip: frozenset[str], replay: bool = False) -> tuple[Report, list[str]]:
    """Run one program; its Report and its op log (what to read when it failed). ``replay``: draw it as the
    machine drew a regression seed's program (``Machine.new``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    machine = Machine(seed, make_store, capabilities, process_factory, workdir, ops, skip, replay)
    report = machine.run()
    return report, machine.log
