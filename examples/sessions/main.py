"""examples/sessions: three runners over one SQLite file and nothing else — no channel, no mutex, no Run
shared. Each replica is its own OS process (replica.py); all they share is the path of the file.

    python examples/sessions/main.py                        a scripted model server, started here
    python examples/sessions/main.py --base-url URL --model M   any OpenAI-compatible server instead
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import agent_sessions as agent
from stores import sqlite

HERE = Path(__file__).parent
SESSION = "conversation-1"
STEER = "check the lease expiry, not the token"
FOLLOW_UP = "and which line returns the token error?"


def replica(*args: str) -> dict[str, object]:
    # A bound for a real model's answers too (a scripted one takes a second): a hung replica is an error.
    out = subprocess.run([sys.executable, str(HERE / "replica.py"), *args], capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0:
        sys.exit(f"replica {args[0]} failed:\n{out.stderr}")
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=os.environ.get("AGENT_SESSIONS_BASE_URL", ""))
    parser.add_argument("--model", default=os.environ.get("AGENT_SESSIONS_MODEL", "scripted"))
    parser.add_argument("--db", default="", help="the SQLite file (default: a new one in a temporary directory)")
    args = parser.parse_args()

    server = None
    if args.base_url:
        print(f"model       {args.model} at {args.base_url}")
    else:
        server = subprocess.Popen([sys.executable, str(HERE / "scripted_model.py"), "--port", "0"],
                                  stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None
        args.base_url = server.stdout.readline().split()[-1]
        print(f"model       a scripted OpenAI-compatible server at {args.base_url} (pid {server.pid}):")
        print("            a fixed script, not a language model; pass --base-url/--model for a real one")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            db = args.db or str(Path(tmp) / "sessions.db")
            model = ["--base-url", args.base_url, "--model", args.model]

            b = replica("steer", "--db", db, "--session", SESSION, "--text", STEER)
            print(f"replica B   left a steer in {Path(db).name}, holding no run — there was none yet (pid {b['pid']})")

            a = replica("run", "--db", db, "--session", SESSION, "--max-steps", "2", *model)
            print(f"replica A   ran {a['steps']} steps and was never told replica B existed (pid {a['pid']}, "
                  f"{a['stop_reason']})")
            print(f"            \"{a['answer']}\"")

            store = sqlite.open(db)
            transcript = store.messages(SESSION)
            store.close()
            steer_at = [i for i, m in enumerate(transcript) if m == agent.Message.user(STEER)]
            print(f"transcript  {len(transcript)} messages, and the steer is message "
                  f"{', '.join(map(str, steer_at)) or 'none'} of them")

            c = replica("resume", "--db", db, "--session", SESSION, "--text", FOLLOW_UP, *model)
            print(f"replica C   resumed from {c['resumed_from']} messages it never produced, and answered "
                  f"(pid {c['pid']}, {c['steps']} steps)")
            print(f"            \"{c['answer']}\"")

            # Counted straight from the file, so the count itself takes nothing.
            with sqlite3.connect(db) as conn:
                left = conn.execute("SELECT count(*) FROM agent_steers").fetchone()[0]
            once = "it was handed over exactly once" if left == 0 else "it was NOT taken"
            print(f"steers      {left} left in the store: {once}")
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)


if __name__ == "__main__":
    main()
