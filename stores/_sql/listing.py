"""The statements of ``list_sessions`` filtered by metadata, and the choice between its two plans.

A page is the newest ``limit`` sessions (by ``updated``, ties by id, both descending) that have every
wanted tag. The tags' index (name, value) finds a value's sessions but not in that order, so the *tags*
plan reads every session of the value and sorts them to keep a page: right for a value few sessions
share, and its cost grows with how many do (13x a rare value's page for a tenth of 100,000 sessions).
The *walk* plan reads the sessions' index (updated, session_id) backwards and looks up each session's
wanted tags by the tags' primary key, stopping at the page's end: about ``limit / share`` rows for a
value a ``share`` of the sessions have, whatever their number.

Which one is decided per call, inside the read transaction, by a capped count of each wanted value's
entries (an index range, stopping at the cap): below ``COMMON_PER_ROW`` entries per row of the page the
tags plan is cheap, and the walk would be long. A common value whose sessions are all old would make the
walk long too, so the walk reads at most ``WALK_PER_ROW`` rows per row of the page (the window, bounded
by its last row's key, found first in the same index); when the window holds too few, the tags plan
finds the rest below the window. Either way a page is exactly what the tags plan alone gives, and its
cost is at most the tags plan's plus one window (measured in docs/performance.md).

Every value is a bound parameter: the statements' shape depends only on how many keys are wanted and on
whether a prefix or a cursor is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, func, or_, select

from .tables import messages, sessions, tags

COMMON_PER_ROW = 20
"""A wanted value is common when it has at least this many tag entries per row of the page asked for
(``limit + 1``: 1,020 for a page of 50): the tags plan would read and sort that many sessions, where the
walk reads about ``limit / share`` rows. The count stops there, so a value's count costs at most that many
index entries (0.03 ms on SQLite)."""
WALK_PER_ROW = 40
"""The walk reads at most this many sessions per row of the page (2,040 for a page of 50), so it finds a
full page when at least one in 40 of the newest sessions past the cursor matches, and otherwise gives up
after about as long as the tags plan takes for a common value's ``COMMON_PER_ROW`` entries (a probe costs
a fifth to a half of what the tags plan pays per entry, measured): the worst case, a common value whose
sessions are all old, costs at most about twice the tags plan alone, never the whole table."""

Cursor = tuple[float, str]
"""(updated, session_id) of the last row before the page: a keyset bound."""
StartsWith = Callable[[ColumnElement[str], str], ColumnElement[bool]]


def counts(wanted: Mapping[str, str], cap: int) -> Select[Any]:
    """One row: for each wanted (name, value), in the order of the names, how many tag entries it has,
    counted up to ``cap``."""
    columns = []
    for name, value in sorted(wanted.items()):
        # In the index's order, so the scan stops at the cap (unordered, PostgreSQL may read the whole
        # range into a bitmap first: 1.7 ms for a tenth of 100,000 sessions, against 0.2 ms).
        entries = (select(tags.c.session_id).where(tags.c.name == name, tags.c.value == value)
                   .order_by(tags.c.session_id).limit(cap))
        columns.append(select(func.count()).select_from(entries.subquery()).scalar_subquery())
    return select(*columns)


def window_end(after: Cursor | None, rows: int) -> Select[Any]:
    """The key of the ``rows``-th session past ``after`` in listing order (none when fewer are left): read
    from the index (updated, session_id) alone."""
    S = sessions.c
    query = select(S.updated, S.session_id)
    if after is not None:
        query = query.where(_past(after))
    return query.order_by(S.updated.desc(), S.session_id.desc()).offset(rows - 1).limit(1)


def walk(wanted: Mapping[str, str], prefix: str, starts_with: StartsWith, after: Cursor | None,
         end: Cursor | None, limit: int) -> Select[Any]:
    """Up to ``limit`` sessions past ``after`` down to ``end`` (included; the window's last row, from
    ``window_end``), newest first: the index (updated, session_id) read backwards as a range, each wanted
    tag looked up by the tags' primary key (session_id, name). The lookups are scalar subqueries, not
    EXISTS, so no planner turns them into a join driven from the tags' side."""
    S = sessions.c
    query = _probed(select(S.session_id, S.created, S.updated, S.metadata), S.session_id, wanted)
    if prefix:
        query = query.where(starts_with(S.session_id, prefix))
    if after is not None:
        query = query.where(_past(after))
    if end is not None:
        updated, last = end
        query = query.where(S.updated >= updated, or_(S.updated > updated, S.session_id >= last))
    return _with_counts(query, limit)


