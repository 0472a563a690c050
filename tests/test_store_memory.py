import storetest
from stores import memory


class TestMemoryStoreKeepsTheContract(storetest.StoreContract):
    # Each object is its own store, living in this process: neither durable nor reachable from another.
    capabilities = storetest.Capability.all() - {storetest.Capability.DURABLE, storetest.Capability.PROCESSES}

    def make_store(self) -> memory.Store:
        return memory.Store()
