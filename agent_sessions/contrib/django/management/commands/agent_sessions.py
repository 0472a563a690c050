"""``manage.py agent_sessions COMMAND ...``: the command line (``python -m agent_sessions``) on the
project's store: list, show, info, steer, cancel, approvals, approve, deny, holder, fork, delete, prune,
metadata, stranded, recover, work (``recover`` and ``work`` with ``AGENT_SESSIONS["RESOLVE"]`` unless given
``--resolve``). One command named after the app, rather than ``show``, ``sessions``... beside Django's own:
docs/django.md says why."""

from __future__ import annotations

from ..base import CliCommand


class Command(CliCommand):
    pass
