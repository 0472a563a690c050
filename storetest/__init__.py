"""The conformance suite every Store runs. A store author's whole test file is one class::

    import storetest

    class TestMyStoreKeepsTheContract(storetest.StoreContract):
        def make_store(self):
            return MyStore(...)

It is plain pytest: failures keep their ids, ``-k`` works, assertions are introspected.
"""

from .contract import SETTINGS, StoreContract

__all__ = ["SETTINGS", "StoreContract"]
