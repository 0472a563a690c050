"""The agent of the console's test project: its tools, its one spec, the store and the model endpoint as a
process of it makes them, and ``resolve`` (``AGENT_SESSIONS["RESOLVE"]``): what finishes a stranded turn,
from the console's page (the web process) or from the project's `manage.py agent_sessions work` (another
process)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import agent_sessions as agent

WAIT = 60.0
"""Seconds a tool waits at most for the test to let it finish."""


def released(name: str) -> None:
    """Wait until the test lets the call finish (it makes the file ``release-<name>`` in CONSOLE_STATE),
    so a page can see the call running; bounded, and a call nobody released fails."""
    flag = Path(os.environ["CONSOLE_STATE"]) / f"release-{name}"
    deadline = time.monotonic() + WAIT
    while not flag.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"nobody released {name} within {WAIT} s")
        time.sleep(0.02)


@agent.tool(idempotent=False, needs_approval=True)
def refund(order: str, amount: int) -> str:
    """Refund an order.

    Args:
        order: the order id
        amount: the amount to refund
    """
    released(f"refund-{order}")
    return f"refunded {amount} on order {order}"


@agent.tool
def lookup(order: str) -> str:
    """Look an order up.

    Args:
        order: the order id
    """
    return f"order {order}: delivered 3 days ago"


def spec(name: str = "support") -> agent.Spec:
    return agent.Spec(name=name, tools=[refund, lookup], publish_events=True, max_steps=6, lease_ttl=10.0)


def endpoint() -> agent.Endpoint:
    return agent.endpoints.OpenAIChat(os.environ["AGENT_MODEL_URL"], "console-test", max_retries=0)


def store() -> Any:
    """The project's store, built as the app builds it (from CONSOLE_DB_URL), for a process outside Django."""
    from sqlalchemy import create_engine

    from stores import postgres

    url = os.environ["CONSOLE_DB_URL"].replace("postgresql://", "postgresql+psycopg://", 1)
    return postgres.Store(create_engine(url, pool_size=2))


def resolve(info: agent.SessionInfo) -> tuple[agent.Spec, agent.Endpoint] | None:
    """Finish a session with the spec its last run named; only the sessions whose id starts with
    CONSOLE_RESOLVE_PREFIX (when set), so a worker started by one test leaves the other tests' sessions."""
    if not info.id.startswith(os.environ.get("CONSOLE_RESOLVE_PREFIX", "")):
        return None
    return spec(info.spec or "support"), endpoint()
