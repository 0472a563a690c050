"""What the app's management commands share: the store, ``--json``, and one way of failing.

Each command computes one result, a JSON-able dict, and prints it either as JSON (``--json``, for scripts:
one object on stdout) or as lines for a person. The library's errors (a bad session id, empty text, a
store that cannot be reached) and a misconfigured store become ``CommandError``: the message on stderr,
exit status 1, no traceback.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]
from django.core.management.base import BaseCommand, CommandError, CommandParser  # type: ignore[import-untyped]

import agent_sessions as agent
from agent_sessions import cli
from agent_sessions.contract import Scalar

from .. import store


class StoreCommand(BaseCommand):  # type: ignore[misc]
    """A command on ``agent_sessions.contrib.django.store()``: subclasses define ``arguments`` and
    ``run``, which returns what ``--json`` prints; ``lines`` says it for a person."""

    def add_arguments(self, parser: CommandParser) -> None:
        self.arguments(parser)
        parser.add_argument("--json", action="store_true", help="print the result as one JSON object")

    def arguments(self, parser: CommandParser) -> None:
        """The command's own arguments."""

    def run(self, store: agent.Store, options: Mapping[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def lines(self, result: Mapping[str, Any]) -> list[str]:
        raise NotImplementedError

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            result = self.run(store(), options)
        except (agent.AgentError, ImproperlyConfigured) as exc:
            raise CommandError(str(exc)) from exc
        if options["json"]:
            self.stdout.write(json.dumps(result))  # ASCII: a lone surrogate (a message may hold one) is \\udXXX
        else:
            for line in self.lines(result):
                self.stdout.write(line)


def lifecycle(store: agent.Store, command: str) -> agent.LifecycleStore:
    """The store, if it can list, inspect and prune sessions."""
    if not isinstance(store, agent.LifecycleStore):
        raise CommandError(f"manage.py {command} needs a store that manages sessions (agent_sessions.LifecycleStore: "
                           f"list_sessions, info, prune, tail); {store!r} is not one")
    return store


def duration(text: str) -> timedelta:
    """``30d``, ``12h``, ``15m``, ``90s`` or a sum of them (``1d12h``), as ``python -m agent_sessions``
    reads them; for argparse (its ``type=``)."""
    return timedelta(seconds=cli.duration(text))


def metadata_filter(text: str) -> tuple[str, Scalar]:
    """``key=value`` for ``--where``. A value that parses as a JSON scalar is that scalar (``n=17`` is the
    number 17, ``ok=true`` the boolean, ``n='"17"'`` the string "17"); any other is the text itself
    (``user=u-17``). Values compare by their JSON form, as in ``list_sessions(where=)``."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not key=value")
    try:
        value = json.loads(raw)
    except ValueError:
        return key, raw
    if not isinstance(value, (str, int, float, bool)):
        raise argparse.ArgumentTypeError(f"{text!r}: the value must be a JSON scalar or plain text")
    return key, value
