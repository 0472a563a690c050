"""One front door behind two: ``python -m agent_sessions`` and ``manage.py agent_sessions`` (the Django
app's command, here the example project's ``manage.py``) over the same sessions, each a real process,
print the same lines, the same ``--json`` and the same errors, and exit with the same codes (issue 28).

Each case is a sequence of commands run on sessions prepared afresh for each door, so a command that
changes something (cancel, approve, deny, prune) meets the same state through both. Outputs are compared
as they are, but for what differs by construction: the name of the front door, the times the sessions
were written at and the lease's token (each preparation writes them anew), and the CLI's ``--store``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import agent_sessions as agent
from agent_sessions import cli
from agent_sessions.lease import claimant
from stores import postgres, sqlite
from tests import servers

ROOT = Path(__file__).resolve().parents[1]
MANAGE = ROOT / "examples" / "django_app" / "manage.py"
DJANGO_PROG = "manage.py agent_sessions"

TRANSCRIPT = [
    agent.Message.user("What's the weather?"),
    agent.Message(agent.Role.ASSISTANT, [agent.Content.from_text("Let me look."),
                                         agent.Content.tool_call("call_1", "get_weather", '{"city": "Paris"}')]),
    agent.Message(agent.Role.USER, [agent.Content.tool_result("call_1", "18°C\nsunny")]),
    agent.Message.assistant("It is 18°C and sunny."),
]


@agent.tool(idempotent=False, needs_approval=True)
def refund(order: str) -> str:
    """Refund an order."""
    return f"refunded {order}"


class AsksARefund:
    """The model of the session left waiting: its reply calls ``refund``, which needs a person's decision."""

    def complete(self, system: str, messages: Any, tools: Any) -> agent.Message:
        return agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("r1", "refund", '{"order": "7"}')])


def prepare(store: Any) -> None:
    """Three sessions: ``chat`` (a transcript, metadata and a steer waiting), ``held`` (a live run holds
    it), ``waiting`` (its turn waits for a decision on call r1)."""
    for sid in ("chat", "held", "waiting", "c-2"):
        store.delete(sid, force=True)
    store.save("chat", TRANSCRIPT)
    store.set_metadata("chat", {"user": "u-17"})
    store.add_steer("chat", "answer in French")
    store.save("held", [agent.Message.user("hi")])
    store.acquire("held", claimant(), 300.0)
    spec = agent.Spec(session=agent.open("waiting", store), tools=[refund])
    result = agent.Runner().run(spec, [agent.Message.user("refund order 7")], AsksARefund())
    assert result.stop_reason == "awaiting_approval"


CASES: dict[str, list[list[str]]] = {
    "list, show and info": [["list"], ["show", "chat"], ["show", "chat", "--all", "--json"], ["show", "waiting"],
                            ["info", "waiting", "--json"], ["info", "nobody"]],
    "approvals and decisions": [["approvals", "waiting"], ["approve", "waiting", "r1"], ["approve", "waiting", "r1"],
                                ["deny", "waiting", "nope", "--reason", "late"], ["approvals", "waiting", "--json"]],
    "deny": [["deny", "waiting", "r1", "--reason", "not today", "--json"]],
    "cancel": [["cancel", "chat"], ["cancel", "held"], ["cancel", "waiting"], ["show", "waiting", "--all"]],
    "steer, holder, prune and usage": [["steer", "chat", "and briefly", "--json"], ["holder", "chat"],
                                       ["prune", "--idle-for", "365d"], ["show"], ["prune", "--idle-for", "30x"]],
}
EXPECTED_CODES: dict[str, list[int]] = {
    "list, show and info": [0, 0, 0, 0, 0, 1],
    "approvals and decisions": [0, 0, 5, 1, 1],  # decided once: the second is a conflict; then nothing waits
    "deny": [0],
    "cancel": [1, 0, 0, 0],  # no run and no waiting turn: 1; a run asked to stop; the waiting turn closed
    "steer, holder, prune and usage": [0, 1, 0, 2, 2],
}


