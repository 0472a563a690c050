"""``manage.py agent_sessions COMMAND ...`` is ``python -m agent_sessions COMMAND ...`` on the project's store
(one command named after the app, rather than ``show``, ``sessions``... beside Django's own). The arguments
go to ``cli.main``, so there is one implementation of each command, and a difference between the two doors
would be a bug of this module."""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence
from typing import Any

from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]
from django.core.management.base import BaseCommand, CommandError, CommandParser  # type: ignore[import-untyped]

import agent_sessions as agent
from agent_sessions import cli
from agent_sessions.stranded import Resolve

from ... import options, resolve, store

_DJANGO_OPTIONS = ("--settings", "--pythonpath")
"""What ``manage.py`` reads before it picks the command (``ManagementUtility``), and may stand anywhere on
the line: dropped before the CLI's parser, which would refuse them."""


def without_django_options(argv: Sequence[str]) -> list[str]:
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _DJANGO_OPTIONS:
            skip = True
        elif not arg.startswith(tuple(f"{name}=" for name in _DJANGO_OPTIONS)):
            kept.append(arg)
    return kept


def project_store() -> agent.Store:
    """The app's store; a misconfigured one is the CLI's exit 4 with Django's message (a driver missing, or
    a project's own ``stores`` package, is its exit 3, as from the CLI)."""
    try:
        return store()
    except ImproperlyConfigured as exc:
        raise cli.Exit(cli.STORE_FAILED, f"the agent-sessions store is misconfigured: {exc}") from exc


def project_resolve(info: agent.SessionInfo) -> tuple[agent.Spec, agent.Endpoint] | None:
    """``AGENT_SESSIONS["RESOLVE"]``, imported when ``recover`` or ``work`` first calls it."""
    try:
        found = resolve()
    except ImproperlyConfigured as exc:
        raise cli.Exit(cli.USAGE, str(exc)) from exc
    assert found is not None  # given to the CLI only when the setting is there
    return found(info)


def _configured_resolve() -> Resolve | None:
    try:
        return project_resolve if options()["RESOLVE"] is not None else None
    except ImproperlyConfigured:
        return None  # the store's first use says what is wrong


class Command(BaseCommand):  # type: ignore[misc]
    """From ``manage.py`` it exits with the CLI's code; from ``call_command`` a code other than 0 is a
    ``CommandError`` carrying it (``returncode``)."""

    help = "The agent-sessions command line on this project's store: manage.py agent_sessions --help."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("args", nargs="...", metavar="COMMAND ...", help="as python -m agent_sessions takes")

    def run_cli(self, argv: Sequence[str], out: Any, err: Any) -> int:
        prog = f"manage.py {type(self).__module__.rpartition('.')[2]}"
        return cli.main(list(argv), make_store=project_store, prog=prog, stdout=out, stderr=err,
                        resolve=_configured_resolve())

    def run_from_argv(self, argv: list[str]) -> None:
        """``manage.py agent_sessions ...``: the rest of the line is the CLI's, help included."""
        from django.db import connections  # type: ignore[import-untyped]

        try:
            code = self.run_cli(without_django_options(argv[2:]), sys.stdout, sys.stderr)
        finally:
            connections.close_all()
        sys.exit(code)

    def print_help(self, prog_name: str, subcommand: str) -> None:
        cli.build_parser(f"{prog_name} {subcommand}", store_option=False).print_help()

    def handle(self, *args: str, **options: Any) -> None:
        """``call_command``: what the CLI says on stderr is also the ``CommandError``'s message."""
        err = io.StringIO()
        code = self.run_cli(args, self.stdout, err)
        if err.getvalue():
            self.stderr.write(err.getvalue())
        if code != cli.OK:
            raise CommandError(err.getvalue().strip() or f"exit {code}: {cli.EXIT_CODES.get(code, '?')}",
                               returncode=code)
