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
