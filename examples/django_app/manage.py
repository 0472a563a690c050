#!/usr/bin/env python
"""python examples/django_app/manage.py migrate | runserver | agent_sessions steer|show|list|approvals ..."""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: examples.*, stores
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "examples.django_app.project.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
