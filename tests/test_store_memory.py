import storetest
from stores import memory


class TestMemoryStoreKeepsTheContract(storetest.StoreContract):
    # Each object is its own store, living in this process: neither durable nor reachable from another.
    capabilities = storetest.Capability.all() - {storetest.Capability.DURABLE, storetest.Capability.PROCESSES}
    # A program here takes a quarter of a second (no server, no child process), against Redis's three: the
    # model test's random programs are drawn here, where most of the library's meeting points cost least.
    model_programs = 20

    def make_store(self) -> memory.Store:
        return memory.Store()
