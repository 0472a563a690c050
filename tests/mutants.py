"""Hand-made mutants of the library's newer code, and which tests kill each (docs/reliability.md, "Mutants").

A mutant is a small textual patch of library code: a plausible bug where two operations meet (a sweep and a
run's end, a retry and a steer, a prune and a save, a takeover and a cancel). Each edit's old text must occur
exactly once in its file, so a mutant never silently stops applying when the code around it changes
(tests/test_mutants.py checks that every mutant still applies).

Each mutant is applied to a throwaway copy of the tree (the files git tracks or would track, as they are in
the working tree, copied to a temporary directory; the checkout itself is never written), and the suites
run there, each stopping at its first failure: the model-based test with its CI settings (``-k test_model_``, its
two tests) and ``storetest`` without it (``-k 'not test_model_'``: a storetest test that only has "model" in
its name still meets every mutant), on the memory store and on Redis (and on SQLite's model test
once SQLite is a RunStore again). A suite that fails on the unmutated copy is left out of the table, said so.

    scripts/mutants                       every mutant, a table on stdout, JSON in mutants.json
    scripts/mutants --list                the mutants and what each breaks
    scripts/mutants --only NAME[,NAME]    some of them
    scripts/mutants --check               only check that each applies (no test runs)
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Edit:
    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutant:
    name: str
    breaks: str
    """What goes wrong for a user, where two operations meet."""
    edits: tuple[Edit, ...]
    store: bool
    """A store could carry it (a guard, the backend, ``BackedStore``): ``storetest`` alone must kill it."""


def _m(name: str, store: bool, breaks: str, *edits: tuple[str, str, str]) -> Mutant:
    return Mutant(name, breaks, tuple(Edit(*e) for e in edits), store)


STRANDED, PERSIST = "agent_sessions/stranded.py", "agent_sessions/run/persistence.py"
BUSY = "agent_sessions/run/busy.py"
BACKED, MEMORY, REDIS = "agent_sessions/backed.py", "agent_sessions/backend.py", "stores/redis/write.lua"
"""MEMORY: the guard evaluation and row arithmetic the memory and SQL backends share (``Guard.holds``,
``next_row``)."""
MONGO = "stores/mongodb/pipeline.py"

MUTANTS: tuple[Mutant, ...] = (
    _m("sweep-fresh-budget", False,
       "the sweep runs a plain run's open turn with a fresh max_steps, ignoring the requests it made: a turn "
       "whose worker died after some steps makes more than max_steps requests in all",
       (STRANDED, "made = turns.replies(msgs, turns.turn_start(msgs, spec.max_steps)) + int(waiting_reply)",
        "made = int(waiting_reply)")),
    _m("run-end-keeps-mark", False,
       "a run that returns at max_steps (tool results last) or awaiting approval leaves its turn marked open: "
       "the sweep lists it as stranded",
       (PERSIST, 'if result.stop_reason not in ("max_steps", "awaiting_approval") or',
        'if True or result.stop_reason not in ("max_steps", "awaiting_approval") or')),
    _m("sweep-ignores-turn-end", False,
       "issue 42's first bug again: a run that returned at max_steps stays stranded, and the sweep runs it "
       "again with a fresh budget (more charges)",
       (STRANDED, "made = turns.replies(msgs, turns.turn_start(msgs, spec.max_steps)) + int(waiting_reply)",
        "made = int(waiting_reply)"),
       (PERSIST, 'if result.stop_reason not in ("max_steps", "awaiting_approval") or',
        'if True or result.stop_reason not in ("max_steps", "awaiting_approval") or')),
    _m("steer-retry-matches-text", False,
       "a keyed steer's retry finds its message by text: it returns the answer to an earlier message of the "
       "same text while its own still waits",
       (BUSY, "        stored = session.messages()\n        at = turns.keyed(stored, key)\n        answer = None",
        "        stored = session.messages()\n"
        "        at = next((i for i in range(len(stored)) if stored[i].role is Role.USER and stored[i].text == text),"
        " None)\n        answer = None")),
    _m("queue-pop-unfenced", True,
       "take_queued writes without the lease fence or the queue_head guard: a run whose lease was taken over "
       "(or a session deleted) still pops the queue's head, and the message is taken twice or lost",
       (BACKED, "guard = Guard(lease=(holder.token, holder.epoch), queue_head=head.id, length=row.length,",
        "guard = Guard(length=row.length,"),
       (BACKED, "guard = Guard(lease=(holder.token, holder.epoch), queue_head=head.id)\n",
        "guard = Guard()\n")),
    _m("memory-ignores-queue-head", True,
       "the guard evaluation the memory and SQL backends share (Guard.holds) ignores Guard.queue_head",
       (MEMORY, "and (self.queue_head is None or self.queue_head == queue_head)", "and True")),
    _m("steer-key-check-apart", True,
       "add_steer_once reads whether the key was used, then inserts without a guard: two deliveries of a keyed "
       "steer at once both store it, and the run gets it twice",
       (BACKED, "        return self.backend.write(session, Guard(key_absent=kept),\n"
                "                                  Change(add_steer=(text, key), add_key=kept, open=\"set\")).done",
        "        if not self.backend.write(session, Guard(key_absent=kept), Change()).done:\n"
        "            return False\n"
        "        time.sleep(0.001)\n"
        "        return self.backend.write(session, Guard(),\n"
        "                                  Change(add_steer=(text, key), add_key=kept, open=\"set\")).done")),
    _m("compaction-unfenced", True,
       "a save that appends a compaction record is not fenced by the lease: a run whose lease was taken over "
       "(or whose session was deleted) writes its record over the new holder's transcript",
       (BACKED, "                guard = Guard(lease=(holder.token, holder.epoch), length=plan.length, "
                "edits=plan.edits,\n                              incarnation=plan.incarnation, steers=steer_ids,",
        "                compacts = any(len(m.content) == 1 and m.content[0].type == \"compaction\" for m in new)\n"
        "                guard = Guard(lease=None if compacts else (holder.token, holder.epoch), "
        "length=None if compacts else plan.length, edits=None if compacts else plan.edits,\n"
        "                              incarnation=plan.incarnation, steers=steer_ids,")),
    _m("decision-applied-twice", True,
       "swap_journal does not compare the journal it replaces: two decisions on one call (a person's and the "
       "deadline's, or a cancel's) both succeed, the later overwriting the earlier",
       (BACKED, "Guard(exists=True, journal=expected)", "Guard(exists=True)")),
    _m("takeover-drops-cancel", True,
       "an Acquire does not hand on the cancel the lapsed lease carried: a dead worker's cancelled turn is "
       "taken up and run by the next holder",
       (MEMORY, "turn=lease.turn, handed=row.handed or row.cancelled,", "turn=lease.turn, handed=row.handed,")),
    _m("redis-takeover-drops-cancel", True,
       "as takeover-drops-cancel, in the Redis backend's Lua",
       (REDIS, "else put('turn', a.turn) end\n    put('handed', (row.handed == '1' or row.cancelled == '1') "
               "and '1' or '0')",
        "else put('turn', a.turn) end\n    put('handed', (row.handed == '1') and '1' or '0')")),
    _m("release-drops-cancel", True,
       "a release drops the cancel its lease carried: the next holder goes on with a cancelled turn",
       (MEMORY, "fields.update(token=None, handed=row.handed or row.cancelled, cancelled=False)",
        "fields.update(token=None, handed=row.handed, cancelled=False)")),
    _m("redis-release-drops-cancel", True,
       "as release-drops-cancel, in the Redis backend's Lua",
       (REDIS, "unset[#unset + 1] = 'token'\n    put('handed', (row.handed == '1' or row.cancelled == '1') "
               "and '1' or '0')",
        "unset[#unset + 1] = 'token'\n    put('handed', (row.handed == '1') and '1' or '0')")),
    _m("prune-beside-save", True,
       "prune deletes the idle sessions its listing found without checking again that each is still idle and "
       "unheld: a session saved or leased in between is deleted",
       (BACKED, "Guard(version=row.version, incarnation=row.incarnation, lease_free=True)", "Guard(lease_free=True)")),
    _m("stranded-skips-journal", True,
       "the stranded listing leaves out sessions with a journal (taken for turns that wait for a person): a run "
       "that died inside a tool, its call started in the journal, is never recovered",
       (BACKED, "if (row.token is None or row.expires <= row.now) and (not (row.cancelled or row.handed) or "
                "row.queued):",
        "if row.journal is None and (row.token is None or row.expires <= row.now) and (not (row.cancelled or "
        "row.handed) or row.queued):")),
    _m("first-write-skips-incarnation", True,
       "a run's first save, planned from the read its messages came from, is not guarded by that read's "
       "incarnation: a session deleted and made again to the same length gets the erased conversation back",
       (BACKED, "return _Plan(read.length, items[count:], read.length, read.edits, read.incarnation)",
        "return _Plan(read.length, items[count:], read.length, read.edits)")),
    _m("memory-ignores-incarnation", True,
       "the guard evaluation the memory and SQL backends share (Guard.holds) ignores Guard.incarnation",
       (MEMORY, "and (self.incarnation is None or self.incarnation == row.incarnation)", "and True")),
    _m("redis-ignores-incarnation", True,
       "the Redis backend's Lua does not evaluate Guard.incarnation",
       (REDIS, "if guard.incarnation ~= nil then ok = ok and (row.inc or '') == guard.incarnation end", "")),
    _m("interrupt-cancels-again", False,
       "a redelivered if_busy='interrupt' turn cancels whichever run holds the session again (not once per key): "
       "it can stop another caller's turn, or its own message's",
       (BUSY, "if store.cancel(session.id, once=key):", "if store.cancel(session.id):")),
    _m("mark-finished-beside-steer", True,
       "mark_finished (a run's end, the sweep) clears the open mark without checking that no steer or queued "
       "message came since: that input is never answered by the sweep",
       (BACKED, "guard = Guard(lease=(holder.token, holder.epoch), journal=journal, no_steers=True, no_queue=True)",
        "guard = Guard(lease=(holder.token, holder.epoch), journal=journal)")),
    _m("plain-save-beside-steer", True,
       "a plain save that answers the turn clears the open mark even when a steer or queued message came "
       "meanwhile: the sweep never answers it",
       (BACKED, "no_steers=not opened,\n                          no_queue=not opened)",
        "no_steers=False,\n                          no_queue=False)")),
    _m("give-back-unfenced", True,
       "a failed run gives its steers back without its lease's fence: they land under a session deleted or "
       "taken over meanwhile",
       (BACKED, "if not self.backend.write(session, _lease(holder), Change(add_steer=(text, None))).done:",
        "if not self.backend.write(session, Guard(), Change(add_steer=(text, None))).done:")),
    _m("decision-overwritten", False,
       "decide() does not refuse a call decided already: a second decision (a person's after the deadline's, "
       "an approval after a cancel's denial) replaces the first, and the turn runs a call that was refused",
       ("agent_sessions/approvals.py", "        if approval.decision is not None:\n            raise _already(",
        "        if False:\n            raise _already(")),
    _m("acquire-hides-handed", True,
       "acquire answers the lease's cancelled flag (False after an acquire) where it must answer the cancel it "
       "was handed: the run that takes over a cancelled turn goes on with it",
       (BACKED, "return Holder(holder.host, holder.pid, holder.token, row.expires, row.handed, row.epoch,",
        "return Holder(holder.host, holder.pid, holder.token, row.expires, row.cancelled, row.epoch,")),
    _m("closing-save-keeps-cancel", False,
       "the save that closes a cancelled turn before new input does not spend the cancel it was handed: the "
       "new turn's next holder is handed it again and stops",
       (PERSIST, "saved = self.writes.save(transcript, take_steers=True, closes=self.calls.closing)",
        "saved = self.writes.save(transcript, take_steers=True, closes=False)")),
    _m("redelivery-ignores-later-turn", False,
       "a redelivered turn that a later turn took up goes on with that turn's work under its own budget",
       ("agent_sessions/run/turns.py", "later = _later_turn(stored, at)", "later = None")),
    # MongoDB's (stores/mongodb/pipeline.py) are named "pipeline-": tests/conftest.py skips a test whose id says
    # "mongo" when no MongoDB server answers, and tests/test_mutants.py needs none. ``--suites storetest:mongodb``.
    _m("pipeline-ignores-queue-head", True,
       "the MongoDB backend's pipeline does not evaluate Guard.queue_head",
       (MONGO, "    if guard.queue_head is not None:\n        pairs.append(", "    if False:\n        pairs.append(")),
    _m("pipeline-ignores-incarnation", True,
       "the MongoDB backend's pipeline does not evaluate Guard.incarnation",
       (MONGO, '("incarnation", "", guard.incarnation)', '("incarnation", "", None)')),
    _m("pipeline-takeover-drops-cancel", True,
       "as takeover-drops-cancel, in the MongoDB backend's pipeline",
       (MONGO, '"turn": None if lease.turn is None else lit(lease.turn),\n                "handed": {"$or": '
               '[{"$eq": ["$handed", True]}, {"$eq": ["$cancelled", True]}]}',
        '"turn": None if lease.turn is None else lit(lease.turn),\n                "handed": '
        '{"$eq": ["$handed", True]}')),
    _m("pipeline-release-drops-cancel", True,
       "as release-drops-cancel, in the MongoDB backend's pipeline",
       (MONGO, 'return {"token": None, "handed": {"$or": [{"$eq": ["$handed", True]}, {"$eq": ["$cancelled", True]}]},',
        'return {"token": None, "handed": {"$eq": ["$handed", True]},')),
    _m("take-steers-unguarded", True,
       "take_steers removes the steers it read without guarding that they still wait: two takers both get them",
       (BACKED, "if self.backend.write(session, Guard(steers=ids), Change(take_steers=ids)).done:",
        "if self.backend.write(session, Guard(), Change(take_steers=ids)).done:")),
)


@dataclass(frozen=True)
class Suite:
    name: str
    args: tuple[str, ...]
    default: bool = True
    """Run unless ``--suites`` says otherwise (MongoDB's needs its server: ``scripts/servers start``)."""


MODEL = "test_model_"
"""What the model-based test's tests are named by (storetest/model.py)."""
SUITES: tuple[Suite, ...] = (
    Suite("model:memory", ("tests/test_store_memory.py", "-k", MODEL)),
    Suite("model:sqlite", ("tests/test_store_sqlite.py::TestSQLiteStoreKeepsTheContract", "-k", MODEL)),
    Suite("model:redis", ("tests/test_store_redis.py::TestRedisStoreKeepsTheContract", "-k", MODEL)),
    Suite("storetest:memory", ("tests/test_store_memory.py", "-k", f"not {MODEL}")),
    Suite("storetest:redis", ("tests/test_store_redis.py::TestRedisStoreKeepsTheContract", "-k", f"not {MODEL}")),
    Suite("storetest:mongodb", ("tests/test_store_mongodb.py::TestMongoDBStoreKeepsTheContract", "-k", f"not {MODEL}"),
          default=False),
)


def apply(mutant: Mutant, tree: Path) -> None:
    """Apply ``mutant`` to the copy at ``tree``; ``AssertionError`` when an edit's old text is not there once."""
    for edit in mutant.edits:
        path = tree / edit.path
        text = path.read_text()
        found = text.count(edit.old)
        assert found == 1, f"mutant {mutant.name}: {edit.path}: the old text occurs {found} times, not once:\n" \
                           f"{edit.old}"
        text = text.replace(edit.old, edit.new)
        if path.suffix == ".py":
            compile(text, str(path), "exec")  # a mutant is a bug, never a syntax error that kills it trivially
        path.write_text(text)


def copy_tree(source: Path, into: Path, rev: str | None = None) -> Path:
    """The files git tracks or would track under ``source``, as they are in its working tree, copied; or,
    given ``rev``, the tree of that commit (``git archive``)."""
    into.mkdir(parents=True, exist_ok=True)
    if rev is not None:
        archive = subprocess.run(["git", "-C", str(source), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
        return into
    listed = subprocess.run(["git", "-C", str(source), "ls-files", "-z", "-co", "--exclude-standard"],
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = source / name
        if src.is_file():
            dst = into / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    return into


@dataclass
class Outcome:
    suite: str
    status: str
    """passed, failed, timeout or error (pytest could not run)."""
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    seeds: list[str] = field(default_factory=list)
    detail: list[str] = field(default_factory=list)
    """The first lines pytest said of the failure (``E ...``; a model violation's seed and invariant)."""


def run_suite(suite: Suite, tree: Path, python: str, prefix: str, timeout: float) -> Outcome:
    report = tree / f"junit-{suite.name.replace(':', '-')}.xml"
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1", AGENT_SESSIONS_TEST_PREFIX=prefix)
    cmd = [python, "-m", "pytest", *suite.args, "-x", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
           f"--basetemp={tree / ('pytest-' + suite.name.replace(':', '-'))}"]
    started = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Outcome(suite.name, "timeout", seconds=time.monotonic() - started)
    seconds = time.monotonic() - started
    seeds = sorted({line.split("seed ")[1].split(",")[0] for line in done.stdout.splitlines()
                    if line.startswith("model program: seed ")})
    if done.returncode == 0:
        return Outcome(suite.name, "passed", seconds=seconds, seeds=seeds)
    failed = []
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}")
    detail = [line[:300] for line in done.stdout.splitlines()
              if line.startswith(("E ", "seed ")) or "invariant violations" in line][:8]
    if done.returncode == 1 and failed:
        return Outcome(suite.name, "failed", failed, seconds, seeds, detail)
    (tree / f"output-{suite.name.replace(':', '-')}.txt").write_text(done.stdout + done.stderr)
    return Outcome(suite.name, "error", failed or [f"pytest exit {done.returncode}: {done.stdout[-300:]}"], seconds,
                   seeds)


def run_mutant(mutant: Mutant | None, source: Path, suites: Sequence[Suite], python: str, prefix: str,
               timeout: float, keep: bool, rev: str | None = None, repeat: int = 1) -> list[Outcome]:
    work = Path(tempfile.mkdtemp(prefix=f"{prefix}-mutant-"))
    try:
        tree = copy_tree(source, work / "tree", rev)
        if mutant is not None:
            apply(mutant, tree)
        probe = subprocess.run([python, "-c", "import agent_sessions, stores; print(agent_sessions.__file__)"],
                               cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True, text=True)
        assert probe.stdout.startswith(str(tree)), f"the copy's library is not the one imported: {probe.stdout}"
        outcomes = []
        for suite in suites:
            for _ in range(repeat):  # the model test draws fresh seeds each time: a kill may take a few
                outcome = run_suite(suite, tree, python, prefix, timeout)
                if outcome.status != "passed":
                    break
            outcomes.append(outcome)
        return outcomes
    finally:
        if keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def verdict(outcomes: Sequence[Outcome]) -> str:
    killers = [f"{o.suite}: {', '.join(o.failed) or o.status}" for o in outcomes if o.status != "passed"]
    return "; ".join(killers) if killers else "SURVIVED"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/mutants", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated mutant names")
    parser.add_argument("--suites", help="comma-separated suite names, or all (default: " +
                        ", ".join(s.name for s in SUITES if s.default) + "; also: " +
                        ", ".join(s.name for s in SUITES if not s.default) + ")")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--check", action="store_true", help="only check that each mutant applies")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--json", default="mutants.json", help="where the results go (default mutants.json)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per suite run (a hang is a kill)")
    parser.add_argument("--source", default=str(ROOT), help="the checkout to copy (default: this one)")
    parser.add_argument("--rev", help="copy this commit's tree instead of the working tree (e.g. the code as it "
                        "was before a test was added)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each suite per mutant, until one fails "
                        "(the model test draws fresh seeds each run; default 1: what CI runs)")
    parser.add_argument("--keep", action="store_true", help="keep the mutated copies (their paths on stderr)")
    args = parser.parse_args(argv)
    mutants = list(MUTANTS)
    if args.only:
        names = args.only.split(",")
        unknown = set(names) - {m.name for m in MUTANTS}
        if unknown:
            parser.error(f"unknown mutants: {', '.join(sorted(unknown))}")
        mutants = [m for m in MUTANTS if m.name in names]
    if args.list:
        for m in mutants:
            print(f"{m.name} ({'store' if m.store else 'library'}): {m.breaks}")
        return 0
    source = Path(args.source).resolve()
    if args.check:
        with tempfile.TemporaryDirectory(prefix="mutants-check-") as tmp:
            tree = copy_tree(source, Path(tmp), args.rev)
            originals = {e.path: (tree / e.path).read_text() for m in mutants for e in m.edits}
            for m in mutants:
                apply(m, tree)
                for path, text in originals.items():
                    (tree / path).write_text(text)
        print(f"{len(mutants)} mutants apply")
        return 0
    suites = [s for s in SUITES if s.default]
    if args.suites:
        names = args.suites.split(",")
        unknown = set(names) - {s.name for s in SUITES} - {"all"}
        if unknown:
            parser.error(f"unknown suites: {', '.join(sorted(unknown))}")
        suites = [s for s in SUITES if s.name in names or "all" in names]
    python = sys.executable
    prefix = os.environ.get("AGENT_SESSIONS_TEST_PREFIX") or "agent_sessions_test"
    started = time.monotonic()
    print(f"baseline: the unmutated copy of {source}{'' if args.rev is None else ' at ' + args.rev}", flush=True)
    baseline = run_mutant(None, source, suites, python, f"{prefix}_m0", args.timeout, args.keep, args.rev)
    dropped = {o.suite: verdict([o]) for o in baseline if o.status != "passed"}
    for why in dropped.values():
        print(f"  left out: {why} (it fails unmutated)", flush=True)
    suites = [s for s in suites if s.name not in dropped]
    results: list[dict[str, object]] = []

    # Each job runs under a prefix of its own slot, never another running job's: a prune of one job's tests
    # deletes every idle session of its database (MongoDB's is the prefix's), so two jobs must never share one.
    slots: queue.Queue[int] = queue.Queue()
    for slot in range(1, max(args.jobs, 1) + 1):
        slots.put(slot)

    def one(job: tuple[int, Mutant]) -> dict[str, object]:
        _, m = job
        slot = slots.get()
        try:
            outcomes = run_mutant(m, source, suites, python, f"{prefix}_m{slot}", args.timeout, args.keep, args.rev,
                                  args.repeat)
        finally:
            slots.put(slot)
        row: dict[str, object] = {"mutant": m.name, "store": m.store, "breaks": m.breaks,
                                  "verdict": verdict(outcomes), "suites": [o.__dict__ for o in outcomes]}
        print(f"{m.name}: {row['verdict']}", flush=True)
        return row

    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        results = list(pool.map(one, enumerate(mutants)))
    survived = [str(r["mutant"]) for r in results if r["verdict"] == "SURVIVED"]
    print()
    print("| mutant | level | " + " | ".join(s.name for s in suites) + " |")
    print("|---|---|" + "---|" * len(suites))
    for r in results:
        cells = []
        for o in r["suites"]:  # type: ignore[attr-defined]
            cells.append("passed" if o["status"] == "passed" else f"**{o['status']}**: {', '.join(o['failed'])}")
        print(f"| {r['mutant']} | {'store' if r['store'] else 'library'} | " + " | ".join(cells) + " |")
    print(f"\n{len(results) - len(survived)} of {len(results)} killed; survived: {', '.join(survived) or 'none'}"
          f" ({time.monotonic() - started:.0f} s)")
    Path(args.json).write_text(json.dumps({
        "source": str(source),
        "commit": subprocess.run(["git", "-C", str(source), "rev-parse", args.rev or "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "suites": [s.name for s in suites], "left_out": dropped,
        "baseline": [o.__dict__ for o in baseline], "mutants": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
