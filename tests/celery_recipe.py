"""The example's Celery app as the recipe's tests run it on Redis, changed to fit a test's time while
keeping what a deployment sees:

- a task whose whole worker died comes back after 5 s instead of an hour (``visibility_timeout``, with the
  transport looking for such tasks every second instead of every ~100 s). A task still running, or not
  yet handed back, 5 s after its delivery is handed out once more too: that delivery's turn finds the
  answer stored (the turn's key) and asks the model nothing, which the tests allow for;
- the lease lasts 8 s rather than the example's 2 s: longer than a worker takes to notice its dead pool
  process and hand the task back (a few seconds), and than the visibility timeout, as the default 30 s
  is in a deployment, so the next delivery finds the dead run's lease still held and waits it out;
- ``answer_briefly``, whose run waits for a busy session half a second (``lease_wait``), so that a session
  another run keeps makes it fail with ``SessionBusy`` within the test."""

from __future__ import annotations

import dataclasses

import agent_sessions as agent
from examples.celery_worker import tasks
from examples.celery_worker.tasks import app, endpoint, spec, store

tasks.LEASE_TTL = 8.0  # read by tasks.spec at each task

app.conf.broker_transport_options = {**app.conf.broker_transport_options, "visibility_timeout": 5,
                                     "unacked_restore_interval": 1, "unacked_restore_throttle": 1}


@app.task(name="answer_briefly")
def answer_briefly(session_id: str, text: str, message_id: str) -> str:
    brief = dataclasses.replace(spec(agent.open(session_id, store)), lease_wait=0.5)
    return agent.Runner().turn(brief, text, message_id, endpoint).text


__all__ = ["app"]
