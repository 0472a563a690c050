"""The peers a user would pick instead, doing the same work per step, in the same run.

Installed only in the benchmark's own environment (scripts/bench builds it): OpenAI Agents SDK sessions
(SQLiteSession; SQLAlchemySession on PostgreSQL) and LangGraph checkpointers (SqliteSaver, PostgresSaver)
under a two-node ReAct graph. Each step appends a tool call and its result the way the peer's runner
does: OpenAI ``add_items`` once per turn; LangGraph one checkpoint after each node.
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .floors import Floor
from .workload import RESULT_TEXT, arguments, clock, summary

RESET_EVERY = 10


def available() -> list[str]:
    found = []
    try:
        import agents  # noqa: F401

        found.append("openai-agents")
    except ImportError:
        pass
    try:
        import langgraph.checkpoint.sqlite  # noqa: F401

        found.append("langgraph")
    except ImportError:
        pass
    return found


def _openai_items(i: int) -> list[dict[str, Any]]:
    return [
        {"type": "function_call", "call_id": f"call_{i}", "name": "grep", "arguments": arguments(i)},
        {"type": "function_call_output", "call_id": f"call_{i}", "output": RESULT_TEXT},
    ]


def _openai_prefix(n: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [{"role": "user", "content": "review the lease code"}]
    while len(items) < n:
        items.extend(_openai_items(len(items)))
    return items[:n]


def _measure(new_session: Callable[[str, int], Any], step: Callable[[Any, int], object], floor: Floor | None,
             n: int, rounds: int) -> dict[str, Any]:
    """Like ours.measure: a fresh session every RESET_EVERY rounds, the floor interleaved."""
    samples: list[float] = []
    floors: list[float] = []
    session: Any = None
    for r in range(rounds):
        if r % RESET_EVERY == 0:
            session = new_session(f"peer-{n}-{uuid.uuid4().hex}", n)
        if floor is not None:
            floors.append(clock(floor.append))
        samples.append(clock(functools.partial(step, session, r)))
    out: dict[str, Any] = {"persist": summary(samples)}
    if floors:
        out["floor"] = summary(floors)
    return out


def _openai(loop: asyncio.AbstractEventLoop, make: Callable[[str], Any], floor: Floor | None, n: int,
            rounds: int) -> dict[str, Any]:
    """An OpenAI Agents session per ``make(session_id)``: prefilled with ``n`` items, then ``add_items`` of
    each step's two, as its runner does once per turn."""

    def new_session(sid: str, n: int) -> Any:
        session = make(sid)
        loop.run_until_complete(session.add_items(_openai_prefix(n)))
        return session

    return _measure(new_session, lambda s, r: loop.run_until_complete(s.add_items(_openai_items(r))), floor, n,
                    rounds)


def openai_sqlite(tmp: str, floor: Floor | None, n: int, rounds: int) -> dict[str, Any]:
    from agents import SQLiteSession

    loop = asyncio.new_event_loop()
    path = Path(tmp) / "openai-agents.db"
    try:
        return _openai(loop, lambda sid: SQLiteSession(sid, path), floor, n, rounds)
    finally:
        loop.close()


def openai_sqlalchemy_postgres(tmp: str, floor: Floor | None, n: int, rounds: int) -> dict[str, Any]:
    from agents.extensions.memory.sqlalchemy_session import SQLAlchemySession
    from sqlalchemy.ext.asyncio import create_async_engine

    from . import backends

    loop = asyncio.new_event_loop()
    engine = create_async_engine(backends.sql_url("postgres"))
    try:
        return _openai(loop, lambda sid: SQLAlchemySession(sid, engine=engine, create_tables=True,
                                                           sessions_table="openai_agents_sessions",
                                                           messages_table="openai_agents_messages"),
                       floor, n, rounds)
    finally:
        loop.run_until_complete(engine.dispose())
        loop.close()


def _react_graph(checkpointer: Any) -> Any:
    """START -> model (a tool call) -> tools (its result) -> END: one ReAct step per invoke."""
    from langchain_core.messages import AIMessage, ToolMessage
    from langgraph.graph import END, START, MessagesState, StateGraph

    counter = [0]

    def model(state: MessagesState) -> dict[str, Any]:
        counter[0] += 1
        i = counter[0]
        return {"messages": [AIMessage(content="", tool_calls=[
            {"id": f"call_{i}", "name": "grep", "args": {"path": f"src/module_{i}.py", "note": "x" * 120}}])]}

    def tools(state: MessagesState) -> dict[str, Any]:
        call = state["messages"][-1].tool_calls[0]  # type: ignore[attr-defined]
        return {"messages": [ToolMessage(content=RESULT_TEXT, tool_call_id=call["id"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", model)
    graph.add_node("tools", tools)
    graph.add_edge(START, "model")
    graph.add_edge("model", "tools")
    graph.add_edge("tools", END)
    return graph.compile(checkpointer=checkpointer)


def _langgraph(checkpointer: Any, floor: Floor | None, n: int, rounds: int) -> dict[str, Any]:
    from langchain_core.messages import HumanMessage

    graph = _react_graph(checkpointer)

    def new_session(sid: str, n: int) -> Any:
        config = {"configurable": {"thread_id": sid}}
        prefix = [HumanMessage(content="review the lease code")]
        graph.invoke({"messages": prefix}, config, durability="sync")
        while len(graph.get_state(config).values["messages"]) < n:
            graph.invoke({"messages": []}, config, durability="sync")
        return config

    return _measure(new_session, lambda config, r: graph.invoke({"messages": []}, config, durability="sync"),
                    floor, n, rounds)


def langgraph_sqlite(tmp: str, floor: Floor | None, n: int, rounds: int) -> dict[str, Any]:
    from langgraph.checkpoint.sqlite import SqliteSaver

    conn = sqlite3.connect(Path(tmp) / "langgraph.db", check_same_thread=False)
    conn.execute("PRAGMA synchronous=FULL")
    try:
        return _langgraph(SqliteSaver(conn), floor, n, rounds)
    finally:
        conn.close()


def langgraph_postgres(tmp: str, floor: Floor | None, n: int, rounds: int) -> dict[str, Any]:
    from langgraph.checkpoint.postgres import PostgresSaver
    from sqlalchemy import make_url

    from . import backends

    url = make_url(backends.sql_url("postgres")).set(drivername="postgresql").render_as_string(hide_password=False)
    with PostgresSaver.from_conn_string(url) as saver:
        saver.setup()
        return _langgraph(saver, floor, n, rounds)


@dataclass(frozen=True)
class Peer:
    label: str
    package: str
    """What ``available()`` calls it."""
    backend: str
    """The store of ours it is compared with, whose floor it is measured beside."""
    measure: Callable[[str, Floor | None, int, int], dict[str, Any]]
    slow: bool = False
    """Measured over --peer-rounds rounds, not --rounds (LangGraph: tens of ms per step)."""


PEERS = (
    Peer("OpenAI Agents SQLiteSession", "openai-agents", "sqlite", openai_sqlite),
    Peer("OpenAI Agents SQLAlchemySession (PostgreSQL)", "openai-agents", "postgres", openai_sqlalchemy_postgres),
    Peer("LangGraph ReAct + SqliteSaver", "langgraph", "sqlite", langgraph_sqlite, slow=True),
    Peer("LangGraph ReAct + PostgresSaver", "langgraph", "postgres", langgraph_postgres, slow=True),
)
