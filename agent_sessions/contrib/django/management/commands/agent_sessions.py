"""``manage.py agent_sessions COMMAND ...``: the command line (``python -m agent_sessions``) on the project's
store. One command named after the app, rather than ``show``, ``sessions``... beside Django's own.
"""

from __future__ import annotations

from ..base import CliCommand


class Command(CliCommand):
    pass
