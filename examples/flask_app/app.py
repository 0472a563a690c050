"""A Flask front for agent sessions: leave a steer, post a message that starts (or resumes) a turn, and
approve or deny the tool calls a turn waits on.

    AGENT_SESSIONS_DB=sessions.db AGENT_MODEL_URL=http://127.0.0.1:8080/v1 flask --app examples.flask_app.app run

A refund over 50 needs a person's approval: the turn stops (``awaiting_approval``) and lists the call;
``GET /sessions/<id>/approvals`` shows what waits, ``POST /sessions/<id>/approvals/<call_id>`` with
``{"decision": "approve"}`` or ``{"decision": "deny", "reason": "..."}`` decides (exactly once: a second
decision is a 409) and resumes the turn.

With a store that keeps event logs (``agent.EventStore``), every turn publishes its events, and
``GET /sessions/<id>/events`` streams them to a browser as server-sent events (``text/event-stream``:
``id: <seq>``, ``event: <kind>``, ``data: <json>``), from whichever replica the browser reaches: the run
may be on another. It starts after ``Last-Event-ID`` (what an ``EventSource`` sends when it reconnects)
or ``?after=<seq>``, and ends after a ``finished`` or ``failed`` event or ``SSE_SECONDS``; ``retry:``
tells the browser to come back at once for what follows. A store without event logs answers 501.

Bad input is a JSON 400 saying what was wrong, another run getting to the session first a 409 (nothing was
written: reload and retry), the store failing a 503; nothing here answers with a traceback.
"""

from __future__ import annotations

import os
from typing import Any

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

import agent_sessions as agent
from stores import sqlite

REFUNDS = os.environ.get("REFUNDS_LOG", "refunds.log")
SSE_SECONDS = float(os.environ.get("SSE_SECONDS", "30"))
"""How long one events stream lasts at most: a worker is not held forever by a browser that left."""
SSE_RETRY_MS = agent.eventlog.SSE_RETRY_MS


@agent.tool(idempotent=False, needs_approval=lambda args: args.get("amount", 0) > 50)
def refund(order: str, amount: int) -> str:
    """Refund an order (not idempotent: a second call refunds twice). Over 50, a person approves it first.

    Args:
        order: the order id
        amount: the amount to refund
    """
    with open(REFUNDS, "a") as f:
        f.write(f"{order} {amount}\n")
    return f"refunded {amount} on {order}"


