"""Gaps: the model test's operations paused, now and then, right after a read of the backend or right before
a write, so that the round's other operations land between the two.

Each operation the library says as a read and then a write guarded by what it read (``agent_sessions.backed``)
is wrong only when something lands in between: a takeover between ``take_queued``'s read and its pop, a save
between ``prune``'s listing and its delete, a second decision between a decision's read and its swap. Real
thread timing seldom puts anything there (the two are microseconds apart), so the model test stands between
each store and its ``Backend``, as ``storetest.between`` does, and widens some of those gaps.

What it decides is seeded: each operation (the model test runs op ``n`` on a thread named ``model-op-<n>``)
draws from its own ``random.Random`` of the program's seed and ``n``, once per backend call, whether to pause
there and for how long. The program's own draws are untouched (a seed draws the same program with gaps or
without). An operation may also start late (its first call waits), so that it lands inside the others
rather than beside their starts. A pause is taken only while another operation of the round is still
running (alone, nothing can land in it), at most ``MOST`` per operation (and a late start), each of a few
milliseconds; each pause taken goes to the op log. A store without a ``Backend`` (its reads and writes are
its own) is left as it is.

Off unless ``AGENT_SESSIONS_MODEL_GAPS=on`` (``storetest.model``): measured against the mutants of
tests/mutants.py, on the memory store and Redis, it killed none that the programs without it did not, and
no more often (docs/reliability.md, "Mutants"): the meeting-point bugs the model test misses need
operations its programs seldom put in one round, or a check it lacks, more than a wider gap.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from agent_sessions.backend import Backend

CHANCE = 0.25
"""The chance that a backend call of an operation pauses (after a read, before a write)."""
MOST = 3
"""Pauses an operation takes at most."""
PAUSES = (0.002, 0.005, 0.01, 0.02)
"""Seconds a pause lasts, drawn: long enough for another thread's write, or a whole short operation."""
LATE = 0.5
"""The chance that an operation starts late: its first backend call waits, so that it lands somewhere inside
the round's other operations rather than beside their starts (a round starts its operations together)."""
LATES = (0.001, 0.003, 0.01, 0.03)
"""Seconds a late start waits, drawn."""
THREAD = "model-op-"
"""The name (and op number) of the model test's operation threads (``storetest.model_ops``)."""


@dataclasses.dataclass
class _Op:
    """One operation's draws: its own generator, its backend calls so far, its pauses taken."""

    rng: random.Random
    calls: int = 0
    taken: int = 0


class Gaps:
    """The gaps of one program (``seed``): ``stand`` puts them between a store and its backend; ``lines(n)``
    says where op ``n`` paused."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._ops: dict[int, _Op] = {}
        self._said: dict[int, list[str]] = {}
        self._lock = threading.Lock()

    def stand(self, store: Any) -> Any:
        """``store``, its backend (if it has one) behind these gaps."""
        backend = getattr(store, "backend", None)
        if isinstance(backend, Backend) and not isinstance(backend, _Gapped):
            store.backend = _Gapped(backend, self)
        return store

    def around(self, make_store: Callable[[], Any]) -> Callable[[], Any]:
        """``make_store``, each store it makes behind these gaps."""
        return lambda: self.stand(make_store())

    def lines(self, n: int) -> list[str]:
        return list(self._said.get(n, []))

    def pause(self, when: str, call: str) -> None:
        """Called on the calling thread at each backend call: pause there if op's draw says so."""
        me = threading.current_thread()
        if not me.name.startswith(THREAD):
            return  # the machine's own checks, a library thread: never paused
        try:
            n = int(me.name[len(THREAD):])
        except ValueError:
            return
        with self._lock:
            op = self._ops.setdefault(n, _Op(random.Random(f"{self.seed}:{n}")))
        op.calls += 1
        if op.calls == 1:  # drawn at every call, so the draws follow the op's calls alone
            pause, seconds, most = op.rng.random() < LATE, op.rng.choice(LATES), MOST + 1
        else:
            pause, seconds, most = op.rng.random() < CHANCE, op.rng.choice(PAUSES), MOST
        if not pause or op.taken >= most:
            return
        if not any(t is not me and t.name.startswith(THREAD) and t.is_alive() for t in threading.enumerate()):
            return  # alone in its round: nothing would land in the gap
        op.taken += 1
        with self._lock:
            self._said.setdefault(n, []).append(f"  op {n} paused {seconds * 1000:.0f} ms {when} its backend "
                                                f"call {op.calls} ({call})")
        time.sleep(seconds)


def _fields(value: Any) -> str:
    """The fields of a ``Want``, ``Change`` or query that say something (not their defaults)."""
    if not dataclasses.is_dataclass(value):
        return type(value).__name__
    said = [f.name for f in dataclasses.fields(value) if getattr(value, f.name) != f.default]
    return f"{type(value).__name__}({', '.join(said)})"


class _Gapped:
    """Stands in for ``store.backend``: ``read`` and ``sessions`` may pause after the backend answered, ``write``
    before it is sent; everything else passes through."""

    def __init__(self, backend: Backend, gaps: Gaps) -> None:
        self.backend, self._gaps = backend, gaps

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def read(self, session: str, want: Any) -> Any:
        answer = self.backend.read(session, want)
        self._gaps.pause("after", f"read {_fields(want)}")
        return answer

    def sessions(self, query: Any) -> Any:
        answer = self.backend.sessions(query)
        self._gaps.pause("after", f"sessions {_fields(query)}")
        return answer

    def write(self, session: str, guard: Any, change: Any) -> Any:
        self._gaps.pause("before", f"write {_fields(change)}")
        return self.backend.write(session, guard, change)

    def __repr__(self) -> str:
        return f"gapped({self.backend!r})"
