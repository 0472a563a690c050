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
page. So a page is always exactly the tags plan's, and costs at most that plus one window. On PostgreSQL
the walk carries its window instead (``windowed_walk``): a derived table of the sessions cut at the window's
size, which PostgreSQL pulls row by row in the index's order, so the window's end is never read and the
walk is one statement after the count; SQLite would sort that derived table's rows again (probing the
whole window first) and MariaDB would build it by a full scan and a sort, so there the window's end is
read first.

The walk's result is used only when it is a full page, or when no window end was found (fewer sessions
are left past the cursor than a window holds, so the walk had no bound): either way it is, by itself, the
newest matching rows past the cursor, so it is right even when the window's end was read at another
snapshot. (The windowed walk cannot tell a short window from a thin one, so a page it leaves short is the
tags plan's: only the last pages of a common value pay that.)

Every value is a bound parameter (``params``): a statement's shape depends only on how many keys are
wanted, which of them drives the tags plan, whether a cursor or a window's end is given, and the prefix,
so each shape is built once per store (``Statements``: building one took SQLAlchemy 0.1-0.25 ms).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import (
    BindParameter,
    ColumnElement,
    Integer,
    Select,
    Subquery,
    and_,
    bindparam,
    func,
    or_,
    select,
    tuple_,
)

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
sessions are all old, costs the tags plan plus that: 1.1-1.3x the tags plan alone, measured
(docs/performance.md)."""

Cursor = tuple[float, str]
"""(updated, session_id): where a page ends or a window ends, in listing order."""
StartsWith = Callable[[ColumnElement[str], str], ColumnElement[bool]]
_SHAPES = 256
"""Statement shapes a store keeps built, the most recently used (a prefix is part of a shape)."""


def params(wanted: Mapping[str, str], **more: Any) -> dict[str, Any]:
    """The bound values of a statement: ``name_<i>`` and ``value_<i>`` for the wanted tags in the order of
    their names, then ``more`` (``cap``, ``rows``, ``skip``, the keys of ``cursor_params``)."""
    out: dict[str, Any] = {}
    for i, (name, value) in enumerate(sorted(wanted.items())):
        out[f"name_{i}"], out[f"value_{i}"] = name, value
    out.update(more)
    return out


def window(rows: int) -> int:
    """The sessions a windowed walk reads at most for a page of ``rows``: ``WALK_PER_ROW`` per row, rounded
    up to a power of two (1,024 for a page of 50), since the window is written into the statement's text
    (``Statements.windowed_walk``). A larger window changes no page: a walk's result is used only when
    it is a full page, which is the newest matching rows past the cursor whatever the window."""
    return 1 << (WALK_PER_ROW * rows - 1).bit_length()


def cursor_params(prefix: str, cursor: Cursor | None) -> dict[str, Any]:
    """``after_updated`` and ``after_id`` of ``cursor``, ``end_updated`` and ``end_id`` with ``prefix="end"``."""
    return {} if cursor is None else {f"{prefix}_updated": cursor[0], f"{prefix}_id": cursor[1]}


class Statements:
    """The listing's statements for one store, each shape built once (see the module's docstring).
    ``starts_with``: the store's prefix test. ``row_values``: a keyset bound is written ``(updated,
    session_id) < (:u, :id)``, which SQLite and PostgreSQL read as one range of the index and PostgreSQL
    estimates by ``updated`` alone; MariaDB reads no index for it (a full scan), so there it is ``updated
    <= :u AND (updated < :u OR session_id < :id)``, whose OR PostgreSQL would take for a filter keeping 2%
    of the range."""

    def __init__(self, starts_with: StartsWith, row_values: bool) -> None:
        self.starts_with = starts_with
        self.row_values = row_values
        # Per object, so a store's shapes go with it.
        self.counts = functools.lru_cache(maxsize=_SHAPES)(self._counts)
        self.window_end = functools.lru_cache(maxsize=_SHAPES)(self._window_end)
        self.walk = functools.lru_cache(maxsize=_SHAPES)(self._walk)
        self.windowed_walk = functools.lru_cache(maxsize=_SHAPES)(self._windowed_walk)
        self.by_tags = functools.lru_cache(maxsize=_SHAPES)(self._by_tags)

    def _counts(self, keys: int) -> Select[Any]:
        """One row: for each wanted tag (``name_<i>``, ``value_<i>``), how many entries it has, counted up
        to ``cap``."""
        cap = bindparam("cap", type_=Integer)
        columns = []
        for i in range(keys):
            # In the index's order, so the scan stops at the cap (unordered, PostgreSQL may read the whole
            # range into a bitmap first: 1.7 ms for 1,020 entries of a tenth of 100,000 sessions, against 0.3).
            entries = (select(tags.c.session_id).where(tags.c.name == _name(i), tags.c.value == _value(i))
                       .order_by(tags.c.session_id).limit(cap))
            columns.append(select(func.count()).select_from(entries.subquery()).scalar_subquery())
        return select(*columns)

    def _window_end(self, after: bool) -> Select[Any]:
        """The key of the session ``skip`` rows past the cursor (if ``after``) in listing order, the
        window's last when ``skip`` is its size less one (no row when fewer are left), read from the index
        (updated, session_id) alone. (``skip``, not ``rows - 1``: MySQL takes no expression there.)"""
        S = sessions.c
        query = select(S.updated, S.session_id)
        if after:
            query = query.where(self._past())
        skip = bindparam("skip", type_=Integer)
        return query.order_by(S.updated.desc(), S.session_id.desc()).offset(skip).limit(1)

    def _walk(self, keys: int, prefix: str, after: bool, end: bool) -> Select[Any]:
        """Up to ``rows`` sessions past the cursor down to the window's end (if ``end``; included), newest
        first: one range of the index (updated, session_id) read backwards, each wanted tag looked up by
        the tags' primary key as it goes."""
        S = sessions.c
        query = _probed(select(S.session_id, S.created, S.updated, S.metadata, S.spec_name, S.open_since),
                        S.session_id, range(keys))
        if prefix:
            query = query.where(self.starts_with(S.session_id, prefix))
        if after:
            query = query.where(self._past())
        if end:
            updated, last = _key("end")
            if self.row_values:
                query = query.where(tuple_(S.updated, S.session_id) >= tuple_(updated, last))
            else:
                query = query.where(S.updated >= updated, or_(S.updated > updated, S.session_id >= last))
        return _with_counts(query)

    def _windowed_walk(self, keys: int, prefix: str, after: bool) -> Select[Any]:
        """As ``walk``, its window carried along: up to ``rows`` sessions among the ``window`` newest past
        the cursor, newest first. The window is the index (updated, session_id) read backwards and cut at
        ``window`` rows; each row is probed as the page pulls it, so the read stops at the page's end.
        ``window`` is written into the statement's text: bound, PostgreSQL's generic plan (psycopg prepares
        a statement at its fifth use) takes the cut for a tenth of the table, and sorts the whole of it
        (40 ms at 100,000 sessions, against 2.5). So each window is a statement of its own on the server,
        and ``window`` rounds the window up to a power of two: a handful of them whatever limits callers
        ask for, not one per limit crowding the connection's prepared statements."""
        S = sessions.c
        window = select(S.session_id, S.created, S.updated, S.metadata, S.spec_name, S.open_since)
        if after:
            window = window.where(self._past())
        walked = (window.order_by(S.updated.desc(), S.session_id.desc())
                  .limit(bindparam("window", type_=Integer, literal_execute=True)).subquery("walked"))
        W = walked.c
        query = _probed(select(W.session_id, W.created, W.updated, W.metadata, W.spec_name, W.open_since),
                        W.session_id, range(keys))
        if prefix:
            query = query.where(self.starts_with(W.session_id, prefix))
        return _counted(query.order_by(W.updated.desc(), W.session_id.desc())
                        .limit(bindparam("rows", type_=Integer)).subquery())

    def _by_tags(self, keys: int, rare: int | None, prefix: str, after: bool) -> Select[Any]:
        """Up to ``rows`` sessions past the cursor, newest first, found by the tags' index (name, value).
        ``rare``: the position of a wanted tag with few entries (``counts``): its sessions are found, and
        their other wanted tags looked up as in ``walk`` (joined on every key, SQLite may start from the
        commonest: 10 ms for a user's page within a tenant at 100,000 sessions, against 1 ms). ``None``:
        joined on every wanted key, the planner's choice (better when all are common: PostgreSQL
        intersects them). With no tags wanted: the sessions' index read backwards."""
        S = sessions.c
        query = select(S.session_id, S.created, S.updated, S.metadata, S.spec_name, S.open_since).select_from(sessions)
        for i in range(keys):
            if rare is None or i == rare:
                tag = tags.alias()
                query = query.join(tag, and_(tag.c.session_id == S.session_id, tag.c.name == _name(i),
                                             tag.c.value == _value(i)))
        if rare is not None:
            query = _probed(query, S.session_id, [i for i in range(keys) if i != rare])
        if prefix:
            query = query.where(self.starts_with(S.session_id, prefix))
        if after:
            query = query.where(self._past())
        return _with_counts(query)

    def _past(self) -> ColumnElement[bool]:
        """Past the cursor in listing order: older, or as old with a smaller id; as one range of the
        index (updated, session_id), read from the cursor on in order."""
        S = sessions.c
        updated, last = _key("after")
        if self.row_values:
            return tuple_(S.updated, S.session_id) < tuple_(updated, last)
        return and_(S.updated <= updated, or_(S.updated < updated, S.session_id < last))