def create_app(store: agent.Store | None = None, endpoint: agent.Endpoint | None = None) -> Flask:
    app = Flask(__name__)
    # One store and one endpoint per process, made when the app is: each holds a pool or a connection.
    store = store or sqlite.open(os.environ.get("AGENT_SESSIONS_DB", "sessions.db"))
    endpoint = endpoint or agent.endpoints.OpenAIChat(
        os.environ.get("AGENT_MODEL_URL", "http://127.0.0.1:8080/v1"), os.environ.get("AGENT_MODEL", "local")
    )

    def text_of_body() -> str:
        body = request.get_json(silent=True)
        if not isinstance(body, dict) or not isinstance(body.get("text"), str):
            raise agent.ArgumentError('the body must be a JSON object with a string "text"')
        return body["text"]

    @app.post("/sessions/<session_id>/steer")
    def steer(session_id: str) -> Any:
        agent.open(session_id, store).steer(text_of_body())
        return jsonify(session=session_id, steered=True), 202

    @app.post("/sessions/<session_id>/messages")
    def message(session_id: str) -> Any:
        text = text_of_body()
        session = agent.open(session_id, store)
        msgs = [*session.messages(), agent.Message.user(text)]
        return answer(session, agent.Runner().run(spec_for(session), msgs, endpoint))

    @app.get("/sessions/<session_id>/approvals")
    def approvals(session_id: str) -> Any:
        waiting = agent.open(session_id, store).pending_approvals()
        return jsonify(session=session_id, approvals=[pending(p) for p in waiting])

    @app.post("/sessions/<session_id>/approvals/<call_id>")
    def decide(session_id: str, call_id: str) -> Any:
        body = request.get_json(silent=True)
        if not isinstance(body, dict) or body.get("decision") not in ("approve", "deny"):
            raise agent.ArgumentError('the body must be a JSON object with "decision": "approve" or "deny"')
        reason = body.get("reason", "")
        if not isinstance(reason, str):
            raise agent.ArgumentError('"reason" must be a string')
        session = agent.open(session_id, store)
        if body["decision"] == "approve":
            session.approve(call_id)
        else:
            session.deny(call_id, reason)
        # Resume the turn now; it runs the approved call once, or waits on for the other decisions. It waits
        # for the lease: two calls decided at once each resume, and the second must not answer 409 ("nothing
        # written") after its decision was written; it finds the turn finished, or finishes it.
        return answer(session, agent.Runner().run(spec_for(session, lease_wait=30.0), session.messages(), endpoint))

    @app.get("/sessions/<session_id>/events")
    def events(session_id: str) -> Any:
        after = agent.eventlog.sse_after(request.headers.get("Last-Event-ID"), request.args.get("after"))
        # follow() checks the store and its arguments here, before the stream starts: errors are JSON.
        following = agent.open(session_id, store).follow(after=after, timeout=SSE_SECONDS)
        return Response(agent.eventlog.sse_stream(following, SSE_RETRY_MS), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def spec_for(session: agent.StoreSession, lease_wait: float = 0.0) -> agent.Spec:
        # Publish the turn's events where the store keeps them, so any replica can stream them.
        return agent.Spec(session=session, tools=[refund], max_steps=8, lease_wait=lease_wait,
                          publish_events=isinstance(store, agent.EventStore))

    def answer(session: agent.StoreSession, result: agent.Result) -> Any:
        return jsonify(session=session.id, answer=result.text, stop_reason=result.stop_reason, steps=result.steps,
                       approvals=[pending(p) for p in result.pending_approvals])

    def pending(p: agent.PendingApproval) -> dict[str, Any]:
        return {"call_id": p.call_id, "tool": p.tool, "arguments": p.arguments, "asked": p.asked.isoformat(),
                "deadline": None if p.deadline is None else p.deadline.isoformat()}

    @app.get("/sessions/<session_id>")
    def transcript(session_id: str) -> Any:
        return jsonify(session=session_id, messages=[m.to_dict() for m in agent.open(session_id, store).messages()])

    @app.errorhandler(agent.UnknownApproval)
    def no_such_approval(exc: agent.UnknownApproval) -> Any:
        return jsonify(error=str(exc)), 404

    @app.errorhandler(agent.Unsupported)
    def unsupported(exc: agent.Unsupported) -> Any:
        return jsonify(error=str(exc)), 501

    @app.errorhandler(agent.ArgumentError)
    def bad_input(exc: agent.ArgumentError) -> Any:
        return jsonify(error=str(exc)), 400

    @app.errorhandler(agent.Conflict)
    def conflict(exc: agent.Conflict) -> Any:
        # Another run holds the session (SessionBusy), took it over (LeaseLost), or saved first
        # (TranscriptConflict), or the call was decided already (AlreadyDecided): nothing was written.
        return jsonify(error=str(exc), conflict=type(exc).__name__), 409

    @app.errorhandler(agent.EndpointError)
    def model_failed(exc: agent.EndpointError) -> Any:
        return jsonify(error=f"the model endpoint failed: {exc}"), 502

    @app.errorhandler(agent.StoreError)
    def store_failed(exc: agent.StoreError) -> Any:
        return jsonify(error=f"the session store failed: {exc}"), 503

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Any:
        return jsonify(error=exc.description), exc.code

    @app.errorhandler(Exception)
    def unexpected(exc: Exception) -> Any:
        app.logger.exception("unhandled error")  # the traceback goes to the log, not to the client
        return jsonify(error="internal error"), 500

    return app
