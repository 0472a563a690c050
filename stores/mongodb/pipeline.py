"""A guarded write as one pipeline update of the session's document, which the server evaluates whole.

One ``$replaceWith``: the guard, then whether the change fits the document as it stands (the messages' and
events' room, or, for a planned write, the document as it was planned on: ``layout``); then the document
merged with every field the change sets and ``write`` (the token the client reads its outcome by), only
when both hold (``$cond`` evaluates only the branch it takes); when only the fit fails, ``write`` alone, the
token's ``spill`` (docs/stores/mongodb.md). A field set to nothing is null, but ``open_since`` (the sparse
index holds the open sessions) and ``taken_from``, which a second stage removes. ``$$now``: ``$$NOW``, one
time through the whole command, in seconds. Small and shallow, as mongoeco evaluates it at a cost per node.
Every text from the caller is a ``$literal``: a text starting with ``$`` stays a text.
"""

from __future__ import annotations

from typing import Any

from agent_sessions.backend import CANCEL, Acquire, Change, Guard, Release, Renew, indexed

from .layout import EVENT_PAGE, EVENT_TAIL_BYTES, PAGE, TAIL_BYTES, Plan, size

NOW = {"$divide": [{"$toLong": "$$NOW"}, 1000]}
"""Seconds since 1970 on the server's clock."""
FIRST_SEQ = {"$multiply": [{"$toLong": "$$NOW"}, 1000]}
"""``backend.first_seq`` of the server's clock."""
ROW = {name: 1 for name in ("exists", "incarnation", "created", "updated", "version", "length", "edits", "token",
                            "epoch", "expires", "host", "pid", "spec", "turn", "cancelled", "cancelled_turn", "handed",
                            "journal", "open_since", "metadata", "last_seq")} | {"steers.id": 1, "queue.id": 1}
"""What a read and a listing read: the row (steers and queue items by id alone, to count)."""
ANSWER = {name: 0 for name in ("tail", "pages", "events", "event_pages", "keys", "tags", "steers.text", "steers.ref",
                               "queue.text", "queue.ref")}
"""What a write answers with: the document less what may be long (mongoeco projects it faster than ``ROW``)."""


def lit(value: Any) -> dict[str, Any]:
    return {"$literal": value}


def num(name: str) -> dict[str, Any]:
    return {"$ifNull": ["$" + name, 0]}


def array(path: str) -> dict[str, Any]:
    return {"$ifNull": ["$" + path, []]}


def bytes_of(texts: Any) -> dict[str, Any]:
    return {"$sum": {"$map": {"input": texts, "in": {"$strLenBytes": "$$this"}}}}


def holds(guard: Guard) -> Any:
    """The guard as an expression over the document as it stands (``true`` when it asks nothing): its
    equalities as one ``[expression, ...] == [value, ...]``, the rest beside it."""
    named = (("exists", False, guard.exists), ("incarnation", "", guard.incarnation), ("version", 0, guard.version),
             ("length", 0, guard.length), ("edits", 0, guard.edits), ("token", None, guard.lease and guard.lease[0]),
             ("epoch", 0, guard.lease and guard.lease[1]), ("cancelled", False, False if guard.not_cancelled else None))
    pairs: list[tuple[Any, Any]] = [(field(name, default, value), value) for name, default, value in named
                                    if value is not None]
    pairs += [(array(kind), []) for kind, asked in (("steers", guard.no_steers), ("queue", guard.no_queue)) if asked]
    if guard.checks_journal:
        pairs.append(("$journal", guard.journal))
    if guard.queue_head is not None:
        pairs.append(({"$arrayElemAt": ["$queue.id", 0]}, guard.queue_head))
    if guard.key_absent is not None:
        pairs.append(({"$in": [lit(guard.key_absent), array("keys")]}, False))
    terms: list[Any] = [{"$eq": [[e for e, _ in pairs], lit([v for _, v in pairs])]}] if pairs else []
    if guard.lease_free:
        terms.append({"$or": [{"$eq": [{"$ifNull": ["$token", None]}, None]}, {"$lte": ["$expires", NOW]}]})
    if guard.lease_held:
        terms.append({"$ne": [{"$ifNull": ["$token", None]}, None]})
    if guard.steers:
        terms.append({"$setIsSubset": [lit(list(guard.steers)), array("steers.id")]})
    return {"$and": terms} if len(terms) > 1 else terms[0] if terms else lit(True)


def field(name: str, default: Any, value: Any) -> Any:
    """``name`` to compare with ``value`` in an array (where a missing field is null): as ``default`` if that
    is ``value``."""
    return {"$ifNull": ["$" + name, default]} if value == default else "$" + name


def holds_on_nothing(guard: Guard) -> bool:
    """Whether ``guard`` holds for a session the store keeps nothing of (then a write may make its
    document)."""
    return (not guard.exists and guard.incarnation in (None, "") and guard.version in (None, 0)
            and guard.length in (None, 0) and guard.edits in (None, 0) and guard.lease is None
            and not guard.lease_held and not guard.steers and guard.journal in (None, Guard().journal)
            and guard.queue_head is None)


