import storetest
from stores import memory


class TestMemoryStoreKeepsTheContract(storetest.StoreContract):
    # Each object is its own store, living in this process: neither durable nor reachable from another.
    capabilities = storetest.Capability.none_but(storetest.Capability.RUN_STORE, storetest.Capability.LIFECYCLE)

    def make_store(self) -> memory.Store:
        return memory.Store()
