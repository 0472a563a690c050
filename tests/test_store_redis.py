"""The Redis store keeps the contract, on a real redis-server (tests/servers.py: REDIS_URL), every key under
this run's own prefix, deleted after."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterator

import pytest
import redis as redis_py

import storetest
from stores import redis
from tests import servers


def open_store(url: str, prefix: str) -> redis.Store:
    return redis.Store(redis_py.Redis.from_url(url), prefix=prefix)


class TestRedisStoreKeepsTheContract(storetest.StoreContract):
    model_programs = 2  # three seconds each (child processes killed and frozen): the memory store draws 20
    @pytest.fixture(autouse=True)
    def _prefix(self) -> Iterator[None]:
        self.prefix = f"{servers.REDIS_KEY_PREFIX}store:{uuid.uuid4().hex[:12]}:"
        self.client = redis_py.Redis.from_url(servers.REDIS_URL)
        yield
        for key in self.client.scan_iter(match=f"{self.prefix}*", count=1000):
            self.client.delete(key)
        self.client.close()

    def make_store(self) -> redis.Store:
        return redis.Store(self.client, prefix=self.prefix)

    def process_factory(self) -> functools.partial[redis.Store]:
        return functools.partial(open_store, servers.REDIS_URL, self.prefix)
