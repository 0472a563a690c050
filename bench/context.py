"""Resuming a long compacted session (issue 27): what a resume costs at N = 100,000 stored messages beside
N = 1,000, when the session was compacted as ``Compaction`` leaves one.

Each round, for each N in turn (interleaved, so both see the same load): ``load``, the resume's read
(``session.messages(recent=True)``: from the newest compaction record's range on, read from the end), then
``turn``, one run of one step from it (the lease taken, the run's first save, a model answering at once,
the final save, the lease released). Every request's estimate is checked against the window: what is sent
does not grow with N. For scale, ``whole``: ``session.messages()`` of the same session, a few times.

    python -m bench --only context [--stores sqlite,postgres,mysql,mongodb] [--context-rounds 40]
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import agent_sessions as agent
from agent_sessions.context import Compaction, bytes_over_4

from . import backends
from .workload import clock, summary

SIZES = (1_000, 100_000)
WINDOW = 40_000
"""Tokens the policy sends at most (``Compaction(WINDOW)``)."""
RECORD_EVERY = 100
KEEP = 50
"""A record every ``RECORD_EVERY`` messages, its range ending ``KEEP`` messages before it: what the
policy leaves, the newest messages outside the summary."""
WHOLE_ROUNDS = 3
LOAD_CHUNK = 5_000
"""Messages each save of the loading adds (one write of 100,000 can pass a test server's timeout)."""


def words(n: int, k: int) -> str:
    return " ".join(f"w{(n * 7 + i) % 991}" for i in range(k))


def compacted(n: int) -> list[agent.Message]:
    """``n`` messages: exchanges of a ~250-byte question and answer, and a compaction record after every
    ``RECORD_EVERY`` messages or so, covering from the previous record's range end to the question
    ``KEEP`` or so messages before it (a request start)."""
    msgs: list[agent.Message] = []
    start, turn, last = 0, 0, 0
    while len(msgs) < n:
        if len(msgs) - last >= RECORD_EVERY:
            end = len(msgs) - KEEP
            while msgs[end].role is not agent.Role.USER or not msgs[end].text.startswith("question"):
                end += 1
            msgs.append(agent.Message(agent.Role.USER, [agent.Content.compaction(
                f"summary of {start}..{end}: " + words(end, 60), start, end)]))
            start, last = end, len(msgs)
            continue
        msgs.append(agent.Message.user(f"question {turn}: " + words(turn, 40)))
        msgs.append(agent.Message.assistant(f"answer {turn}: " + words(turn + 1, 40)))
        turn += 1
    return msgs[:n]


class Answering:
    """Answers at once, noting the estimate of each request it was sent (what the policy's window bounds)."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def complete(self, system: str, messages: Sequence[agent.Message], tools: Sequence[agent.Tool]) -> agent.Message:
        self.sent.append(bytes_over_4(system) + sum(bytes_over_4(m.to_json()) for m in messages))
        return agent.Message.assistant("ok: " + words(len(self.sent), 40))


def rows(name: str, tmp: str, rounds: int) -> dict[str, Any]:
    store = backends.open_store(name, tmp)
    sessions: dict[int, agent.StoreSession] = {}
    loaded: dict[int, float] = {}
    for n in SIZES:
        session = agent.open(f"bench-context-{n}-{uuid.uuid4().hex}", store)
        started = time.perf_counter()
        msgs = compacted(n)
        for end in range(LOAD_CHUNK, n + LOAD_CHUNK, LOAD_CHUNK):  # appended a chunk at a time: no huge write
            session.save(msgs[:end])
        loaded[n] = time.perf_counter() - started
        sessions[n] = session
    model = Answering()
    samples: dict[int, dict[str, list[float]]] = {n: {"load": [], "turn": [], "read": []} for n in SIZES}
    for r in range(rounds):
        for n in SIZES:
            session = sessions[n]
            spec = agent.Spec(session=session, system="You answer.", context=Compaction(WINDOW))
            box: list[list[agent.Message]] = []
            samples[n]["load"].append(clock(lambda: box.append(session.messages(recent=True))))  # noqa: B023
            recent = box[0]
            samples[n]["read"].append(len(recent))
            message = agent.Message.user(f"question r{r}: " + words(r, 40))
            result: list[agent.Result] = []
            recent.append(message)
            samples[n]["turn"].append(clock(
                lambda: result.append(agent.Runner().run(spec, recent, model))))  # noqa: B023
            if result[0].stop_reason != "answered":
                raise SystemExit(f"{name}: a turn at N={n} ended {result[0].stop_reason}")
    whole = {n: summary([clock(sessions[n].messages) for _ in range(WHOLE_ROUNDS)]) for n in SIZES}
    for n in SIZES:
        stored = sessions[n].messages()
        if len(stored) != n + 2 * rounds:
            raise SystemExit(f"{name}: the session of N={n} holds {len(stored)} messages, not {n + 2 * rounds}")
    return {str(n): {"load": summary(samples[n]["load"]), "turn": summary(samples[n]["turn"]),
                     "whole": whole[n], "messages_read": max(samples[n]["read"]), "save_s": loaded[n]}
            for n in SIZES} | {"largest_request_tokens": max(model.sent), "window": WINDOW}


def run(names: list[str], tmp: str, rounds: int) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for name in names:
        print(f"... context {name}", flush=True)
        report[name] = rows(name, tmp, rounds)
    return report


def _cell(s: dict[str, float]) -> str:
    return f"{s['median_ms']:.3f} ({s['p99_ms']:.2f})"


def tables(report: dict[str, Any]) -> str:
    small, large = (str(n) for n in SIZES)
    lines = [f"Resuming a compacted session at N = {int(large):,} stored messages beside N = {int(small):,}, "
             f"median (p99) ms, interleaved. load: session.messages(recent=True), the messages from the newest "
             f"compaction record's range on; turn: one run of one step from them (lease, saves, release; the "
             f"model answers at once); whole: session.messages(), for scale. Compaction({WINDOW:,}).", "",
             f"| | load @{int(small):,} | load @{int(large):,} | x | turn @{int(small):,} | turn @{int(large):,} | x | "
             f"Tail @{int(large):,} (messages) | largest request (tokens) | whole read @{int(large):,} |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report.items():
        a, b = r[small], r[large]
        lines.append(
            f"| {name} | {_cell(a['load'])} | {_cell(b['load'])} | "
            f"{b['load']['median_ms'] / a['load']['median_ms']:.2f}x | {_cell(a['turn'])} | {_cell(b['turn'])} | "
            f"{b['turn']['median_ms'] / a['turn']['median_ms']:.2f}x | {b['messages_read']} | "
            f"{r['largest_request_tokens']:,} of {r['window']:,} | {b['whole']['median_ms']:.0f} |")
    return "\n".join(lines)
