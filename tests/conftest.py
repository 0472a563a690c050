from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.model_server import ModelServer


@pytest.fixture
def model() -> Iterator[ModelServer]:
    server = ModelServer()
    yield server
    server.close()
