"""The library reads in layers: no module imports one that imports it back, however indirectly.

Counted are all imports, at module level, inside functions and under ``TYPE_CHECKING`` alike (grimp reads
every import statement): a cycle hidden in a function is still a cycle for a reader. The lazy imports the
library keeps are of an optional extra (a database driver in ``agent_sessions.cli``, OpenTelemetry in
``agent_sessions.otel``, Django in ``agent_sessions.contrib.django``), which is outside these packages and so
never part of a cycle here, and of the two HTTP endpoints (``agent_sessions.endpoints``: ``requests`` is
loaded when one is first named). Which layer may import which is the ``layers`` contract in setup.cfg,
checked by ``lint-imports`` (scripts/test).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp
import pytest

PACKAGES = ("agent_sessions", "stores", "storetest")


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself): each is
    a set of modules that import each other round. Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(graph.get(root, ())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, todo = work[-1]
            if todo:
                nxt = todo.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))
    return found


def import_graph(*packages: str) -> dict[str, set[str]]:
    graph = grimp.build_graph(*packages, cache_dir=None)
    return {m: {d for d in graph.find_modules_directly_imported_by(m) if d.split(".")[0] in packages}
            for m in graph.modules}


def test_no_module_of_the_library_imports_one_that_imports_it_back() -> None:
    found = cycles(import_graph(*PACKAGES))
    assert found == [], "import cycles (each line: modules that import each other round):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_cycle_check_finds_a_cycle_through_a_function_and_type_checking_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: a package whose cycle is hidden where the old core hid its own."""
    pkg = tmp_path / "cyclic_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .high import High\n")
    (pkg / "high.py").write_text("def f() -> None:\n    from . import mid\n")
    (pkg / "mid.py").write_text("from . import low\n")
    (pkg / "apart.py").write_text("from . import low\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert cycles(import_graph("cyclic_pkg")) == [["cyclic_pkg.high", "cyclic_pkg.low", "cyclic_pkg.mid"]]
    finally:
        sys.modules.pop("cyclic_pkg", None)
