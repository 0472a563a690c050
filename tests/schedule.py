"""How pytest-xdist shares the suite out among its workers (scripts/test runs it with ``-n``).

The unit of work is a test class, or a module's tests outside classes, as xdist's ``loadscope`` has it: a unit
runs whole on one worker, in the order a serial run has, so the fixtures a class or module sets up once
(a fresh schema, a model server, a browser, a Django project) are set up once, and tests that follow each
other in one database follow each other still. Each worker has its own prefix (tests/servers.py), so two
units on two workers share nothing on the servers.

Units start longest first (``COST``'s estimate), so the run does not end waiting on a long unit that started
last: the figures are seconds a unit took in a serial run on a 2-core machine, rounded; a unit not listed
counts ``PER_TEST`` seconds a test. They order the queue and nothing else: a wrong one costs balance, never a
result.
"""

from __future__ import annotations

from typing import Any

PER_TEST = 0.3

COST: dict[str, float] = {}
"""Seconds a unit takes (its id: a module's path, or ``path::Class``), for the units far above ``PER_TEST``
seconds a test."""


def unit(nodeid: str) -> str:
    """The unit a test belongs to: its class, or its module (a parameter's text may hold ``::``)."""
    return nodeid.split("[", 1)[0].rsplit("::", 1)[0]


def cost(scope: str, tests: int) -> float:
    return COST.get(scope, PER_TEST * tests)


def scheduler(config: Any, log: Any) -> Any:
    """xdist's loadscope scheduler, taking the costliest unit left each time it hands one out."""
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return unit(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            costliest = max(self.workqueue, key=lambda scope: cost(scope, len(self.workqueue[scope])))
            self.workqueue.move_to_end(costliest, last=False)
            super()._assign_work_unit(node)

    return Units(config, log)
