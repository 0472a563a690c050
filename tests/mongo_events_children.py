"""What the child processes of the MongoDB event log's tests run (spawned: each its own client): a writer
that is killed between writing its part and the update that would name it, and appenders racing."""

from __future__ import annotations

import time
import traceback
from typing import Any

import agent_sessions as agent
from agent_sessions.eventlog import encode
from tests import servers


class _StopsAfterInserting:
    """The parts collection of a store, passed through, but the first insert then reports and waits forever."""

    def __init__(self, collection: Any, out: Any) -> None:
        self.collection, self.out = collection, out

    def insert_many(self, *args: Any, **kwargs: Any) -> Any:
        done = self.collection.insert_many(*args, **kwargs)
        self.out.put([p["_id"] for p in args[0]])
        time.sleep(600)  # the parent kills this process here
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self.collection, name)


def dies_after_its_page(sid: str, holder: agent.Holder, n: int, out: Any) -> None:
    """Append ``n`` events to a log whose tail they overflow: the part is written, then the process waits
    to be killed before its update."""
    try:
        store = servers.mongo_store()
        store.mongo.parts = _StopsAfterInserting(store.mongo.parts, out)  # type: ignore[assignment]
        store.append_events(sid, holder, [encode("note", {"tag": "dead", "n": i}) for i in range(n)], keep=10_000)
        out.put("appended")  # never: the part is written first, and the process dies there
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put(traceback.format_exc())


def appender(sid: str, holder: agent.Holder, worker: int, batches: int, barrier: Any) -> tuple[int, list[int]]:
    """Append ``batches`` batches of 1 to 13 events (across page boundaries), each tagged; the last number
    each append returned."""
    store = servers.mongo_store()
    barrier.wait(120)
    returned = []
    for b in range(batches):
        size = 1 + (worker * 7 + b * 5) % 13
        texts = [encode("note", {"tag": f"{worker}-{b}", "n": i}) for i in range(size)]
        returned.append(store.append_events(sid, holder, texts, keep=10_000))
    return worker, returned