@dataclass
class Door:
    """Both doors onto one database: the CLI's ``--store`` and the environment of the example project's
    ``manage.py``, and the test's own store on it."""

    store: Any
    url: str
    env: dict[str, str]

    def cli(self, args: Sequence[str]) -> tuple[int, str, str]:
        return self._run([sys.executable, "-m", "agent_sessions", "--store", self.url, *args], cli.PROG)

    def django(self, args: Sequence[str]) -> tuple[int, str, str]:
        return self._run([sys.executable, str(MANAGE), "agent_sessions", *args], DJANGO_PROG)

    def _run(self, argv: list[str], prog: str) -> tuple[int, str, str]:
        done = subprocess.run(argv, capture_output=True, text=True, env=self.env, stdin=subprocess.DEVNULL,
                              timeout=120)  # a second or so; a bound, not a budget
        assert "Traceback" not in done.stderr, done.stderr
        # stderr's white space collapsed: argparse wraps a usage line by its length, which --store changes
        return done.returncode, normal(done.stdout, prog), " ".join(normal(done.stderr, prog).split())


_TIME = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\.\d+)?(\+00:00)?")
_TOKEN = re.compile(r"token [0-9a-f]{8}…")


def normal(text: str, prog: str) -> str:
    """``text`` without what differs by construction; ``--store`` too, which only the CLI's usage line
    shows (Django's door works on the project's store and has no such option)."""
    text = text.replace(prog, "<door>").replace(" [--store URL]", "")
    return _TOKEN.sub("token <token>…", _TIME.sub("<time>", text))


@pytest.fixture(params=["sqlite", "postgres"])
def door(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Door]:
    yield from doors(request.param, tmp_path)


@pytest.fixture
def sqlite_door(tmp_path: Path) -> Iterator[Door]:
    yield from doors("sqlite", tmp_path)


def doors(kind: str, tmp_path: Path) -> Iterator[Door]:
    env = {k: v for k, v in os.environ.items() if k not in (cli.ENV_STORE, "DJANGO_SETTINGS_MODULE")}
    env.update(PYTHONPATH=str(ROOT), DJANGO_APP_STATE=str(tmp_path))
    if kind == "sqlite":
        path = tmp_path / "django.sqlite3"  # the example project's database: its DATABASES names this file
        store = sqlite.open(path)
        yield Door(store, str(path), {**env, "DJANGO_DB_URL": ""})
        store.close()
        return
    from sqlalchemy import create_engine

    url = servers.database_url(servers.POSTGRES_URL, servers.database_name("doors"))
    engine = create_engine(url, pool_size=2)
    servers.fresh_schema(engine)
    yield Door(postgres.Store(engine), url, {**env, "DJANGO_DB_URL": url.replace("postgresql+psycopg", "postgresql")})
    engine.dispose()


@pytest.mark.parametrize("case", list(CASES))
def test_both_front_doors_print_the_same_and_exit_the_same(door: Door, case: str) -> None:
    prepare(door.store)
    through_cli = [door.cli(args) for args in CASES[case]]
    prepare(door.store)
    through_django = [door.django(args) for args in CASES[case]]
    for args, by_cli, by_django in zip(CASES[case], through_cli, through_django, strict=True):
        assert by_cli == by_django, f"{' '.join(args)}:\n  CLI    {by_cli}\n  Django {by_django}"
    # And what they say is what the commands mean, not merely the same on both sides:
    codes = [code for code, _, _ in through_cli]
    assert codes == EXPECTED_CODES[case], list(zip(CASES[case], through_cli, strict=True))



def test_the_outputs_say_what_the_issue_asked(sqlite_door: Door) -> None:
    """The lines the two doors used to disagree on, as both now print them (the comparison above is on
    both databases)."""
    door = sqlite_door
    prepare(door.store)
    code, out, _ = door.django(["show", "chat", "--all"])
    assert code == 0 and "#1 user:\n  What's the weather?\n#2 assistant:" in out and "#0" not in out, out
    assert "steers waiting: 1\n  answer in French\n" in out
    code, out, _ = door.django(["show", "waiting"])
    assert 'calls waiting for a decision: 1 (approve SID CALL_ID, or deny)\n  r1  refund({"order": "7"})  asked ' \
        in out, out
    code, out, _ = door.cli(["info", "waiting"])
    assert "\napprovals: 1 waiting" in out and '\n  r1  refund({"order": "7"})' in out, out
    code, out, err = door.django(["cancel", "waiting"])
    assert (code, out) == (0, "closed the turn of session waiting that waited for approval: its 1 call waiting "
                              "will not run\n"), (out, err)
    assert "its run stops" not in out
    code, out, _ = door.cli(["prune", "--idle-for", "365d"])
    assert (code, out) == (0, "deleted 0 sessions not updated for 365d\n")
