"""docs/api.md keeps up with the code: every public name (``agent_sessions.__all__``) is named there in
code, the ``agent.Spec(...)`` signature there lists every field of ``Spec``, and ``@agent.tool(...)`` every
keyword of ``tool`` (issue 28, item 7: approvals and the event log's fields had been left out)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import agent_sessions as agent

API = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
CODE = re.findall(r"`([^`]+)`", re.sub(r"^```.*?^```", "", API, flags=re.S | re.M))
"""The page's inline code spans (a signature wrapped over lines is one span), outside its code blocks."""


def named_in_code(name: str) -> bool:
    return any(re.search(rf"(?<![\w.])(agent\.)?{re.escape(name)}\b", span) for span in CODE)


def span_starting(prefix: str) -> str:
    found = [span for span in CODE if span.startswith(prefix)]
    assert found, f"docs/api.md has no `{prefix}...` signature"
    return max(found, key=len)


@pytest.mark.parametrize("name", sorted(agent.__all__))
def test_every_public_name_is_in_api_md(name: str) -> None:
    assert named_in_code(name), f"agent_sessions.{name} is public (in __all__) but docs/api.md never names it"


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(agent.Spec) if f.init])
def test_every_spec_field_is_in_the_spec_signature(field: str) -> None:
    signature = span_starting("agent.Spec(")
    assert re.search(rf"\b{field}=", signature), f"Spec.{field} is missing from docs/api.md's {signature!r}"


@pytest.mark.parametrize("keyword", [p.name for p in inspect.signature(agent.tool).parameters.values()
                                     if p.kind is inspect.Parameter.KEYWORD_ONLY])
def test_every_tool_keyword_is_in_the_tool_signature(keyword: str) -> None:
    signature = span_starting("@agent.tool(")
    assert re.search(rf"\b{keyword}=", signature), f"tool({keyword}=...) is missing from docs/api.md's {signature!r}"


def test_the_checks_see_a_name_that_is_missing() -> None:
    """The matching is not vacuous: a name the page does not have is found missing."""
    assert not named_in_code("NoSuchName") and not named_in_code("Spe")
    assert named_in_code("Spec") and named_in_code("StoresShadowed")


def _classes(annotation: object) -> set[type]:
    """The classes an annotation names (``X | None``, ``list[X]``, ``Iterator[X]``...)."""
    import types
    import typing

    found: set[type] = set()
    origin = typing.get_origin(annotation)
    if origin is not None:
        for arg in typing.get_args(annotation):
            found |= _classes(arg)
        if isinstance(origin, type) and origin is not types.UnionType:
            found.add(origin)
    elif isinstance(annotation, type):
        found.add(annotation)
    return found


def _public_callables() -> list[tuple[str, object, object]]:
    """(label, callable, where its return types must be importable from): every function and method of a
    class in ``agent_sessions.__all__`` (from ``agent_sessions``), and of a public module there (from that
    module, or ``agent_sessions``)."""
    found: list[tuple[str, object, object]] = []

    def members(obj: object, label: str, home: object) -> None:
        if inspect.isfunction(obj):
            found.append((label, obj, home))
        elif isinstance(obj, type):
            for name, value in vars(obj).items():
                if not name.startswith("_") and callable(value):
                    found.append((f"{label}.{name}", value, home))

    for name in agent.__all__:
        value = getattr(agent, name)
        if inspect.ismodule(value):
            for inner, member in vars(value).items():
                if not inner.startswith("_") and getattr(member, "__module__", None) == value.__name__:
                    members(member, f"{name}.{inner}", value)
        else:
            members(value, name, agent)
    return found


def test_every_type_a_public_function_returns_is_importable_from_where_it_is() -> None:
    """``session.approve(...)`` returns a ``Decision``: a caller can name it as ``agent.Decision`` (a function of
    a public module, ``agent.endpoints.streaming``, may return a type of that module)."""
    import typing

    missing = []
    for label, function, home in _public_callables():
        for cls in _classes(typing.get_type_hints(function).get("return")):
            if cls.__module__ in ("builtins", "typing", "collections.abc", "datetime", "collections"):
                continue
            if getattr(agent, cls.__name__, None) is not cls and getattr(home, cls.__name__, None) is not cls:
                missing.append(f"{label} -> {cls.__module__}.{cls.__name__}")
    assert missing == [], missing
    assert any(label == "StoreSession.approve" for label, _, _ in _public_callables())
