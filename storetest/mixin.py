"""What a contract mixed into ``StoreContract`` uses of it, declared once for the type checker:
``StoreContract`` comes first in the class's order and gives the real ones."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings

from .capabilities import Capability


class ContractMixin:
    examples: int
    concurrency: int

    def make_store(self) -> Any:
        raise NotImplementedError

    def requires(self, capability: Capability) -> None:
        raise NotImplementedError

    def factory(self) -> Any:
        raise NotImplementedError

    def hypothesis(self, **overrides: Any) -> settings:
        raise NotImplementedError

    def capable_store(self, capability: Capability, protocol: type, methods: str) -> Any:
        """A store that declares ``capability``, checked to implement ``protocol`` (whose ``methods`` the
        failure names): a declared capability the store does not deliver fails, never skips."""
        self.requires(capability)
        store = self.make_store()
        if not isinstance(store, protocol):
            pytest.fail(f"the store declares Capability.{capability.name}, but {type(store).__name__} does not "
                        f"implement agent_sessions.{protocol.__name__} ({methods})")
        return store
