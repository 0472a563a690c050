"""Watching what SQL a store sends, to check that an appending save writes only what is new."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.exc import OperationalError


@contextmanager
def statements_of(engine: Engine) -> Iterator[list[tuple[str, int]]]:
    seen: list[tuple[str, int]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        seen.append((statement.strip(), len(parameters) if executemany else 1))

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


@contextmanager
def failing(engine: Engine, statement_prefix: str) -> Iterator[None]:
    """Make the database fail the first statement starting with ``statement_prefix``, as a server that
    dies mid-transaction would."""

    def fail(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        if statement.strip().startswith(statement_prefix):
            raise OperationalError(statement, parameters, Exception("injected: the server went away"))

    event.listen(engine, "before_cursor_execute", fail)
    try:
        yield
    finally:
        event.remove(engine, "before_cursor_execute", fail)