def _name(i: int) -> BindParameter[str]:
    return bindparam(f"name_{i}", type_=tags.c.name.type)


def _value(i: int) -> BindParameter[str]:
    return bindparam(f"value_{i}", type_=tags.c.value.type)


def _key(prefix: str) -> tuple[BindParameter[float], BindParameter[str]]:
    return (bindparam(f"{prefix}_updated", type_=sessions.c.updated.type),
            bindparam(f"{prefix}_id", type_=sessions.c.session_id.type))


def _probed(query: Select[Any], session_id: ColumnElement[str], keys: Any) -> Select[Any]:
    """``query`` keeping the rows whose session has the wanted tags at positions ``keys``, each looked up
    by the tags' primary key: ``(SELECT value = :v FROM tags WHERE session_id = s.session_id AND name =
    :n)``, true, false, or NULL (no such tag). A scalar subquery, not EXISTS, which PostgreSQL would turn
    into a join driven from the tags' side; the comparison inside, since PostgreSQL reckons ``(subquery) =
    :v`` keeps 0.5% of the rows (and so reads and sorts the whole window), where it reckons a
    true-or-false subquery keeps half."""
    for i in keys:
        tag = tags.alias()
        query = query.where(select(tag.c.value == _value(i))
                            .where(tag.c.session_id == session_id, tag.c.name == _name(i)).scalar_subquery())
    return query


def _with_counts(query: Select[Any]) -> Select[Any]:
    """The first ``rows`` rows of ``query`` newest first, then the message counts of those rows only."""
    S = sessions.c
    return _counted(query.order_by(S.updated.desc(), S.session_id.desc())
                    .limit(bindparam("rows", type_=Integer)).subquery())


def _counted(chosen: Subquery) -> Select[Any]:
    """The rows of ``chosen`` (a page of sessions), newest first, each with its message count."""
    count = select(func.count()).where(messages.c.session_id == chosen.c.session_id).scalar_subquery()
    c = chosen.c
    return (select(c.session_id, c.created, c.updated, c.metadata, count, c.spec_name, c.open_since)
            .order_by(c.updated.desc(), c.session_id.desc()))
