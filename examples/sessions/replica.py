"""One replica of the example: a process holding nothing but the path of the SQLite file.

    python replica.py steer  --db F --session S --text T       leave a steer; no run anywhere
    python replica.py run    --db F --session S ...            start the conversation from the store
    python replica.py resume --db F --session S --text T ...   carry on from the stored transcript

Each prints one JSON line saying what it did.
"""

from __future__ import annotations

import argparse
import json
import os

from tools import TOOLS

import agent_sessions as agent
from stores import sqlite

SYSTEM = "You review Go code. Use the tools to read files before you answer; cite file and line."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["steer", "run", "resume"])
    parser.add_argument("--db", required=True)
    parser.add_argument("--session", required=True)
    parser.add_argument("--text", default="")
    parser.add_argument("--base-url", default="")
    parser.add_argument("--model", default="")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--max-steps", type=int, default=4)
    args = parser.parse_args()

    store = sqlite.open(args.db)
    session = agent.open(args.session, store)
    out: dict[str, object] = {"pid": os.getpid()}

    if args.role == "steer":
        session.steer(args.text)
    else:
        endpoint = agent.endpoints.OpenAIChat(args.base_url, args.model, args.api_key,
                                              extra={"temperature": 0, "max_tokens": 256})
        spec = agent.Spec(max_steps=args.max_steps, session=session, tools=TOOLS, system=SYSTEM)
        # Replica A knows nothing: whatever the store holds (nothing on a new file; the conversation so far
        # when the example runs again on the same --db) and the steers waiting are the conversation.
        msgs = store.messages(args.session)
        if args.role == "resume":
            out["resumed_from"] = len(msgs)
            msgs.append(agent.Message.user(args.text))
        result = agent.Runner().run(spec, msgs, endpoint)
        out.update(steps=result.steps, stop_reason=result.stop_reason, answer=result.text,
                   messages=len(result.messages))
    print(json.dumps(out), flush=True)
    store.close()


if __name__ == "__main__":
    main()
