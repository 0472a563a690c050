"""A run in a process of its own: ``python -m tests.console_site.run_turn SESSION TEXT`` runs one turn of
the session (the project's spec, the model endpoint of AGENT_MODEL_URL) and prints its Result as JSON.
The console's tests steer and cancel it from the browser."""

from __future__ import annotations

import dataclasses
import json
import sys

import agent_sessions as agent
from tests.console_site.agent import endpoint, spec, store


def main() -> None:
    session, text = sys.argv[1], sys.argv[2]
    made = store()
    opened = agent.open(session, made)
    run = agent.Runner().start(dataclasses.replace(spec(), session=opened),
                               [*opened.messages(), agent.Message.user(text)], endpoint())
    print(json.dumps({"started": session}), flush=True)
    result = run.wait(120)
    print(json.dumps({"stop_reason": result.stop_reason, "text": result.text}), flush=True)


if __name__ == "__main__":
    main()
