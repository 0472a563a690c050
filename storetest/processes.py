"""Where storetest's other processes come from.

Each is forked from multiprocessing's *fork server*, a fresh interpreter that imports modules and never
opens anything, so a child inherits no socket, lock or thread of the test's (what a plain fork would), and
starts in milliseconds instead of importing its driver again, as a spawned interpreter does.

Two things a spawned child would see that a forked one does not: environment variables and ``sys.path``
entries set after the first process was started (the fork server keeps those of the moment it started).
Where the fork server is not available (Windows), the processes are spawned."""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.context
import threading
from collections.abc import Callable, Sequence
from typing import Any

Context = multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext

_LIBRARY = ["agent_sessions", "storetest.crossprocess", "storetest.model_ops"]
_lock = threading.Lock()
_preloaded = False


def factory_module(factory: Callable[..., Any]) -> str | None:
    """The module that defines ``factory`` (through a ``functools.partial`` and a bound method)."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    module = getattr(factory, "__module__", None)
    return module if isinstance(module, str) and module != "__main__" else None


def context(factory: Callable[..., Any] | None = None, preload: Sequence[str] = ()) -> Context:
    """The multiprocessing context to start a test's processes with. The first call decides what the fork
    server preloads: the library, ``factory``'s module and ``preload`` (a suite of several stores names all
    their modules in one call before its first test, as tests/conftest.py does)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    global _preloaded
    ctx = multiprocessing.get_context("forkserver")
    with _lock:
        if not _preloaded:
            module = factory_module(factory) if factory is not None else None
            ctx.set_forkserver_preload([*_LIBRARY, *([module] if module else []), *preload])
            _preloaded = True
    return ctx