def update(guard: Guard, change: Change, token: str, spill: str, fresh: tuple[str, str],
           plan: Plan | None) -> list[Any]:
    """The pipeline of one write. ``fresh``: the generation and incarnation this write gives a document
    that has none."""
    fits: list[Any] = []
    if plan is not None:
        planned = [("generation", plan.generation), ("seal", plan.seal), ("edits", plan.edits),
                   ("last_seq", plan.last_seq)]
        fits = [{"$eq": [[field(name, 0, v) for name, v in planned if v is not None],
                         lit([v for _, v in planned if v is not None])]}]
    else:
        if change.splice is not None:
            fits += _room(*change.splice, pinned=guard.length == change.splice[0])
        if change.events:
            fits += _event_room(change.events, change.keep)
    defaults, fields = _fields(change, fresh, plan)
    fields["write"] = token
    removed = [name for name in ("open_since", "taken_from") if name in fields]
    done: Any = {"$mergeObjects": [defaults, "$$ROOT", fields] if defaults else ["$$ROOT", fields]}
    if fits:
        done = {"$cond": [{"$and": fits} if len(fits) > 1 else fits[0], done,
                          {"$mergeObjects": ["$$ROOT", {"write": spill}]}]}
    ok = holds(guard)
    now = {"now": NOW, **(_numbers(change, plan) if change.events else {})}
    stages: list[Any] = [{"$replaceWith": {"$let": {"vars": now, "in": done if ok == lit(True)
                                                      else {"$cond": [ok, done, "$$ROOT"]}}}}]
    if removed:  # null: the field goes
        stages.append({"$set": {name: {"$cond": [{"$eq": ["$" + name, None]}, "$$REMOVE", "$" + name]}
                                for name in removed}})
    return stages


def _room(at: int, texts: tuple[str, ...], pinned: bool) -> list[Any]:
    """The two splices the server makes alone: all messages replaced in a document with no pages, or an
    append (at the length, unless the guard ``pinned`` it) that leaves the tail fewer than ``PAGE`` messages
    and at most ``TAIL_BYTES``. Any other is planned (``layout``), as is one these texts alone overfill
    (``layout.needs_parts``)."""
    if at == 0:
        return [{"$eq": [array("pages"), []]}]
    return [*([] if pinned else [{"$eq": [num("length"), at]}]),
            {"$lt": [{"$size": array("tail")}, PAGE - len(texts)]},
            {"$lte": [num("tail_bytes"), TAIL_BYTES - sum(map(size, texts))]}]


def _event_room(texts: tuple[str, ...], keep: int) -> list[Any]:
    """The events fit the tail, and the cap drops no page (a page is dropped by a planned write)."""
    head = {"$arrayElemAt": [array("event_pages"), 0]}
    past_head = {"$let": {"vars": {"h": head}, "in": {"$add": ["$$start", "$$h.f", "$$h.n"]}}}
    return [{"$lt": [{"$size": array("events")}, EVENT_PAGE - len(texts)]},
            {"$lte": [num("events_bytes"), EVENT_TAIL_BYTES - sum(map(size, texts))]},
            {"$or": [{"$eq": [array("event_pages"), []]}, {"$gt": [past_head, {"$subtract": ["$$last", keep - 1]}]}]}]


def _numbers(change: Change, plan: Plan | None) -> dict[str, Any]:
    """What the events' fields share: the number of the log's first event (``start``), of the write's last
    (``last``), and the log's tail with them (``grown``, unless planned)."""
    start = {"$ifNull": ["$events_start", FIRST_SEQ]}  # a log the write begins starts at the server's clock
    before = {"$cond": [{"$gt": [num("last_seq"), 0]}, "$last_seq", {"$subtract": [start, 1]}]}
    out = {"start": start, "last": {"$add": [before, len(change.events)]}}
    if plan is None:
        out["grown"] = {"$concatArrays": [array("events"), lit(list(change.events))]}
    return out


