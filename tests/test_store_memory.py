import storetest
from stores import memory


class TestMemoryStoreKeepsTheContract(storetest.StoreContract):
    def make_store(self) -> memory.Store:
        return memory.Store()
