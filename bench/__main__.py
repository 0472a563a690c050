"""What a session costs per step, per store and against the peers, measured in one run.

    python -m bench [--stores memory,sqlite,postgres,mysql,mongodb] [--rounds 200] [--peer-rounds 60]
                    [--steer-procs 4] [--json bench/results/latest.json]
    python -m bench --only reading [--stores sqlite,postgres,mysql,mongodb] [--lifecycle-stores sqlite,postgres]

``--only context`` runs the long-conversation rows alone (bench/context.py: a resume's read and turn at
100,000 stored messages with compaction beside 1,000), into bench/results/context.json.

``--only persistence`` runs the per-step persistence and loop rows alone (no steers, peers, reading, events or
context), into bench/results/persistence.json.

``--only trips`` runs the round-trip rows alone (bench/trips.py: each server store through a counting, delaying
TCP hop: the exchanges of a run's start and of a loop step, and a step's time at an added RTT beside the
one-statement floor), into bench/results/trips.json.

``--only reading`` runs the reading and managing rows alone (bench/reading.py: transcripts, tails, listing
and prune at 100,000 sessions), into bench/results/reading.json unless ``--json`` says otherwise.

scripts/bench builds the benchmark's own environment (the peers are installed only there), starts the
servers like the tests do, and runs this. It prints the tables and writes JSON, plus the same tables as
Markdown beside it (what docs/performance.md quotes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from . import backends, context, encode, events, ours, peers, reading, steers, trips
from .floors import floor_for
from .workload import SIZES


def machine() -> dict[str, Any]:
    def out(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except OSError:
            return ""

    model = [line.split(":", 1)[1].strip() for line in out(["cat", "/proc/cpuinfo"]).splitlines()
             if line.startswith("model name")]
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "cpu": model[0] if model else "",
            "platform": platform.platform(), "sqlite": __import__("sqlite3").sqlite_version}


STORES = "memory,sqlite,postgres,mysql,mysql-noreset,mongodb"
"""The stores measured unless --stores says (``--only trips``: every server store, Redis too)."""


def run(args: argparse.Namespace, persistence_only: bool = False) -> dict[str, Any]:
    names = [s for s in args.stores.split(",") if s]
    report: dict[str, Any] = {"machine": machine(), "rounds": args.rounds, "peer_rounds": args.peer_rounds,
                              "persistence": {}, "loop": {}, "loop_non_idempotent": {}, "steers": {}, "peers": {}}
    report["encode"] = encode.encode_times()
    with tempfile.TemporaryDirectory() as tmp:
        report["loop"]["session=None"] = {n: ours.loop_step(None, n, args.rounds)["loop_step"] for n in SIZES}
        for name in names:
            print(f"... {name}", flush=True)
            store = backends.open_store(name, tmp)
            floor = floor_for(name, tmp)
            measured = {n: ours.measure(store, floor, n, args.rounds) for n in SIZES}
            report["persistence"][name] = {n: {k: m[k] for k in ("persist", "floor") if k in m}
                                           for n, m in measured.items()}
            report["loop"][name] = {n: m["loop"] for n, m in measured.items()}
            report["loop_non_idempotent"][name] = {n: m["loop_non_idempotent"] for n, m in measured.items()}
            factory = backends.store_factory(name, tmp)
            if factory is not None and args.steer_procs and not persistence_only:
                report["steers"][name] = steers.throughput(factory, args.steer_procs, args.steers_per_proc)
        found = peers.available() if not persistence_only else []
        report["peers_installed"] = found
        if persistence_only:
            return report
        floors = {backend: floor_for(backend, tmp) for backend in ("sqlite", "postgres") if backend in names}
        for peer in peers.PEERS:
            if peer.package in found and peer.backend in names:
                print(f"... {peer.label}", flush=True)
                rounds = args.peer_rounds if peer.slow else args.rounds
                report["peers"][peer.label] = {n: peer.measure(tmp, floors[peer.backend], n, rounds) for n in SIZES}
        # The event log's rows before the rows that load 100,000 sessions (reading) and messages (context):
        # what those leave behind (PostgreSQL's autovacuum, SQLite's checkpoints) lands on whatever runs next.
        report["events"] = events.run([n for n in names if n not in backends.VARIANTS], tmp, args.events_rounds)
        report["trips"] = trips.run([n for n in trips.SERVERS if n in names or n == "redis"], args.rtt / 1000)
        report["reading"] = _reading(args, names, tmp)
        report["context"] = context.run([n for n in names if n != "memory" and n not in backends.VARIANTS], tmp,
                                        args.context_rounds)
    return report


def _reading(args: argparse.Namespace, names: list[str], tmp: str) -> dict[str, Any]:
    life = [s for s in args.lifecycle_stores.split(",") if s]
    names = [n for n in names if n not in backends.VARIANTS]
    return reading.run(names, tmp, args.reading_rounds, life, args.prune_batch)


def _cell(s: dict[str, float]) -> str:
    return f"{s['median_ms']:.3f} ({s['p99_ms']:.2f})"


def tables(report: dict[str, Any]) -> str:
    lines: list[str] = [
        "Per-step persistence (ours: save_fenced, the steers taken and the step saved, fenced; peers: their per-step "
        "writes), median (p99) ms.",
        "Floor: the same step appended with the raw driver, measured interleaved with each row.", "",
        "| | N=10 | N=100 | N=1,000 | floor @1,000 | x floor @1,000 | N=1,000 / N=10 |",
        "|---|---|---|---|---|---|---|"]

    def row(label: str, rows: dict[Any, Any]) -> None:
        cells = [_cell(rows[n]["persist"]) for n in SIZES]
        at = rows[1000]["persist"]["median_ms"]
        floor = rows[1000].get("floor", {}).get("median_ms")
        growth = at / rows[10]["persist"]["median_ms"]
        ratio = f"{at / floor:.2f}x" if floor else "-"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {f'{floor:.3f}' if floor else '-'} | {ratio} | "
                     f"{growth:.2f}x |")

    for name, rows in report["persistence"].items():
        row(name, rows)
    for label, rows in report["peers"].items():
        row(label, rows)
    lines += ["", "Loop step (model and tool answer at once; the fenced save, cancel checks and tool journal "
              "included), median (p99) ms; in brackets, x the same store's per-step persistence, measured "
              "interleaved with it", "",
              "| | tool | N=10 | N=100 | N=1,000 |", "|---|---|---|---|---|"]
    for kind, label in (("loop", "idempotent"), ("loop_non_idempotent", "non-idempotent")):
        for name, rows in report[kind].items():
            persist = report["persistence"].get(name)
            cells = []
            for n in SIZES:
                ratio = f" [{rows[n]['median_ms'] / persist[n]['persist']['median_ms']:.2f}x]" if persist else ""
                cells.append(_cell(rows[n]) + ratio)
            lines.append(f"| {name} | {label} | " + " | ".join(cells) + " |")
    if report["steers"]:
        lines += ["", "Steer throughput (K adding + K taking processes on one session; exactly-once checked)", "",
                  "| | processes | steers | seconds | steers/s |", "|---|---|---|---|---|"]
        for name, s in report["steers"].items():
            lines.append(f"| {name} | {s['processes']} | {s['steers']} | {s['seconds']:.2f} | "
                         f"{s['steers_per_s']:.0f} |")
    lines += ["", encode.line(report["encode"])]
    if report.get("reading"):
        lines += ["", reading.tables(report["reading"])]
    if report.get("trips"):
        lines += ["", trips.tables(report["trips"])]
    if report.get("events"):
        lines += ["", events.tables(report["events"])]
    if report.get("context"):
        lines += ["", context.tables(report["context"])]
    if not report["peers_installed"]:
        lines += ["", "(peers not installed here: run scripts/bench, which builds their environment)"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", default=STORES)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--peer-rounds", type=int, default=60, help="rounds for the slow peers (LangGraph)")
    parser.add_argument("--steer-procs", type=int, default=4, help="adding processes (as many take)")
    parser.add_argument("--steers-per-proc", type=int, default=250)
    parser.add_argument("--only", choices=["all", "persistence", "reading", "events", "context", "trips"],
                        default="all",
                        help="persistence: only the per-step persistence and loop rows; reading: only the "
                             "reading and managing rows (bench/reading.py); events: only the event log's rows "
                             "(bench/events.py)")
    parser.add_argument("--lifecycle-stores", default="sqlite,postgres",
                        help="stores of the listing and prune rows (100,000 sessions each)")
    parser.add_argument("--events-rounds", type=int, default=1000,
                        help="steps of each of the event log's loop rows (off and on), in runs of ten")
    parser.add_argument("--reading-rounds", type=int, default=50)
    parser.add_argument("--rtt", type=float, default=1.0, help="ms added to each exchange of the round-trip rows")
    parser.add_argument("--context-rounds", type=int, default=40, help="rounds of the long-conversation rows")
    parser.add_argument("--prune-batch", type=int, default=500, help="limit= of each call in the per-batch prune")
    parser.add_argument("--json", default=None, help="default: bench/results/latest.json (reading.json with "
                        "--only reading)")
    args = parser.parse_args()
    try:
        _run(args)
    finally:
        backends.drop_databases()


def _run(args: argparse.Namespace) -> None:
    results = Path(__file__).parent / "results"
    if args.only == "reading":
        with tempfile.TemporaryDirectory() as tmp:
            names = [s for s in args.stores.split(",") if s and s != "memory" and s not in backends.VARIANTS]
            report = {"machine": machine(), "reading": _reading(args, names, tmp)}
        text = reading.tables(report["reading"])
        args.json = args.json or str(results / "reading.json")
    elif args.only == "context":
        with tempfile.TemporaryDirectory() as tmp:
            names = [s for s in args.stores.split(",") if s and s != "memory" and s not in backends.VARIANTS]
            report = {"machine": machine(), "context": context.run(names, tmp, args.context_rounds)}
        text = context.tables(report["context"])
        args.json = args.json or str(results / "context.json")
    elif args.only == "trips":
        names = list(trips.SERVERS) if args.stores == STORES else [s for s in args.stores.split(",")
                                                                      if s in trips.SERVERS]
        report = {"machine": machine(), "trips": trips.run(names, args.rtt / 1000)}
        text = trips.tables(report["trips"])
        args.json = args.json or str(results / "trips.json")
    elif args.only == "events":
        with tempfile.TemporaryDirectory() as tmp:
            names = [s for s in args.stores.split(",") if s and s not in backends.VARIANTS]
            report = {"machine": machine(), "events": events.run(names, tmp, args.events_rounds)}
        text = events.tables(report["events"])
        args.json = args.json or str(results / "events.json")
    else:
        report = run(args, persistence_only=args.only == "persistence")
        text = tables(report)
        args.json = args.json or str(results / ("persistence.json" if args.only == "persistence" else "latest.json"))
    print(text)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(text + "\n")
    print(f"\nwritten to {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
