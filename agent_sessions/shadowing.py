"""Whether the package Python imports as ``stores`` is the library's own.

A project package of that name (a shop's ``stores`` app) first on ``sys.path`` hides the library's stores,
and ``from stores import sqlite`` fails with a bare "cannot import name". So what imports a store (the CLI,
the Django app and its check, and a finder asked when a ``stores.X`` import has failed) asks here first and
says what it found and what to do. Only paths are compared: the foreign package is never imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from .errors import StoresShadowed

LIBRARY_STORES = Path(__file__).resolve().parent.parent / "stores"
"""Where the library's ``stores`` is: installed from the same wheel (or tree) as ``agent_sessions``."""


def ships(name: str) -> bool:
    """Is ``stores.<name>`` a module of the library's own ``stores``? Read from its directory, so a store
    added there is covered without a list to keep."""
    return (LIBRARY_STORES / name / "__init__.py").is_file() or (LIBRARY_STORES / f"{name}.py").is_file()


def _found() -> str | None:
    """The file (or, for a namespace package, the directory) of the ``stores`` Python imports."""
    module = sys.modules.get("stores")
    if module is not None:
        return _where(module.__file__, getattr(module, "__path__", None))
    try:
        spec = importlib.util.find_spec("stores")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    return _where(spec.origin if spec.has_location else None, spec.submodule_search_locations)


def _where(origin: str | None, locations: Sequence[str] | None) -> str | None:
    if origin:
        return origin
    return next(iter(locations or ()), None)


def foreign_stores() -> StoresShadowed | None:
    """The error to raise when ``stores`` is not the library's (``None`` when it is, or when there is none
    at all, which the import itself reports)."""
    expected = LIBRARY_STORES / "__init__.py"
    found = _found()
    if found is None or not expected.is_file():
        return None  # nothing to compare with: a layout this check does not know
    here = Path(found).resolve()
    if here == LIBRARY_STORES or here.is_relative_to(LIBRARY_STORES):
        return None
    return StoresShadowed(
        f"the package 'stores' that Python imports is {found}, not agent-sessions' own stores ({expected}): "
        "a package of the project named 'stores' comes first on sys.path and hides the library's. Nothing "
        "is missing from the installation; rename the project's package (and its imports), e.g. to 'shop', "
        "since agent-sessions imports its stores as 'stores.<backend>'",
        found=found, expected=str(expected))


def check_stores() -> None:
    """Raise ``StoresShadowed`` when ``stores`` is foreign; before a store module is imported."""
    shadowed = foreign_stores()
    if shadowed is not None:
        raise shadowed


class _ShadowedStoreFinder(importlib.abc.MetaPathFinder):
    """Right after the path finder on ``sys.meta_path``: asked only about a module it failed to find. For
    one of the library's store modules under a foreign ``stores``, it raises ``StoresShadowed`` instead of
    Python's "cannot import name 'sqlite' from 'stores'" (or, in an editable install, before setuptools'
    finder grafts the library's module onto the foreign package)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        parent, _, name = fullname.partition(".")
        if parent == "stores" and name and ships(name):
            check_stores()
        return None


def install_finder() -> None:
    """Put the finder after the path finder on ``sys.meta_path``, once (``import agent_sessions`` does it)."""
    if any(isinstance(f, _ShadowedStoreFinder) for f in sys.meta_path):
        return
    after = [i for i, f in enumerate(sys.meta_path) if f is importlib.machinery.PathFinder]
    sys.meta_path.insert(after[0] + 1 if after else len(sys.meta_path), _ShadowedStoreFinder())


__all__ = ["LIBRARY_STORES", "check_stores", "foreign_stores", "install_finder"]
