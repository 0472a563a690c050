"""The model-based concurrency machine (storetest.model_ops) for as long as asked: ``scripts/soak``.

    python -m tests.soak --hours 1 --store all          # or --minutes 10; --seed S replays one program
    python -m tests.soak --faults 2000 --store all      # the fault trials instead (tests/faults/trials.py)

Programs run with fresh seeds, round-robin over the stores, until the time is up; then a table per store
(programs, operations tried per kind, invariant checks per invariant, violations) is printed and written
as JSON, with each violation's seed and its program's op log. The stores are built here, not in storetest
(which imports no store), on databases of their own (``<prefix>_soak``): a prune in a program deletes
every idle session of its database.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pymongo
import redis as redis_py
from sqlalchemy import create_engine

from agent_sessions import Store
from stores import memory, mongodb, mysql, postgres, redis, sqlite
from storetest import Capability
from storetest.model_ops import INVARIANTS, KINDS, KNOWN, Report, run_program
from tests import servers

STORES = ("memory", "sqlite", "postgres", "mysql", "mongodb", "redis")


@dataclass
class Target:
    name: str
    make_store: Callable[[], Store]
    capabilities: frozenset[Capability]
    process_factory: Callable[[], Store] | None


def _pool(make: Callable[[], Store], size: int = 3) -> Callable[[], Store]:
    """A program asks for three store objects (one per worker): hand out the same few, round-robin, so
    hours of programs open no more connections than one."""
    made = [make() for _ in range(size)]
    turn = iter(range(10**12))
    return lambda: made[next(turn) % size]


def target(name: str, workdir: Path) -> Target:
    everything = Capability.all()
    if name == "memory":
        one = memory.Store()  # one store: its objects share nothing
        return Target(name, lambda: one, everything - {Capability.DURABLE, Capability.PROCESSES}, None)
    if name == "sqlite":
        path = str(workdir / "soak.db")
        return Target(name, _pool(lambda: sqlite.open(path)), everything, functools.partial(sqlite.open, path))
    if name in ("postgres", "mysql"):
        base = servers.POSTGRES_URL if name == "postgres" else servers.MYSQL_URL
        url = servers.database_url(base, servers.database_name("soak"))
        engine = create_engine(url, pool_size=8, max_overflow=8)
        servers.fresh_schema(engine)
        if name == "postgres":
            return Target(name, lambda: postgres.Store(engine), everything,
                          functools.partial(servers.postgres_store, url))
        return Target(name, lambda: mysql.Store(engine), everything, functools.partial(servers.mysql_store, url))
    if name == "mongodb":
        database = servers.database_name("soak")
        client: pymongo.MongoClient[Any] = pymongo.MongoClient(servers.MONGO_URL, serverSelectionTimeoutMS=10_000)
        db = client[database]
        for collection in mongodb.COLLECTIONS:
            db.drop_collection(collection)
        mongodb.create_indexes(db)
        return Target(name, lambda: mongodb.Store(db), everything,
                      functools.partial(servers.mongo_store, servers.MONGO_URL, database))
    if name == "redis":
        # keys of its own under the test prefix (a program deletes its sessions as it ends; the rest with them)
        prefix = f"{servers.REDIS_KEY_PREFIX}soak:{uuid.uuid4().hex[:12]}:"
        connection = redis_py.Redis.from_url(servers.REDIS_URL)
        return Target(name, lambda: redis.Store(connection, prefix=prefix), everything,
                      functools.partial(_redis_store, servers.REDIS_URL, prefix))
    raise SystemExit(f"--store {name!r}: one of {', '.join(STORES)} or all")


def _redis_store(url: str, prefix: str) -> Store:
    """A child process's store: a client of its own (a connection is not shared across fork)."""
    return redis.Store(redis_py.Redis.from_url(url), prefix=prefix)


