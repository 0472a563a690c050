"""POST /sessions/<id>/turn starts a turn on a thread of this process and answers 202 at once; the
transcript, read from the store, shows where it has got to, and GET /sessions/<id>/events (the app's view,
agent_sessions.contrib.django.views.events) streams the turn's events as they happen. Steer it with
`manage.py agent_sessions steer`, look at it with `manage.py agent_sessions show` (the command of the app
agent_sessions.contrib.django: python -m agent_sessions on the project's store)."""

from __future__ import annotations

import json
import logging

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

import agent_sessions as agent
from agent_sessions.contrib.django import store

from . import agent as setup

log = logging.getLogger(__name__)


@csrf_exempt
@require_POST
def turn(request: HttpRequest, session_id: str) -> JsonResponse:
    try:
        body = json.loads(request.body or b"{}")
        text = body.get("text") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise agent.ArgumentError('the body must be a JSON object with a string "text"')
        spec = setup.spec(session_id)
        msgs = [*store().messages(session_id), agent.Message.user(text)]
        run = agent.Runner().start(spec, msgs, setup.endpoint())
        run.add_done_callback(_report)  # nobody waits for it: say how it ended
    except (ValueError, agent.ArgumentError) as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    return JsonResponse({"session": session_id, "started": True}, status=202)


def _report(run: agent.Run) -> None:
    if run.error is not None:
        log.error("%s failed", run.name, exc_info=run.error)
    else:
        log.info("%s ended: %s", run.name, run.wait(0).stop_reason)


@require_GET
def transcript(request: HttpRequest, session_id: str) -> JsonResponse:
    try:
        session = agent.open(session_id, store())
        holder = session.holder()
        messages = [m.to_dict() for m in session.messages()]
    except agent.ArgumentError as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    return JsonResponse({"session": session_id, "messages": messages, "running": holder is not None})