def _fields(change: Change, fresh: tuple[str, str], plan: Plan | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fields the change sets where the document has none (defaults), and each field it sets, as its
    new value (over the document before it; ``None``: none)."""
    defaults: dict[str, Any] = {"generation": fresh[0]}
    out: dict[str, Any] = {"version": {"$add": [num("version"), 1]}, "at": "$$now"}
    version = out["version"]
    if plan is not None:
        out["seal"] = {"$add": [num("seal"), 1]}
    if change.exist:
        defaults.update(incarnation=fresh[1], created="$$now")
        out.update(exists=True, updated={"$max": ["$updated", "$$now"]})
    if change.splice is not None:
        at, texts = change.splice
        out.update(length=at + len(texts), edits={"$add": [num("edits"), 1]})
        if plan is not None:
            out.update({name: lit(plan.fields[name]) for name in ("tail", "tail_bytes", "pages")})
        elif at == 0:
            out.update(tail=lit(list(texts)), tail_bytes=sum(map(size, texts)))
        else:
            out.update(tail={"$concatArrays": [array("tail"), lit(list(texts))]},
                       tail_bytes={"$add": [num("tail_bytes"), sum(map(size, texts))]})
    refs = {} if plan is None else plan.items
    if change.take_steers or change.add_steer is not None:
        steers: Any = array("steers")
        if change.take_steers:
            taken = {"$in": ["$$this.id", lit(list(change.take_steers))]}
            steers = {"$filter": {"input": steers, "cond": {"$eq": [taken, False]}}}  # mongoeco knows no $not
        if change.add_steer is not None:
            text, key = change.add_steer
            item = {"id": version, "key": lit(key), **_text(text, refs.get("steers"))}
            steers = {"$concatArrays": [steers, [item]]}
        out["steers"] = steers
    if change.pop is not None or change.push is not None:
        queue: Any = array("queue")
        if change.pop is not None:
            queue = {"$filter": {"input": queue, "cond": {"$ne": ["$$this.id", change.pop]}}}
        if change.push is not None:
            key, text = change.push
            item = {"id": version, "key": lit(key), **_text(text, refs.get("queue"))}
            queue = {"$concatArrays": [queue, [item]]}
        out["queue"] = queue
    if change.add_key is not None or change.drop_key is not None:
        keys = array("keys")  # kept in the order accepted
        if change.drop_key is not None:
            keys = {"$filter": {"input": keys, "cond": {"$ne": ["$$this", lit(change.drop_key)]}}}
        if change.add_key is not None:
            accepted = lit(change.add_key)
            keys = {"$cond": [{"$in": [accepted, keys]}, keys, {"$concatArrays": [keys, [accepted]]}]}
        out["keys"] = keys
    if change.sets_journal:
        out["journal"] = None if change.journal is None else lit(change.journal)
    out.update(_lease(change))
    if change.sets_turn:
        out["turn"] = None if change.turn is None else lit(change.turn)
    if change.handed is not None:
        out["handed"] = change.handed
    if change.open == "set":
        defaults["open_since"] = "$$now"
    elif change.open == "clear":
        out["open_since"] = None
    if change.metadata is not None:
        out.update(metadata=lit(change.metadata), tags=lit(_tags(change.metadata)))
    if change.events:
        out.update(_events(change.events, change.keep, plan))
    return defaults, out


def _text(text: str, ref: str | None) -> dict[str, Any]:
    """An item's text, or the part that holds it."""
    return {"text": lit(text)} if ref is None else {"ref": ref}


def _lease(change: Change) -> dict[str, Any]:
    lease = change.lease
    if isinstance(lease, Acquire):
        held = {"$ne": [{"$ifNull": ["$token", None]}, None]}  # lapsed: what is taken over, for the log
        return {"taken_from": {"$cond": [held, {"token": "$token", "host": "$host", "pid": "$pid"}, None]},
                "token": lit(lease.token), "epoch": {"$add": [num("epoch"), 1]},
                "expires": {"$add": ["$$now", lease.ttl]}, "host": lit(lease.host), "pid": lease.pid,
                "spec": None if lease.spec is None else lit(lease.spec),
                "turn": None if lease.turn is None else lit(lease.turn),
                "handed": {"$or": [{"$eq": ["$handed", True]}, {"$eq": ["$cancelled", True]}]}, "cancelled": False}
    if isinstance(lease, Renew):
        return {"expires": {"$add": ["$$now", lease.ttl]}}
    if isinstance(lease, Release):
        return {"token": None, "handed": {"$or": [{"$eq": ["$handed", True]}, {"$eq": ["$cancelled", True]}]},
                "cancelled": False}
    if lease == CANCEL:
        return {"cancelled": True, "cancelled_turn": {"$ifNull": ["$turn", None]}}
    return {}


def _events(texts: tuple[str, ...], keep: int, plan: Plan | None) -> dict[str, Any]:
    """The events numbered on from ``last_seq`` (a new log from the server's clock), and the cap."""
    out: dict[str, Any] = {"events_start": "$$start", "last_seq": "$$last"}
    if plan is not None:
        fields = plan.fields
        out.update({name: lit(fields[name]) for name in ("events", "events_bytes", "event_pages")})
        out["events_from"] = {"$add": ["$$start", fields["events_floor"]]}
        return out
    added = {"$add": [num("events_bytes"), sum(map(size, texts))]}
    if keep >= EVENT_PAGE:  # the cap is past the tail (which holds fewer: ``_event_room``): it drops none of it
        out.update(events="$$grown", events_bytes=added)
    else:
        kept = {"$slice": ["$$grown", -keep]}
        out.update(events=kept, events_bytes={"$cond": [{"$lte": [{"$size": "$$grown"}, keep]}, added, bytes_of(kept)]})
    out["events_from"] = {"$max": [{"$ifNull": ["$events_from", "$$start"]}, {"$subtract": ["$$last", keep - 1]}]}
    return out


def _tags(metadata: str) -> list[str]:
    """``"key=<the value's JSON>"`` per key: what a listing's ``where`` matches (keys have no ``=``)."""
    return [f"{k}={v}" for k, v in indexed(metadata)]
