"""Shared fixtures: real services (see tests/services.py)."""

from __future__ import annotations

import pytest

from tests.services import RedisServer, make_tiny_llama, redis_server, require_vllm, vllm_server


@pytest.fixture
def redis() -> RedisServer:
    """A fresh real redis-server on a random 127.0.0.1 port (per test)."""
    with redis_server() as server:
        yield server


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> "Path":  # noqa: F821
    """A tiny random Llama HF directory made by transformers (tests/tiny_llama.py), shared by the session."""
    python = require_vllm()
    return make_tiny_llama(python, tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture(scope="session")
def vllm(tiny_llama_dir, tmp_path_factory):
    """ONE real vLLM server (CPU) on the tiny Llama for the whole session: start-up (~1 min) is paid once. Tests that
    change its weights must put back what they found (see tests/integration/test_vllm.py); a test that kills it
    restarts it."""
    with vllm_server(tiny_llama_dir, tmp_path_factory.mktemp("vllm") / "server.log") as server:
        yield server