def walk_window(wanted: Mapping[str, str], prefix: str, starts_with: StartsWith, after: Cursor | None,
                window: int, limit: int) -> Select[Any]:
    """Up to ``limit`` sessions among the ``window`` newest past ``after``, newest first, in one
    statement: the window is a derived table (the index read backwards, ``window`` rows at most), its rows
    probed as in ``walk``. PostgreSQL's form: the derived table's order carries through, so the probing
    stops at the page's end, where given ``walk``'s range PostgreSQL estimates the probes' selectivity at
    0.5%, reads the whole range and sorts it (3 ms for a page of 50 at 100,000 sessions, against 0.8).
    SQLite sorts the derived table's rows instead, so it probes the whole window: it uses ``walk``."""
    S = sessions.c
    inner = select(S.session_id, S.updated)
    if after is not None:
        inner = inner.where(_past(after))
    win = inner.order_by(S.updated.desc(), S.session_id.desc()).limit(window).subquery()
    query = _probed(select(win.c.session_id, win.c.updated), win.c.session_id, wanted)
    if prefix:
        query = query.where(starts_with(win.c.session_id, prefix))
    chosen = query.order_by(win.c.updated.desc(), win.c.session_id.desc()).limit(limit).subquery()
    count = select(func.count()).where(messages.c.session_id == chosen.c.session_id).scalar_subquery()
    return (select(S.session_id, S.created, S.updated, S.metadata, count)
            .join_from(chosen, sessions, S.session_id == chosen.c.session_id)
            .order_by(chosen.c.updated.desc(), chosen.c.session_id.desc()))


def by_tags(wanted: Mapping[str, str], rare: str | None, prefix: str, starts_with: StartsWith,
            after: Cursor | None, limit: int) -> Select[Any]:
    """Up to ``limit`` sessions past ``after``, newest first, found by the tags' index (name, value).
    ``rare``: a wanted key with few entries (``counts``): its sessions are found, and their other wanted
    tags looked up as in ``walk`` (joined on every key, SQLite may start from the commonest: 10 ms for a
    user's page within a tenant at 100,000 sessions, against 1 ms). ``None``: joined on every wanted key,
    the planner's choice (better when all are common: PostgreSQL intersects them). With no tags wanted,
    the sessions' index read backwards."""
    S = sessions.c
    query = select(S.session_id, S.created, S.updated, S.metadata).select_from(sessions)
    for name, value in sorted(wanted.items()):
        if rare is None or name == rare:
            tag = tags.alias()
            query = query.join(tag, and_(tag.c.session_id == S.session_id, tag.c.name == name, tag.c.value == value))
    if rare is not None:
        query = _probed(query, S.session_id, {k: v for k, v in wanted.items() if k != rare})
    if prefix:
        query = query.where(starts_with(S.session_id, prefix))
    if after is not None:
        query = query.where(_past(after))
    return _with_counts(query, limit)


def _probed(query: Select[Any], session_id: ColumnElement[str], wanted: Mapping[str, str]) -> Select[Any]:
    """``query`` keeping the rows whose session has every wanted tag, each looked up by the tags' primary key."""
    for name, value in sorted(wanted.items()):
        tag = tags.alias()
        found = select(tag.c.value).where(tag.c.session_id == session_id, tag.c.name == name).scalar_subquery()
        query = query.where(found == value)
    return query


def _past(after: Cursor) -> ColumnElement[bool]:
    """Past the cursor in listing order: older, or as old with a smaller id. Written as a range on
    ``updated`` and then the tie, so SQLite and MySQL read the index (updated, session_id) from the cursor
    on, in order (as one OR, SQLite reads two ranges and sorts them: the walk could not stop early)."""
    S = sessions.c
    updated, last = after
    return and_(S.updated <= updated, or_(S.updated < updated, S.session_id < last))


def _with_counts(query: Select[Any], limit: int) -> Select[Any]:
    """The first ``limit`` rows of ``query`` newest first, then the message counts of those rows only."""
    S = sessions.c
    chosen = query.order_by(S.updated.desc(), S.session_id.desc()).limit(limit).subquery()
    count = select(func.count()).where(messages.c.session_id == chosen.c.session_id).scalar_subquery()
    return select(chosen, count).order_by(chosen.c.updated.desc(), chosen.c.session_id.desc())
