"""python manage.py steer <session> "<text>": leave a steer for the session's run, wherever it runs."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

import agent_sessions as agent

from ... import agent as setup


class Command(BaseCommand):
    help = "Leave a steer for a session; its run (in any process) takes it before its next model request."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("session")
        parser.add_argument("text")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            agent.open(options["session"], setup.store()).steer(options["text"])
        except agent.ArgumentError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"steered {options['session']}")
