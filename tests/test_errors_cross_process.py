"""Every error of the agent_sessions family crosses a process boundary intact: a Celery result backend
and a multiprocessing pool pickle it, and ``except agent.SessionBusy as e`` on the other side must catch
it with ``e.holder``. The classes are discovered (every AgentError subclass defined in agent_sessions or
stores), and each is made from arguments drawn for its constructor's own signature, so a new error class
is covered without anyone listing it here."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import multiprocessing
import pickle
import pkgutil
import types
import typing
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import agent_sessions as agent
import stores

DJANGO_LOADS = ("agent_sessions.contrib.django.models", "agent_sessions.contrib.django.admin",
                "agent_sessions.contrib.django.console")
"""Modules only a configured Django project imports (its app registry loads the app's models and admin, and
the admin the console's pages): they need Django's settings to import, and define no error of the library."""


def _modules() -> Iterator[str]:
    for package in (agent, stores):
        for found in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not found.name.endswith("__main__") and not found.name.startswith(DJANGO_LOADS):  # __main__: the CLI
                yield found.name                                                                  # runs when imported


def _subclasses(cls: type[agent.AgentError]) -> Iterator[type[agent.AgentError]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def error_classes() -> list[type[agent.AgentError]]:
    for name in _modules():
        importlib.import_module(name)
    ours = {c for c in _subclasses(agent.AgentError) if c.__module__.split(".")[0] in ("agent_sessions", "stores")}
    return sorted(ours | {agent.AgentError}, key=lambda c: c.__qualname__)


CLASSES = error_classes()


def values(hint: Any) -> st.SearchStrategy[Any]:
    """Values of a constructor parameter's type. Floats leave out NaN (it never equals itself, so a
    faithful copy would look different); dataclasses (``Holder``, ``Decision``) are built field by field."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(values(h) for h in typing.get_args(hint)))
    if origin is list:
        return st.lists(values(typing.get_args(hint)[0]), max_size=3)
    if hint is float:
        return st.floats(allow_nan=False)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        fields = typing.get_type_hints(hint)
        return st.builds(hint, **{f.name: values(fields[f.name]) for f in dataclasses.fields(hint)})
    return st.from_type(hint)


def constructions(cls: type[agent.AgentError]) -> st.SearchStrategy[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The positional and keyword arguments of one call of ``cls``, every parameter given (optional ones
    too, so an attribute set from a default-less path is still compared). A class with no ``__init__`` of
    its own takes the message, as ``Exception`` does."""
    init = cls.__init__
    if not inspect.isfunction(init):  # a builtin's (Exception's, TypeError's): a message
        return st.tuples(st.tuples(st.text()), st.just({}))
    hints = typing.get_type_hints(init)
    positional: list[st.SearchStrategy[Any]] = []
    keyword: dict[str, st.SearchStrategy[Any]] = {}
    for p in list(inspect.signature(init).parameters.values())[1:]:
        if p.kind is p.KEYWORD_ONLY:
            keyword[p.name] = values(hints[p.name])
        else:
            positional.append(values(hints[p.name]))
    return st.tuples(st.tuples(*positional), st.fixed_dictionaries(keyword))


ERRORS = st.sampled_from(CLASSES).flatmap(
    lambda cls: constructions(cls).map(lambda call: (cls, call[0], call[1])))


def make(cls: type[agent.AgentError], args: tuple[Any, ...], kwargs: dict[str, Any]) -> agent.AgentError:
    return cls(*args, **kwargs)


def serve(conn: Connection) -> None:
    """Run in another process: makes each error asked for and sends it back (the pipe pickles it here and
    unpickles it there, as a pool or a result backend does), until told to stop."""
    while (call := conn.recv()) is not None:
        conn.send(make(*call))


def public(error: BaseException) -> dict[str, Any]:
    """What a caller can read off the error: its class, message, ``args`` and every public attribute
    (its own, ``ImportError``'s ``name``/``path``/``msg`` for ``StoresShadowed``), methods aside."""
    attributes = {a: getattr(error, a) for a in dir(error)
                  if not a.startswith("_") and not callable(getattr(error, a))}
    return {"class": type(error), "str": str(error), **attributes}


def test_the_discovery_finds_the_family_and_each_is_exported() -> None:
    names = {c.__name__ for c in CLASSES}
    assert {"SessionBusy", "TranscriptConflict", "TranscriptDeleted", "LeaseLost", "OutcomeUnknown", "SessionLocked",
            "AwaitingApproval", "AlreadyDecided", "EndpointError", "StoresShadowed"} <= names
    assert [c.__name__ for c in CLASSES if getattr(agent, c.__name__, None) is not c] == [], \
        "an error class the package does not export: a caller cannot name it in an except clause"


@settings(max_examples=300, deadline=None)
@given(ERRORS)
def test_every_error_pickles_to_the_same_class_with_the_same_attributes(
    error: tuple[type[agent.AgentError], tuple[Any, ...], dict[str, Any]],
) -> None:
    original = make(*error)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        copy = pickle.loads(pickle.dumps(original, protocol))
        assert public(copy) == public(original), f"protocol {protocol}"
    assert (copy.args, vars(copy)) == (original.args, vars(original))


def test_a_note_and_an_attribute_set_after_the_raise_are_kept() -> None:
    busy = agent.SessionBusy("session 'a' is held", agent.Holder("h", 7, "t" * 32, 1.0, epoch=3))
    busy.add_note("while answering msg-41")
    busy.args = ("rewritten",)
    copy = pickle.loads(pickle.dumps(busy))
    assert copy.__notes__ == ["while answering msg-41"] and copy.args == ("rewritten",) and str(copy) == "rewritten"
    assert copy.holder == busy.holder


class Child:
    """A spawned process (nothing inherited: an error is rebuilt from its pickle alone) that makes errors."""

    def __init__(self) -> None:
        self.conn, theirs = multiprocessing.Pipe()
        self.process = multiprocessing.get_context("spawn").Process(target=serve, args=(theirs,), daemon=True)
        self.process.start()

    def made(self, cls: type[agent.AgentError], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.conn.send((cls, args, kwargs))
        assert self.conn.poll(60), "the child process did not answer within 60 s"
        return self.conn.recv()

    def stop(self) -> None:
        self.conn.send(None)
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


@pytest.fixture(scope="module")
def child() -> Iterator[Child]:
    c = Child()
    yield c
    c.stop()


@settings(max_examples=60, deadline=None)
@given(error=ERRORS)
def test_every_error_made_in_another_process_arrives_whole(
    child: Child, error: tuple[type[agent.AgentError], tuple[Any, ...], dict[str, Any]]
) -> None:
    assert public(child.made(*error)) == public(make(*error))


def test_session_busy_from_another_process_is_caught_by_its_own_class_with_its_holder(child: Child) -> None:
    holder = agent.Holder("worker-3", 4182, "9f" * 16, 1_800_000_000.5, epoch=12)
    try:
        raise child.made(agent.SessionBusy, ("session 'a' is held", holder), {})
    except agent.SessionBusy as e:
        assert e.holder == holder and str(e) == "session 'a' is held"
