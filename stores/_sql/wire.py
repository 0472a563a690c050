"""A write's guard and change as the JSON objects the stores' server-side writes read (PostgreSQL's
``agent_sessions_write`` function, MySQL's procedure of that name): a field is there when it asks or
changes something; a nullable value the change sets, or the guard compares, is a one-element array
([null]: none). The change's metadata comes with ``meta_index``, its (name, value) pairs as Python indexes
them, so the server never rewrites JSON."""

from __future__ import annotations

from typing import Any

from agent_sessions.backend import CANCEL, Acquire, Change, Guard, Release, Renew, indexed


def guard_json(guard: Guard) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("exists", "incarnation", "version", "length", "edits", "queue_head", "key_absent"):
        value = getattr(guard, name)
        if value is not None:
            out[name] = value
    if guard.lease is not None:
        out["lease"] = list(guard.lease)
    for name in ("lease_free", "lease_held", "not_cancelled", "no_steers", "no_queue"):
        if getattr(guard, name):
            out[name] = True
    if guard.steers:
        out["steers"] = list(guard.steers)
    if guard.checks_journal:
        out["journal"] = [guard.journal]
    return out


def change_json(change: Change) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if change.exist:
        out["exist"] = True
    if change.delete:
        out["delete"] = True
    if change.splice is not None:
        out["splice"] = [change.splice[0], list(change.splice[1])]
    if change.take_steers:
        out["take_steers"] = list(change.take_steers)
    for name in ("add_steer", "push"):
        value = getattr(change, name)
        if value is not None:
            out[name] = list(value)
    for name in ("pop", "add_key", "drop_key", "open"):
        value = getattr(change, name)
        if value is not None:
            out[name] = value
    if change.metadata is not None:
        out["metadata"] = change.metadata
        out["meta_index"] = [list(pair) for pair in indexed(change.metadata)]
    if change.sets_journal:
        out["journal"] = [change.journal]
    if change.sets_turn:
        out["turn"] = [change.turn]
    if change.handed is not None:
        out["handed"] = change.handed
    lease = change.lease
    if isinstance(lease, Acquire):
        out["lease"] = {"acquire": {"host": lease.host, "pid": lease.pid, "token": lease.token, "spec": lease.spec,
                                    "ttl": lease.ttl, "turn": lease.turn}}
    elif isinstance(lease, Renew):
        out["lease"] = {"renew": lease.ttl}
    elif isinstance(lease, Release):
        out["lease"] = {"release": True}
    elif lease == CANCEL:
        out["lease"] = {"cancel": True}
    if change.events:
        out["events"], out["keep"] = list(change.events), change.keep
    return out
