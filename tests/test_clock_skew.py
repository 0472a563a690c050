"""Two replicas whose clocks disagree by far more than the lease ttl: neither can take a live lease from
the other, because expiry is decided by the database's clock.

Each replica is a process whose ``time.time`` is shifted (an hour ahead, an hour behind): with expiry on
the replicas' clocks, the one ahead would see the other's lease as long expired and take it over.
"""

from __future__ import annotations

import functools
import multiprocessing
import queue
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import agent_sessions as agent
from storetest import processes
from storetest.crossprocess import lines, wait_for
from storetest.scripted import ToolsThenAnswer
from tests import servers
from tests.test_store_sql_servers import MYSQL, POSTGRES, connected

HOUR = 3600.0
TTL = 1.0


def _skewed(offset: float) -> None:
    real = time.time
    time.time = lambda: real() + offset  # type: ignore[assignment]  # this process's wall clock is wrong


def _hold(factory: Callable[[], agent.Store], sid: str, offset: float, workdir: str, out: Any) -> None:
    """Hold the session's lease (a short one, renewed) until the parent removes ``workdir/hold``."""
    _skewed(offset)
    try:
        hold_file = Path(workdir) / "hold"

        @agent.tool
        def hold(n: int) -> str:
            """Keep the run, and its lease, alive."""
            Path(workdir, "holding").write_text(str(time.time()))
            deadline = time.monotonic() + 120
            while hold_file.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            return "held"

        spec = agent.Spec(session=agent.open(sid, factory()), tools=[hold], lease_ttl=TTL)
        result = agent.Runner().run(spec, [agent.Message.user("hold it")], ToolsThenAnswer(["hold"]))
        out.put(("holder", result.stop_reason))
    except BaseException:  # noqa: BLE001 - reported by the parent
        out.put(("holder", traceback.format_exc()))


def _try(factory: Callable[[], agent.Store], sid: str, offset: float, out: Any) -> None:
    """Try to run the session now, as a replica with a wrong clock would."""
    _skewed(offset)
    try:
        store = factory()
        spec = agent.Spec(session=agent.open(sid, store), lease_ttl=TTL, replace_transcript=True)
        agent.Runner().run(spec, [agent.Message.user("mine now")], ToolsThenAnswer([]))
        out.put(("other", "took the lease"))
    except agent.SessionBusy as exc:
        out.put(("other", f"busy: {exc.holder.pid}"))
    except BaseException:  # noqa: BLE001 - reported by the parent
        out.put(("other", traceback.format_exc()))


def _factory(name: str) -> Callable[[], agent.Store]:
    if name == "postgres":
        return functools.partial(servers.postgres_store, servers.POSTGRES_URL)
    if name == "mysql":
        return functools.partial(servers.mysql_store, servers.MYSQL_URL)
    return functools.partial(servers.mongo_store, servers.MONGO_URL, servers.MONGO_DATABASE)


@pytest.fixture(params=["postgres", "mysql", "mongodb"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    name: str = request.param
    if name == "mongodb":
        yield name
        return
    with connected(POSTGRES if name == "postgres" else MYSQL):
        yield name


@pytest.mark.parametrize(("holder_offset", "other_offset"), [(-HOUR, +HOUR), (+HOUR, -HOUR)],
                         ids=["holder-behind", "holder-ahead"])
def test_replicas_with_clocks_hours_apart_cannot_take_a_live_lease_from_each_other(
    backend: str, holder_offset: float, other_offset: float, tmp_path: Path
) -> None:
    factory = _factory(backend)
    sid = f"skew-{uuid.uuid4().hex}"
    ctx = processes.context(factory)
    out = ctx.Queue()
    (tmp_path / "hold").write_text("")
    holder = ctx.Process(target=_hold, args=(factory, sid, holder_offset, str(tmp_path), out))
    holder.start()
    try:
        wait_for(lambda: (tmp_path / "holding").exists(), "the holder to be inside its tool", timeout=60)
        time.sleep(TTL * 1.5)  # past a ttl: only renewals keep the lease now
        other = ctx.Process(target=_try, args=(factory, sid, other_offset, out))
        other.start()
        kind, said = out.get(timeout=60)
        other.join(30)
        assert (kind, said) == ("other", f"busy: {holder.pid}"), said
        (tmp_path / "hold").unlink()
        kind, said = out.get(timeout=60)
        assert (kind, said) == ("holder", "answered"), said
    except queue.Empty:
        raise AssertionError("a replica did not report within 60 s") from None
    finally:
        for p in multiprocessing.active_children():
            p.join(10)
            if p.is_alive():
                p.kill()
    assert lines(tmp_path / "holding")  # the holder really held it while the other tried
