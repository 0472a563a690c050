"""The conformance suite every Store runs. A store author's whole test file is one class::

    import storetest

    class TestMyStoreKeepsTheContract(storetest.StoreContract):
        def make_store(self):
            return MyStore(...)

        def process_factory(self):          # the store is reached from other processes
            return functools.partial(make_my_store, URL)

A store declares what it offers once (``capabilities``, all of ``storetest.Capability`` by default); every
test those imply must pass, and a declared capability it does not deliver fails rather than skips.
It is plain pytest: failures keep their ids, ``-k`` works, assertions are introspected.
"""

try:
    import hypothesis  # noqa: F401
    import pytest  # noqa: F401
except ImportError as exc:
    raise ImportError(
        f"storetest requires pytest and Hypothesis ({exc.name} is missing). "
        "Install them with: pip install 'stored-agent-sessions[storetest]'"
    ) from exc

from .capabilities import Capability
from .contract import SETTINGS, StoreContract

__all__ = ["SETTINGS", "Capability", "StoreContract"]
