"""Tools the model may call, and the one place their failures become results the model can read."""

from __future__ import annotations

import inspect
import json
import logging
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, overload

from .errors import ArgumentError, ToolError
from .messages import Content

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what OpenAI and Anthropic both accept as a tool name


@dataclass(frozen=True)
class Tool:
    """A callable the model sees as ``name`` with a JSON-schema ``parameters`` object."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., Any] = field(compare=False)
    idempotent: bool = True
    """May the tool run twice for one call? A run that dies mid-tool re-runs an idempotent tool on resume;
    a non-idempotent one is not re-run, and the model is told its outcome is unknown."""
    needs_approval: bool | Callable[[dict[str, Any]], bool] = field(default=False, compare=False)
    """Must a person approve a call before it runs? Always (``True``), or as a function of the call's
    parsed arguments says. Arguments that do not parse as a JSON object, or a function that raises, ask
    for approval: the safe side. See docs/runs/approvals.md."""
    approval_deadline: float | None = None
    """Seconds a call may wait for its decision; undecided past it, it counts as denied. ``None``: the
    spec's ``approval_deadline``, else no deadline."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ArgumentError(f"Tool name {self.name!r} must match {_NAME.pattern}")
        if not callable(self.fn):
            raise ArgumentError(f"Tool {self.name!r}: fn must be callable")
        if not isinstance(self.parameters, Mapping) or self.parameters.get("type") != "object":
            raise ArgumentError(f"Tool {self.name!r}: parameters must be a JSON schema of type 'object'")
        if not isinstance(self.idempotent, bool):
            raise ArgumentError(f"Tool {self.name!r}: idempotent must be a bool, got {self.idempotent!r}")
        if not isinstance(self.needs_approval, bool) and not callable(self.needs_approval):
            raise ArgumentError(f"Tool {self.name!r}: needs_approval must be a bool or a callable taking the "
                                f"arguments, got {self.needs_approval!r}")
        deadline = self.approval_deadline
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                     or not 0 < deadline < float("inf")):
            raise ArgumentError(f"Tool {self.name!r}: approval_deadline must be None or seconds > 0, got {deadline!r}")

    def asks_approval(self, call: Content) -> bool:
        """Does this call need a person's decision before it runs?"""
        rule = self.needs_approval
        if rule is True or rule is False:
            return rule
        try:
            arguments = json.loads(call.arguments, parse_constant=_not_json) if call.arguments.strip() else {}
            if not isinstance(arguments, dict):
                return True
            return bool(rule(arguments))
        except Exception:  # a predicate that cannot decide asks a person: the safe side
            log.warning("tool %r: needs_approval could not decide on call %r; asking for approval",
                        self.name, call.id, exc_info=True)
            return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def invoke(self, call: Content) -> Content:
        """Run the tool for one tool call. Whatever goes wrong becomes an ``is_error`` result: the model
        sees it and may correct itself, and the run goes on."""
        try:
            arguments = json.loads(call.arguments) if call.arguments.strip() else {}
        except ValueError as exc:
            return Content.tool_result(call.id, f"arguments are not valid JSON: {exc}", is_error=True)
        if not isinstance(arguments, dict):
            return Content.tool_result(call.id, "arguments must be a JSON object", is_error=True)
        try:
            value = self.fn(**arguments)
        except ToolError as exc:
            return Content.tool_result(call.id, str(exc), is_error=True)
        except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's to read, not ours to raise
            return Content.tool_result(call.id, f"{type(exc).__name__}: {exc}", is_error=True)
        if isinstance(value, str):
            return Content.tool_result(call.id, value)
        try:
            return Content.tool_result(call.id, json.dumps(value))
        except (TypeError, ValueError, RecursionError) as exc:  # a datetime, a set, a cycle, any object
            return Content.tool_result(
                call.id, f"the tool returned a {type(value).__name__}, which is not JSON: {exc}", is_error=True
            )


def _not_json(constant: str) -> Any:
    """NaN and Infinity: Python's json reads them, JSON has no such thing (and ``NaN > 50`` is False)."""
    raise ValueError(f"{constant} is not JSON")


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...


@overload
def tool(*, name: str | None = None, description: str | None = None, idempotent: bool = True,
         needs_approval: bool | Callable[[dict[str, Any]], bool] = False,
         approval_deadline: float | None = None) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(fn: Callable[..., Any] | None = None, /, *, name: str | None = None, description: str | None = None,
         idempotent: bool = True, needs_approval: bool | Callable[[dict[str, Any]], bool] = False,
         approval_deadline: float | None = None) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a Tool from a typed function: the schema from its hints, the description from its docstring
    (first paragraph; parameter texts from a Google-style ``Args:`` section)."""

    def build(f: Callable[..., Any]) -> Tool:
        summary, arg_docs = _parse_docstring(inspect.getdoc(f) or "")
        return Tool(name=name or f.__name__,
                    description=description if description is not None else summary,
                    parameters=schema_for(f, arg_docs),
                    fn=f,
                    idempotent=idempotent,
                    needs_approval=needs_approval,
                    approval_deadline=approval_deadline)

    return build(fn) if fn is not None else build


def as_tool(value: Tool | Callable[..., Any]) -> Tool:
    return value if isinstance(value, Tool) else tool(value)


def schema_for(fn: Callable[..., Any], arg_docs: Mapping[str, str] | None = None) -> dict[str, Any]:
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        prop = _json_type(hints.get(param.name, Any), f"{fn.__name__}({param.name})")
        if arg_docs and param.name in arg_docs:
            prop["description"] = arg_docs[param.name]
        properties[param.name] = prop
        if param.default is param.empty:
            required.append(param.name)
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _json_type(hint: Any, where: str) -> dict[str, Any]:
    if hint is Any:
        return {}
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _json_type(options[0], where)
        return {"anyOf": [_json_type(a, where) for a in options]}
    if hint is list or origin is list:
        return {"type": "array", "items": _json_type(args[0], where)} if args else {"type": "array"}
    if hint is dict or origin is dict:
        return {"type": "object"}
    raise ArgumentError(f"@agent.tool cannot describe the type {hint!r} of {where} in JSON schema")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    summary = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    arg_docs: dict[str, str] = {}
    in_args = False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
            continue
        if in_args:
            match = re.match(r"^(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", stripped)
            if match:
                arg_docs[match.group(1)] = match.group(2)
            elif not stripped or not line.startswith((" ", "\t")):
                in_args = False
    return summary, arg_docs
