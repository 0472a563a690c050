"""What the senders of tests/test_busy.py run: spawned once per test module, each serves jobs from its inbox
(``serve``) so that the four policies on four stores cost one interpreter start per sender, not 128."""

from __future__ import annotations

import traceback
from typing import Any

import agent_sessions as agent

Job = tuple[str, str, str, str, int, int, float]
"""(a store's factory name, its address, the session, the policy, this sender's number, how many messages,
lease_wait)."""


def _store(kind: str, address: str) -> agent.RunStore:
    from sqlalchemy import create_engine

    from stores import mongodb, mysql, postgres, sqlite
    if kind == "sqlite":
        return sqlite.open(address)
    if kind == "postgres":
        return postgres.Store(create_engine(address, pool_size=2))
    if kind == "mysql":
        return mysql.Store(create_engine(address, pool_size=2))
    import pymongo
    url, database = address.rsplit("#", 1)
    return mongodb.Store(pymongo.MongoClient(url)[database])


PUSHED: dict[str, int] = {}
"""Per key this process queued: the queue item's id (the row's version after the push), which orders the
items as the store accepted them."""


def _recording_pushes(store: agent.RunStore) -> agent.RunStore:
    backend = store.backend  # type: ignore[attr-defined]
    write = backend.write

    def recorded(session: str, guard: Any, change: Any) -> Any:
        written = write(session, guard, change)
        if written.done and change.push is not None:
            PUSHED[change.push[0]] = written.row.version
        return written

    backend.write = recorded
    return store


def serve(model_url: str, inbox: Any, outbox: Any) -> None:
    """Answer jobs until ``None``: each sends this sender's messages, one after another, with
    ``Runner.turn(..., if_busy=policy)``, and reports per message (key, outcome, detail, when)."""
    stores: dict[tuple[str, str], agent.RunStore] = {}
    endpoint = agent.endpoints.OpenAIChat(model_url + "/v1", "m", max_retries=0)
    outbox.put(("ready", None))
    while (job := inbox.get()) is not None:
        kind, address, sid, policy, sender, count, lease_wait = job
        try:
            store = stores.get((kind, address))
            if store is None:
                store = stores[(kind, address)] = _recording_pushes(_store(kind, address))
            PUSHED.clear()
            spec = agent.Spec(session=agent.open(sid, store), lease_wait=lease_wait, lease_ttl=10)
            outbox.put(("done", _send(spec, endpoint, policy, sender, count)))
        except BaseException:  # noqa: BLE001 - reported to the parent
            outbox.put(("error", traceback.format_exc()))


def _send(spec: agent.Spec, endpoint: agent.Endpoint, policy: str, sender: int, count: int
          ) -> list[tuple[str, str, str, int]]:
    outcomes = []
    for j in range(count):
        key = f"s{sender}-m{j}"
        outcomes.append((key, *_one(spec, endpoint, policy, key), PUSHED.get(key, -1)))
    return outcomes


def _one(spec: agent.Spec, endpoint: agent.Endpoint, policy: Any, key: str) -> tuple[str, str]:
    try:
        result = agent.Runner().turn(spec, f"message {key}", key, endpoint, if_busy=policy)
    except agent.StillQueued as exc:
        return "StillQueued", f"{exc.key} {exc.position}"
    except agent.SessionBusy as exc:
        return "SessionBusy", str(exc)
    return result.stop_reason, result.text
