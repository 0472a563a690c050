"""The example's Celery app, with a pool process that dies once right after an ``answer`` task's turn,
before the worker acknowledges it: what a redelivery after a finished turn looks like to the broker
(``acks_late`` and ``reject_on_worker_lost`` hand the task out again)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from celery.signals import task_postrun

from examples.celery_worker.tasks import app

MARK = Path(os.environ["CELERY_EXAMPLE_STATE"]) / "died-once"


@task_postrun.connect
def _die_once_after_the_turn(task: Any = None, **_: Any) -> None:
    if task is not None and task.name == "answer" and not MARK.exists():
        MARK.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["app"]
