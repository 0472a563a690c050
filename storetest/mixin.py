"""What every contract mixed into ``StoreContract`` shares: what the type checker needs to know of it
(``StoreContract`` gives it), the store getters, and small helpers."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest
from hypothesis import settings

import agent_sessions as agent
from agent_sessions import Holder, Message, RunStore

from .capabilities import Capability

T = TypeVar("T")

HUGE = 10**5000
"""More digits than ``int()`` and ``str()`` accept by default (4,300): its repr alone raises ValueError."""


class Crash(BaseException):
    """Stands in for a worker dying inside a tool or a request: nothing in the loop catches it."""


@contextmanager
def stand_in(store: Any, backend: Any) -> Iterator[None]:
    """``backend`` stands in for the store's own (``BackedStore.backend``) within the block."""
    own, store.backend = store.backend, backend
    try:
        yield
    finally:
        store.backend = own


def new_id(tag: str = "") -> str:
    """A fresh session id: tests and Hypothesis examples never see each other's data on a shared database."""
    return f"storetest-{tag}-{uuid.uuid4().hex}"


def new_holder(tag: str = "", spec: str | None = None) -> Holder:
    """A would-be holder; the store sets its expiry and epoch. Tagged ones get a recognisable token."""
    token = (tag * 32)[:32] if tag else uuid.uuid4().hex
    return Holder("host-" + token[:8], 1234, token, 0.0, spec=spec)


def together(n: int, work: Callable[[int], T], timeout: float = 120) -> list[T]:
    """``work(0)`` ... ``work(n - 1)``, each in a thread of its own, released at once by a barrier: what each
    returned, in order. The first exception a thread raised is raised here."""
    barrier = threading.Barrier(n)
    results: dict[int, T] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            barrier.wait(timeout)
            results[i] = work(i)
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        assert not t.is_alive(), f"thread {t.name} did not finish within {timeout} s"
    if errors:
        raise errors[0]
    return [results[i] for i in range(n)]


def add_and_take(sid: str, adders: list[Callable[[str, str], object]], takers: list[Callable[[str], list[str]]],
                 per_adder: int, timeout: float = 300) -> list[list[str]]:
    """Adder i adds the steers ``f"s{i}-{j:04d}"`` (``adders[i](sid, text)``) while each taker takes
    (``takers[t](sid)``) until the adders are done and it finds nothing more, all at once: what each took."""
    adding = [len(adders)]
    lock = threading.Lock()
    deadline = time.monotonic() + timeout

    def work(i: int) -> list[str]:
        if i < len(adders):
            try:
                for j in range(per_adder):
                    adders[i](sid, f"s{i}-{j:04d}")
            finally:
                with lock:
                    adding[0] -= 1
            return []
        taken: list[str] = []
        while time.monotonic() < deadline:
            finished = adding[0] == 0
            batch = takers[i - len(adders)](sid)
            taken.extend(batch)
            if not batch and finished:
                return taken
        raise AssertionError(f"the takers did not finish within {timeout} s")

    return together(len(adders) + len(takers), work, timeout + 10)[len(adders):]


def call(id: str, arguments: str = '{"z":1,"a":[1, 2],"z":3}') -> Message:
    """A reply calling ``read_file`` (by default with arguments a JSON column would rewrite)."""
    return Message(agent.Role.ASSISTANT, [agent.Content.tool_call(id, "read_file", arguments)])


def transcript(n: int, tag: str = "") -> list[Message]:
    """``n`` messages of questions, calls (their arguments with a duplicate key) and results."""
    out: list[Message] = []
    for i in range(n):
        if i % 3 == 0:
            out.append(Message.user(f"{tag}question {i}"))
        elif i % 3 == 1:
            out.append(call(f"call_{i}", f'{{"path": "{tag}f{i}.py", "path": {i}}}'))
        else:
            out.append(Message(agent.Role.USER, [agent.Content.tool_result(f"call_{i - 1}", f"{tag}contents {i}")]))
    return out


def refund(ran: list[str], crash_on: str = "", **options: Any) -> agent.Tool:
    """A non-idempotent refund (``options`` go to ``agent.tool``); ``ran`` gets each order it is run for. It
    dies (after its effect) the first time it runs for ``crash_on``."""

    def refund(order: str) -> str:
        """Refund 60 on an order."""
        ran.append(order)
        if order == crash_on and ran.count(order) == 1:
            raise Crash
        return f"refunded 60 on {order}"

    return agent.tool(name="refund", idempotent=False, **options)(refund)


def noting(ran: list[str], name: str, text: str, idempotent: bool = True, dies: set[str] | None = None
           ) -> agent.Tool:
    """A tool ``name`` that notes its name in ``ran`` and returns ``text``; the first time it runs while its
    name is in ``dies`` it takes it out and dies (after its effect)."""

    def run(n: int = 0) -> str:
        """A tool that may take its worker with it."""
        ran.append(name)
        if dies is not None and name in dies:
            dies.discard(name)
            raise Crash
        return text

    return agent.tool(name=name, idempotent=idempotent)(run)


def no_orphans(msgs: list[Message]) -> list[Message]:
    orphans = agent.orphaned_tool_calls(msgs)
    assert not orphans, f"tool calls stored without a result: {[c.id for c in orphans]}"
    return msgs


class ContractMixin:
    capabilities: frozenset[Capability]
    examples: int
    concurrency: int
    make_store: Callable[[], Any]
    requires: Callable[[Capability], None]
    factory: Callable[[], Any]
    hypothesis: Callable[..., settings]

    def capable_store(self, capability: Capability, methods: str, *needs: Capability) -> RunStore:
        """A store that declares ``capability``, checked to implement ``RunStore`` (of which every capability's
        protocol is another name; ``methods``: those of the capability, which the failure names): a declared
        capability the store does not deliver fails, never skips. Every capability of ``needs`` is declared too
        (else the test skips)."""
        for need in (*needs, capability):
            self.requires(need)
        store = self.make_store()
        if not isinstance(store, RunStore):
            pytest.fail(f"the store declares Capability.{capability.name}, but {type(store).__name__} does not "
                        f"implement agent_sessions.RunStore ({methods})")
        return store

    def run_store(self, *needs: Capability) -> RunStore:
        return self.capable_store(Capability.RUN_STORE, "check its methods and their names", *needs)

    def another(self, store: Any) -> Any:
        """A second store object on the same data, as another worker would have; ``store`` itself for a
        store that does not declare ``Capability.DURABLE`` (its objects share nothing)."""
        if Capability.DURABLE not in self.capabilities:
            return store
        other = self.make_store()
        assert other is not store, "make_store() must make a new store object"
        return other
