"""The application's ``resolve`` for the stranded-runs tests of the front doors (``recover --resolve
tests.stranded_resolve:resolve``): the spec recorded as "support" is finished with a scripted model; any
other is left alone."""

from __future__ import annotations

import agent_sessions as agent
from storetest.scripted import ToolsThenAnswer

SUPPORT = agent.Spec(name="support", max_steps=4, lease_ttl=5.0)


def resolve(info: agent.SessionInfo) -> tuple[agent.Spec, agent.Endpoint] | None:
    if info.spec != SUPPORT.name:
        return None
    return SUPPORT, ToolsThenAnswer([])