def table(reports: dict[str, Report], seconds: float) -> str:
    names = list(reports)
    rows = [f"| | {' | '.join(names)} |", "|---|" + "---|" * len(names),
            f"| programs | {' | '.join(str(reports[n].programs) for n in names)} |"]
    kinds = sorted({k for r in reports.values() for k in r.tried}, key=lambda k: (k.split()[0] not in KINDS, k))
    rows += [f"| {k} | {' | '.join(str(reports[n].tried[k]) for n in names)} |" for k in kinds]
    rows += [f"| check: {i} | {' | '.join(str(reports[n].checks[i]) for n in names)} |" for i in INVARIANTS]
    rows += [f"| left out: {m} | {' | '.join(str(reports[n].left_out[m]) for n in names)} |"
             for m in sorted({m for r in reports.values() for m in r.left_out})]
    rows.append(f"| violations | {' | '.join(str(len(reports[n].violations)) for n in names)} |")
    return f"{seconds / 60:.1f} minutes\n" + "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    # an op log may hold a lone surrogate (the surrogate mix's message): printed escaped, never a crash
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
    args_ = sys.argv[1:] if argv is None else argv
    if args_[:1] == ["--faults"]:  # scripts/soak --faults N [--store postgres|mysql|mongodb|all] [--json PATH]
        from tests.faults import trials

        if len(args_) < 2 or not args_[1].isdigit():
            raise SystemExit("scripts/soak --faults N: N, the number of fault trials per store")
        return trials.main(["--trials", args_[1], *args_[2:]])
    parser = argparse.ArgumentParser(prog="scripts/soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=0.0)
    parser.add_argument("--minutes", type=float, default=0.0)
    parser.add_argument("--store", default="all", help=f"{', '.join(STORES)}, all, or a comma list")
    parser.add_argument("--seed", type=int, help="run this one program (on each store) and stop")
    parser.add_argument("--ops", type=int, default=20, help="operations per program (default 20)")
    parser.add_argument("--skip", default="none",
                        help="mixes left out: none (the default: every bug they met is fixed), known (all of "
                             "storetest.model_ops.KNOWN), or a comma list")
    parser.add_argument("--verbose", action="store_true", help="a line per program: store, seed, seconds")
    parser.add_argument("--show", action="store_true", help="print the op log of each program that failed")
    parser.add_argument("--json", default="", help="where to write the results (default soak-<time>.json)")
    args = parser.parse_args(argv)
    seconds = (args.hours * 60 + args.minutes) * 60
    if seconds <= 0 and args.seed is None:
        parser.error("say how long: --hours N or --minutes N (or --seed S for one program)")
    skip = frozenset(KNOWN) if args.skip == "known" else frozenset() if args.skip == "none" else frozenset(
        s for s in args.skip.split(",") if s)
    names = list(STORES) if args.store == "all" else args.store.split(",")
    workdir = Path(tempfile.mkdtemp(prefix="agent-sessions-soak-"))
    targets = [target(n, workdir) for n in names]
    reports = {t.name: Report() for t in targets}
    logs: list[dict[str, Any]] = []
    started = time.monotonic()
    rng = random.SystemRandom()
    n = 0
    while True:
        for t in targets:
            seed = args.seed if args.seed is not None else rng.randrange(2**32)
            n += 1
            began = time.monotonic()
            report, log = run_program(seed, t.make_store, t.capabilities, t.process_factory, workdir / f"p{n}",
                                      args.ops, skip)
            reports[t.name].merge(report)
            took = time.monotonic() - began
            if args.verbose or took > 60:
                print(f"{t.name} seed {seed}: {took:.1f} s, {len(report.violations)} violations", flush=True)
            for s, invariant, detail in report.violations:
                print(f"VIOLATION {t.name} seed {s}: {invariant}: {detail}", flush=True)
            if report.violations:
                logs.append({"store": t.name, "seed": seed, "log": log})
                if args.show:
                    print("\n".join(log), flush=True)
        if args.seed is not None or time.monotonic() - started >= seconds:
            break
        if n % (10 * len(targets)) == 0:
            print(f"... {n} programs, {(time.monotonic() - started) / 60:.1f} min", flush=True)
    elapsed = time.monotonic() - started
    print(table(reports, elapsed))
    out = Path(args.json or f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.write_text(json.dumps({"seconds": round(elapsed), "ops_per_program": args.ops, "skip": sorted(skip),
                               "stores": {k: r.to_json() for k, r in reports.items()}, "failing_programs": logs},
                              indent=1))
    print(f"written to {out}")
    return 1 if any(r.violations for r in reports.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
