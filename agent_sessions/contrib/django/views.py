"""The app's view: ``events``, a session's event log as server-sent events. The app serves nothing by
itself: a project ``include``s ``urls``, or routes to the view through its own authorization (docs/django.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse  # type: ignore[import-untyped]
from django.views.decorators.csrf import csrf_exempt  # type: ignore[import-untyped]

import agent_sessions as agent
from agent_sessions.eventlog import sse_after, sse_stream

from . import options, store

log = logging.getLogger(__name__)


@csrf_exempt  # type: ignore[untyped-decorator]  # a GET changes nothing; any other method is refused (405) before anything is read
def events(request: HttpRequest, session_id: str) -> HttpResponse:
    """``GET``: the session's events after ``Last-Event-ID`` or ``?after=<seq>``, as they arrive. The response
    ends after a ``finished`` or ``failed`` event, or after ``SSE_SECONDS``, so a browser that left holds a
    worker that long at most (it reconnects with its last id). Bad input is a JSON 400, a store without an
    event log 501."""
    if request.method != "GET":
        refused = JsonResponse({"error": f"{request.method} is not allowed here; use GET"}, status=405)
        refused["Allow"] = "GET"
        return refused
    try:
        after = sse_after(request.headers.get("Last-Event-ID"), request.GET.get("after"))
        session = agent.open(session_id, store())
        seconds = options()["SSE_SECONDS"]
        following = session.follow(after=after, timeout=seconds)
        notice = silence_notice(session, seconds) if after == 0 else None
    except agent.ArgumentError as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    except agent.Unsupported as exc:
        return JsonResponse({"error": str(exc)}, status=501)
    response = StreamingHttpResponse(_ending_on_store_errors(sse_stream(following), session_id, notice),
                                     content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx: pass each event on as it comes, do not buffer the body
    return response


def silence_notice(session: agent.StoreSession, seconds: float) -> str | None:
    """An SSE comment (a line starting with ``:``, which ``EventSource`` ignores and a person reading the
    stream sees) when the session's log holds no event: a run started without ``publish_events=True``
    writes none, and the stream would otherwise be a silent wait of ``seconds``."""
    if session.events(after=0, limit=1):
        return None
    held = isinstance(session.store, agent.RunStore) and session.holder() is not None
    now = ("a run holds this session and has written no event: it runs without Spec(publish_events=True)"
           if held else "this session's event log is empty")
    return (f": {now}; only a run with Spec(publish_events=True) writes events here. Without one this stream "
            f"stays silent and ends after {seconds:g} s.\n\n")


def _ending_on_store_errors(stream: Iterator[str], session_id: str, notice: str | None = None) -> Iterator[str]:
    """The stream, ended rather than broken off with a traceback when the store fails mid-stream (the status
    was sent already): the browser reconnects after ``retry`` with its last id, as after any end. ``notice``
    (a comment) follows the ``retry`` line."""
    try:
        for number, chunk in enumerate(stream):
            yield chunk
            if number == 0 and notice:
                yield notice
    except agent.StoreError as exc:
        log.warning("the events stream of session %r ended: the store failed (%s)", session_id, exc)
