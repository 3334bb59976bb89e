"""Shared fixtures: real services (see tests/services.py)."""

from __future__ import annotations

import pytest

from tests.services import RedisServer, redis_server


@pytest.fixture
def redis() -> RedisServer:
    """A fresh real redis-server on a random 127.0.0.1 port (per test)."""
    with redis_server() as server:
        yield server
