"""A Flask front for agent sessions: leave a steer, or post a message that starts (or resumes) a turn.

    AGENT_SESSIONS_DB=sessions.db AGENT_MODEL_URL=http://127.0.0.1:8080/v1 flask --app examples.flask_app.app run

Bad input is a JSON 400 saying what was wrong, another run getting to the session first a 409 (nothing was
written: reload and retry), the store failing a 503; nothing here answers with a traceback.
"""

from __future__ import annotations

import os
from typing import Any

from flask import Flask, jsonify, request
from werkzeug.exceptions import HTTPException

import agent_sessions as agent
from stores import sqlite


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
        result = agent.Runner().run(agent.Spec(session=session, max_steps=8), msgs, endpoint)
        return jsonify(session=session_id, answer=result.text, stop_reason=result.stop_reason, steps=result.steps)

    @app.get("/sessions/<session_id>")
    def transcript(session_id: str) -> Any:
        return jsonify(session=session_id, messages=[m.to_dict() for m in agent.open(session_id, store).messages()])

    @app.errorhandler(agent.ArgumentError)
    def bad_input(exc: agent.ArgumentError) -> Any:
        return jsonify(error=str(exc)), 400

    @app.errorhandler(agent.Conflict)
    def conflict(exc: agent.Conflict) -> Any:
        # Another run holds the session (SessionBusy), took it over (LeaseLost), or saved first
        # (TranscriptConflict): nothing was written; the client may reload and try again.
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
