"""``python -m agent_sessions --store URL <command>``: the command-line interface (see agent_sessions/cli.py
and docs/cli.md)."""

import sys

from .cli import main

sys.exit(main())
