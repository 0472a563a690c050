"""The statements of ``list_sessions`` filtered by metadata, and the choice between its two plans.

A page is the newest ``limit`` sessions (by ``updated``, ties by id, both descending) that have every
wanted tag. The tags' index (name, value) finds a value's sessions but not in that order, so the *tags*
plan reads every session of the value and sorts them to keep a page: right for a value few sessions
share, and its cost grows with how many do (13x a rare value's page for a tenth of 100,000 sessions).
The *walk* reads the sessions' index (updated, session_id) backwards and looks up each session's wanted
tags by the tags' primary key, stopping at the page's end: about ``limit / share`` rows for a value a
``share`` of the sessions have, whatever their number.

``Lifecycle.list_sessions`` decides per call, by a capped count of each wanted value's entries (an index
range, stopping at the cap): below ``COMMON_PER_ROW`` entries per row of the page the tags plan is cheap
and a walk could be long. A common value whose sessions are all old would make the walk long too, so it
reads at most a window of ``WALK_PER_ROW`` sessions per row of the page, down to the window's last row
(``window_end``, read first from the same index); when the window holds too few, the tags plan gives the
page. So a page is always exactly the tags plan's, and costs at most that plus one window.

The walk's result is used only when it is a full page, or when the window was all that was left: either
way it is, by itself, the newest matching rows past the cursor, so it is right even when the window's end
was read at another snapshot (PostgreSQL's reads run in autocommit).

Every value is a bound parameter: a statement's shape depends only on which keys are wanted and on
whether a prefix or a cursor is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, func, or_, select, tuple_

from .tables import messages, sessions, tags

COMMON_PER_ROW = 10
"""A wanted value is common when it has at least this many tag entries per row of the page asked for
(``limit + 1``: 510 for a page of 50): the tags plan would read and sort that many sessions, where the
walk reads about ``limit / share`` rows. The count stops there, so it costs at most that many index
entries (0.02 ms on SQLite, 0.15 ms on PostgreSQL, measured at 100,000 sessions)."""
WALK_PER_ROW = 20
"""The walk reads at most this many sessions per row of the page (1,020 for a page of 50): it finds a full
page when one in 20 of the newest sessions past the cursor matches (a tenth: about 500 read), and
otherwise gives up after about as long as the tags plan takes for ``COMMON_PER_ROW`` entries per row (a
probe costs a fifth to a half of what the tags plan pays per entry). The worst case, a common value whose
sessions are all old, costs the tags plan plus that: 1.2-1.3x the tags plan alone, measured
(docs/performance.md)."""

Cursor = tuple[float, str]
"""(updated, session_id): where a page ends or a window ends, in listing order."""


@dataclass(frozen=True)
class Dialect:
    """What differs between the SQL stores' listings. ``starts_with``: the prefix test (``Lifecycle``'s
    hook). ``row_values``: a keyset bound is written ``(updated, session_id) < (:u, :id)``, which SQLite
    and PostgreSQL read as one range of the index and PostgreSQL estimates by ``updated`` alone. MariaDB
    does not use an index for it (a full scan), so there it is ``updated <= :u AND (updated < :u OR
    session_id < :id)``, whose OR PostgreSQL would take for a filter keeping 2% of the range."""

    starts_with: Callable[[ColumnElement[str], str], ColumnElement[bool]]
    row_values: bool


def counts(wanted: Mapping[str, str], cap: int) -> Select[Any]:
    """One row: for each wanted (name, value), in the order of the names, how many tag entries it has,
    counted up to ``cap``."""
    columns = []
    for name, value in sorted(wanted.items()):
        # In the index's order, so the scan stops at the cap (unordered, PostgreSQL may read the whole
        # range into a bitmap first: 1.7 ms for 1,020 entries of a tenth of 100,000 sessions, against 0.3 ms).
        entries = (select(tags.c.session_id).where(tags.c.name == name, tags.c.value == value)
                   .order_by(tags.c.session_id).limit(cap))
        columns.append(select(func.count()).select_from(entries.subquery()).scalar_subquery())
    return select(*columns)


def window_end(dialect: Dialect, after: Cursor | None, rows: int) -> Select[Any]:
    """The key of the ``rows``-th session past ``after`` in listing order (no row when fewer are left),
    read from the index (updated, session_id) alone."""
    S = sessions.c
    query = select(S.updated, S.session_id)
    if after is not None:
        query = query.where(_past(dialect, after))
    return query.order_by(S.updated.desc(), S.session_id.desc()).offset(rows - 1).limit(1)


def walk(dialect: Dialect, wanted: Mapping[str, str], prefix: str, after: Cursor | None, end: Cursor | None,
         limit: int) -> Select[Any]:
    """Up to ``limit`` sessions past ``after`` down to ``end`` (included: the window's last row), newest
    first: one range of the index (updated, session_id) read backwards, each wanted tag looked up by the
    tags' primary key as it goes."""
    S = sessions.c
    query = _probed(select(S.session_id, S.created, S.updated, S.metadata), S.session_id, wanted)
    if prefix:
        query = query.where(dialect.starts_with(S.session_id, prefix))
    if after is not None:
        query = query.where(_past(dialect, after))
    if end is not None:
        updated, last = end
        if dialect.row_values:
            query = query.where(tuple_(S.updated, S.session_id) >= tuple_(updated, last))
        else:
            query = query.where(S.updated >= updated, or_(S.updated > updated, S.session_id >= last))
    return _with_counts(query, limit)


def by_tags(dialect: Dialect, wanted: Mapping[str, str], rare: str | None, prefix: str, after: Cursor | None,
            limit: int) -> Select[Any]:
    """Up to ``limit`` sessions past ``after``, newest first, found by the tags' index (name, value).
    ``rare``: a wanted key with few entries (``counts``): its sessions are found, and their other wanted
    tags looked up as in ``walk`` (joined on every key, SQLite may start from the commonest: 10 ms for a
    user's page within a tenant at 100,000 sessions, against 1 ms). ``None``: joined on every wanted key,
    the planner's choice (better when all are common: PostgreSQL intersects them). With no tags wanted:
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
        query = query.where(dialect.starts_with(S.session_id, prefix))
    if after is not None:
        query = query.where(_past(dialect, after))
    return _with_counts(query, limit)


def _probed(query: Select[Any], session_id: ColumnElement[str], wanted: Mapping[str, str]) -> Select[Any]:
    """``query`` keeping the rows whose session has every wanted tag, each looked up by the tags' primary
    key: ``(SELECT value = :v FROM tags WHERE session_id = s.session_id AND name = :n)``, true, false, or
    NULL (no such tag). A scalar subquery, not EXISTS, which PostgreSQL would turn into a join driven from
    the tags' side; the comparison inside, since PostgreSQL reckons ``(subquery) = :v`` keeps 0.5% of the
    rows (and so reads and sorts the whole window), where it reckons a true-or-false subquery keeps half."""
    for name, value in sorted(wanted.items()):
        tag = tags.alias()
        query = query.where(select(tag.c.value == value)
                            .where(tag.c.session_id == session_id, tag.c.name == name).scalar_subquery())
    return query


def _past(dialect: Dialect, after: Cursor) -> ColumnElement[bool]:
    """Past the cursor in listing order: older, or as old with a smaller id; as one range of the index
    (updated, session_id), read from the cursor on in order (see ``Dialect``)."""
    S = sessions.c
    updated, last = after
    if dialect.row_values:
        return tuple_(S.updated, S.session_id) < tuple_(updated, last)
    return and_(S.updated <= updated, or_(S.updated < updated, S.session_id < last))


def _with_counts(query: Select[Any], limit: int) -> Select[Any]:
    """The first ``limit`` rows of ``query`` newest first, then the message counts of those rows only."""
    S = sessions.c
    chosen = query.order_by(S.updated.desc(), S.session_id.desc()).limit(limit).subquery()
    count = select(func.count()).where(messages.c.session_id == chosen.c.session_id).scalar_subquery()
    return select(chosen, count).order_by(chosen.c.updated.desc(), chosen.c.session_id.desc())
