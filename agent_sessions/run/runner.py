"""Runner starts runs; a Run is the handle of one in flight; a ``Result`` (``result``) is what it returns."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from .. import validate
from ..endpoints import Endpoint
from ..errors import ArgumentError
from ..events import Events
from ..lease import Lease
from ..messages import Message, Tail
from ..result import Result
from ..spec import Pattern, Spec
from . import busy, react
from .busy import Busy
from .steerbox import SteerBox

log = logging.getLogger(__name__)


class Run:
    """A run on its own thread. ``steer`` costs no round trip; ``wait`` returns the Result or re-raises;
    ``add_done_callback`` is told when it ends, for a caller that does not wait (a view answering 202)."""

    def __init__(self, name: str = "run") -> None:
        self.name = name
        self._box = SteerBox()
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Run], object]] = []
        self._watched = False
        self._result: Result | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def steer(self, text: str) -> None:
        self._box.put(text)

    def cancel(self) -> None:
        """Stop before the next model request or tool call; the run returns with ``stop_reason == "cancelled"``."""
        self._cancel.set()

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        """What the run raised, once it has ended (``None`` while it runs, or when it returned)."""
        return self._error if self._done.is_set() else None

    def add_done_callback(self, fn: Callable[[Run], object]) -> None:
        """Call ``fn(run)`` once the run has ended, on the run's thread (at once, here, if it already has).
        ``run.error`` then says whether it failed and ``run.wait(0)`` returns its Result. What ``fn``
        raises is logged, never lost and never the run's."""
        with self._lock:
            self._watched = True
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        self._call(fn)

    def wait(self, timeout: float | None = None) -> Result:
        self._watched = True
        if not self._done.wait(timeout):
            raise TimeoutError(f"the run did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _finish(self) -> None:
        with self._lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
            unwatched = not self._watched
        if self._error is not None and unwatched:
            # Nobody waits for this run and nobody asked to be told: the error would vanish with the thread.
            log.error("%s failed, and nothing waits for it", self.name, exc_info=self._error)
        for fn in callbacks:
            self._call(fn)

    def _call(self, fn: Callable[[Run], object]) -> None:
        try:
            fn(self)
        except Exception:
            log.exception("a done callback of %s raised", self.name)


class Runner:
    def run(self, spec: Spec, msgs: Sequence[Message], endpoint: Endpoint, events: Events | None = None) -> Result:
        """Run to the end on the calling thread."""
        return self._turn_run(spec, msgs, endpoint, events, False)

    def turn(self, spec: Spec, text: str, key: str, endpoint: Endpoint, events: Events | None = None,
             if_busy: Busy = "queue") -> Result:
        """Run the turn that answers the user message ``text``, safe to repeat with the same ``key`` (a
        task redelivered, a retried request): the message is appended only if no stored message has that
        key; a turn left unfinished is continued; an answered one is returned as it is stored, with no
        model request (``steps == 0``). ``spec.session`` must be over a RunStore (docs/lifecycle.md).

        ``if_busy``: what happens to the message while the session is busy: ``"queue"``, ``"steer"``,
        ``"reject"`` or ``"interrupt"`` (docs/runs/busy.md)."""
        _check(spec, [], endpoint, events)
        if not isinstance(text, str) or not text:
            raise ArgumentError(f"Runner.turn(text=) must be a non-empty str, got {text!r}")
        return busy.turn(self._turn_run, spec, text, key, endpoint, events, if_busy)

    def _turn_run(self, spec: Spec, msgs: Sequence[Message], endpoint: Endpoint, events: Events | None,
                  continuing: bool, lease: Lease | None = None) -> Result:
        """``run``, for ``turns``: ``continuing`` when it goes on with the turn rather than begin it; ``lease``:
        the session's, taken already by the turn (``busy``), which the run releases."""
        _check(spec, msgs, endpoint, events)
        return _execute(Run(), spec, msgs, endpoint, events, continuing, lease)

    def start(self, spec: Spec, msgs: Sequence[Message], endpoint: Endpoint, events: Events | None = None) -> Run:
        """Run on a new thread and return its handle at once. Arguments are checked here, not there."""
        _check(spec, msgs, endpoint, events)
        session_id = getattr(spec.session, "id", None)
        run = Run(f"the run of session {session_id!r}" if isinstance(session_id, str) else "a run")

        def target() -> None:
            try:
                run._result = _execute(run, spec, msgs, endpoint, events)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter, who re-raises it
                run._error = exc
            finally:
                run._finish()

        run._thread = threading.Thread(target=target, name="agent-run", daemon=False)
        run._thread.start()
        return run


def _check(spec: object, msgs: object, endpoint: object, events: object) -> None:
    if not isinstance(spec, Spec):
        raise ArgumentError(f"Runner: spec must be an agent.Spec, got {type(spec).__name__}")
    validate.distinct_call_ids(validate.messages(msgs, "Runner: msgs"), "Runner: msgs")
    if not callable(getattr(endpoint, "complete", None)):
        raise ArgumentError(f"Runner: endpoint needs a complete() method, got {type(endpoint).__name__}")
    if events is not None and not callable(events):
        raise ArgumentError("Runner: events must be None or a callable")


def _execute(run: Run, spec: Spec, msgs: Sequence[Message], endpoint: Endpoint, events: Events | None,
             continuing: bool = False, lease: Lease | None = None) -> Result:
    assert spec.pattern is Pattern.REACT
    try:
        transcript = Tail(msgs, msgs.start) if isinstance(msgs, Tail) else list(msgs)
        return react.run(spec, transcript, endpoint, events, run._box, run._cancel, continuing, lease)
    finally:
        run._box.close()
