"""How a run reaches vLLM: the engine and publisher a spec selects (and the combinations refused, naming the field),
the weight directories and store commits of `disk`/`broadcast`, and the launcher's supervision of the run's own vLLM
server (a stand-in server process that answers /health: the real one is in tests/integration/test_vllm_e2e.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.services import wait_for

from trainingrun.api import parse_trainingrun
from trainingrun.modeling.architecture import resolve

ARCH = resolve("tiny-llama", seq_length=64)  # the model these runs would read from model.hf (absent here)


def run_doc(tmp_path: Path, *, engine: dict | None = None, sync: str = "disk", max_restarts: int = 1) -> dict:
    engine = {"type": "vllm", "vllm": {"maxModelLen": 64}} if engine is None else engine
    return {
        "apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "v"},
        "spec": {"model": {"hf": str(tmp_path / "model"), "seqLength": 64},
                 "trainer": {"replicas": 1, "maxTokensPerGPU": 256,
                             "checkpoint": {"path": str(tmp_path / "ckpt")}},
                 "rollout": {"source": {"type": "generate", "generate": {}}, "engine": engine},
                 "weightSync": {"type": sync},
                 "failurePolicy": {"maxRestarts": max_restarts, "backoffSeconds": 0}}}


def make_run(tmp_path: Path, **kw):
    return parse_trainingrun(run_doc(tmp_path, **kw))


@pytest.fixture
def store(tmp_path: Path):
    from trainingrun.store import open_store

    s = open_store(f"file://{tmp_path / 'store'}")
    yield s
    s.close()


# ------------------------------------------------------------------------------------------ engine and publisher
@pytest.mark.parametrize("engine,sync,field", [
    ("vllm", "store", "weightSync.type store reaches the megatron engine only"),
    ("megatron", "disk", "weightSync.type disk and broadcast reach the vllm engine only"),
    ("megatron", "broadcast", "weightSync.type disk and broadcast reach the vllm engine only"),
])
def test_the_spec_refuses_a_sync_the_engine_cannot_load(tmp_path: Path, engine, sync, field):
    """A rule of the spec (CEL at admission, its Python twin everywhere a manifest is loaded), so neither the trainer's
    publisher nor the rollout's engine ever sees such a run."""
    from pydantic import ValidationError

    from trainingrun.api.checks import validate_document

    with pytest.raises(ValidationError, match=field):
        make_run(tmp_path, engine={"type": engine}, sync=sync)
    problems = validate_document(run_doc(tmp_path, engine={"type": engine}, sync=sync))
    assert [p.path for p in problems] == ["spec.weightSync.type"] and field in problems[0].message


def test_vllm_engine_needs_disk_or_broadcast_and_a_server(tmp_path: Path, store, monkeypatch):
    from pydantic import ValidationError

    from trainingrun.contract.errors import ConfigError
    from trainingrun.engines.table import make_engine
    from trainingrun.contract.env import ENGINE_URL_ENV

    monkeypatch.delenv(ENGINE_URL_ENV, raising=False)
    with pytest.raises(ValidationError, match="weightSync.type store reaches the megatron engine only"):
        make_run(tmp_path, sync="store")
    with pytest.raises(ConfigError, match="rollout.engine.url"):
        make_engine(make_run(tmp_path).spec, store, ARCH)
    monkeypatch.setenv(ENGINE_URL_ENV, "http://127.0.0.1:9")  # the launcher's / operator's server
    engine = make_engine(make_run(tmp_path).spec, store, ARCH)
    assert engine.name == "vllm" and engine.client.url == "http://127.0.0.1:9"
    engine.close()
    engine = make_engine(make_run(tmp_path, engine={"type": "vllm", "url": "http://h:8000/"}).spec, store, ARCH)
    assert engine.client.url == "http://h:8000"  # the user's server wins
    engine.close()


def test_the_run_s_own_servers_follow_the_operators_list(tmp_path: Path, store, monkeypatch):
    """With $TRAININGRUN_ENGINE_URL_FILE (the operator's ConfigMap, docs/operator.md "Resizing the engine pool") the
    pool starts from the file's servers and re-reads it (`members`), making a vLLM replica of a URL added later; the
    user's own servers (engine.url) follow no file."""
    from trainingrun.contract.env import ENGINE_URL_ENV, ENGINE_URL_FILE_ENV
    from trainingrun.engines.table import make_engine

    listed = tmp_path / "engines"
    listed.write_text("http://127.0.0.1:9\nhttp://127.0.0.1:10\n")
    monkeypatch.setenv(ENGINE_URL_ENV, "http://127.0.0.1:9")
    monkeypatch.setenv(ENGINE_URL_FILE_ENV, str(listed))
    engine = make_engine(make_run(tmp_path).spec, store, ARCH)
    assert [r.url for r in engine.replicas] == ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    listed.write_text("http://127.0.0.1:9\nhttp://127.0.0.1:10\nhttp://127.0.0.1:11\n")
    assert engine.members() == ["http://127.0.0.1:9", "http://127.0.0.1:10", "http://127.0.0.1:11"]
    assert engine.adapter_for("http://127.0.0.1:11").url == "http://127.0.0.1:11"
    engine.close()
    engine = make_engine(make_run(tmp_path, engine={"type": "vllm", "url": "http://h:8000"}).spec, store, ARCH)
    assert engine.members is None and [r.url for r in engine.replicas] == ["http://h:8000"]
    engine.close()


def test_engine_url_must_be_http():
    from pydantic import ValidationError

    from trainingrun.api.spec.engine import EngineSpec

    with pytest.raises(ValidationError, match="url"):
        EngineSpec.model_validate({"type": "vllm", "url": "h:8000"})


def test_a_committed_version_tells_the_engine_where_its_weights_are(tmp_path: Path, store):
    """The store holds where a version is (disk path or broadcast address), not the weights; the engine's fetch reads
    exactly that back, and a version is visible only once committed."""
    from trainingrun.engines.table import make_engine
    from trainingrun.engines.vllm.publish import commit_version

    assert store.latest_weights() is None
    assert commit_version(store, 3, {"method": "disk", "path": "/vol/w/v00000003-a0", "bytes": 10})
    assert not commit_version(store, 3, {"method": "disk", "path": "/elsewhere"})  # committed once
    engine = make_engine(make_run(tmp_path, engine={"type": "vllm", "url": "http://127.0.0.1:9"}).spec, store, ARCH)
    assert engine.fetch(3) == {"method": "disk", "path": "/vol/w/v00000003-a0", "bytes": 10, "version": 3}
    assert store.latest_weights() == 3
    engine.close()


def test_weight_directories_carry_version_and_attempt(tmp_path: Path):
    from trainingrun.engines.vllm.publish import dir_version, version_dir

    d = version_dir(tmp_path, 12, 3)
    assert d.name == "v00000012-a3" and dir_version(d) == 12
    assert dir_version(tmp_path / "notes") is None and dir_version(tmp_path / "vx-a1") is None


# ------------------------------------------------------------------------------------------ the run's own server
FAKE_SERVER = """#!{python}
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_launcher_restarts_a_dead_engine_within_the_budget_then_fails_naming_it(tmp_path: Path, monkeypatch):
    from trainingrun.local.launcher import Launcher
    from trainingrun.engines.vllm.server import PYTHON_ENV

    fake = tmp_path / "fake-vllm-python"
    fake.write_text(FAKE_SERVER.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv(PYTHON_ENV, str(fake))
    launcher = Launcher(make_run(tmp_path, max_restarts=1), tmp_path / "out", progress=None)
    launcher.prepare()
    try:
        assert launcher.start_engine() is None  # healthy
        pool = launcher.engine
        engine = pool.replicas[0]
        assert engine.healthy() and engine.server.log_path.name == "engine-0.log"
        engine.server.kill()
        failure = _wait(pool.check)[0]
        assert failure.name == "engine-0" and failure.code == -9, failure
        assert launcher._engine_failed(failure) is None and launcher.restarts == 1  # restarted, counted
        _wait(lambda: not pool.check() and engine.server.proc is not None and engine.healthy())
        assert engine.server.log_path.name == "engine-0.log" and "restart 1" in engine.server.log_path.read_text()
        engine.server.kill()
        outcome = launcher._engine_failed(_wait(pool.check)[0])
        assert outcome is not None and outcome.status == "failed" and outcome.culprit == "engine"
    finally:
        if launcher.engine is not None:
            launcher.engine.stop()


def test_a_pool_replica_beyond_the_budget_stays_down_and_only_an_empty_pool_fails_the_run(tmp_path: Path,
                                                                                          monkeypatch):
    """rollout.engine.replicas 2: engine-1 killed is restarted alone (pids.json names both under processes, with
    its new pid); killed again beyond the budget it stays down and the run goes on with engine-0; once engine-0
    dies too the run fails naming both engines and their last exits."""
    import json
    from types import SimpleNamespace

    from trainingrun.local.launcher import Launcher
    from trainingrun.engines.vllm.server import PYTHON_ENV

    fake = tmp_path / "fake-vllm-python"
    fake.write_text(FAKE_SERVER.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv(PYTHON_ENV, str(fake))
    run = make_run(tmp_path, engine={"type": "vllm", "replicas": 2, "vllm": {"maxModelLen": 64}}, max_restarts=1)
    launcher = Launcher(run, tmp_path / "out", progress=None)
    launcher.prepare()
    try:
        assert launcher.start_engine() is None
        pool = launcher.engine
        assert [r.name for r in pool.replicas] == ["engine-0", "engine-1"] and len(pool.url.split(",")) == 2
        launcher._pids_of = (SimpleNamespace(children=[]), 0, "file://store")  # no attempt's processes: the engines
        launcher.write_pids()
        procs = json.loads((tmp_path / "out" / "pids.json").read_text())["processes"]
        assert {k: (v["role"], v["rank"], Path(v["log"]).name) for k, v in procs.items()} == {
            "engine-0": ("engine", 0, "engine-0.log"), "engine-1": ("engine", 1, "engine-1.log")}
        first = pool.replicas[1].server.pid
        pool.replicas[1].server.kill()
        failure = _wait(pool.check)[0]
        assert failure.name == "engine-1" and launcher._engine_failed(failure) is None and launcher.restarts == 1
        _wait(lambda: not pool.check() and pool.replicas[1].server.proc is not None and pool.replicas[1].healthy())
        assert pool.replicas[0].server.starts == 1  # engine-0 untouched
        launcher.write_pids()
        procs = json.loads((tmp_path / "out" / "pids.json").read_text())["processes"]
        assert procs["engine-1"]["pid"] not in (None, first) and procs["engine-1"]["restarts"] == 1
        pool.replicas[1].server.kill()
        assert launcher._engine_failed(_wait(pool.check)[0]) is None  # beyond the budget: down, engine-0 serves
        assert [r.name for r in pool.live()] == ["engine-0"]
        assert json.loads((tmp_path / "out" / "pids.json").read_text())["processes"]["engine-1"]["down"]
        pool.replicas[0].server.kill()
        outcome = launcher._engine_failed(_wait(pool.check)[0])
        assert outcome is not None and outcome.status == "failed" and outcome.culprit == "engines"
        assert "engine-0: killed by SIGKILL" in outcome.reason and "engine-1: killed by SIGKILL" in outcome.reason
    finally:
        if launcher.engine is not None:
            launcher.engine.stop()


def test_launcher_names_a_missing_vllm_environment(tmp_path: Path, monkeypatch):
    from trainingrun.local.launcher import Launcher
    from trainingrun.engines.vllm import server

    monkeypatch.setattr(server, "find_python", lambda: None)
    launcher = Launcher(make_run(tmp_path), tmp_path / "out")
    outcome = launcher.start_engine()
    assert outcome.status == "config_error" and "make vllm" in outcome.reason


def _wait(fn, timeout: float = 30.0):
    return wait_for(fn, timeout, getattr(fn, "__name__", "the engine"), interval=0.1)


# ------------------------------------------------------------------------------------------ engine recovery
class _DownClient:
    url = "http://127.0.0.1:9"

    def __init__(self):
        self.waits = 0
        self.label = None  # None: unreachable

    def weight_version(self) -> str:
        from trainingrun.contract.engine import EngineUnavailable

        if self.label is None:
            raise EngineUnavailable("GET /weight_info: unreachable")
        return self.label

    def wait_healthy(self, timeout: float) -> float:
        self.waits += 1
        return 0.0


def test_a_load_while_the_server_is_down_waits_for_it_and_loads_again(monkeypatch):
    """Regression (found by test_vllm_e2e: the launcher restarted a killed server, but the rollout's next load_weights
    raised EngineUnavailable at once and the rollout exited 1): a load that finds the server down waits for /health
    and is retried from the start; only after MAX_RECOVERIES failures does it raise."""
    from trainingrun.contract.engine import EngineUnavailable
    from trainingrun.engines import pool
    from trainingrun.engines.vllm import engine as eng

    calls = []

    def load_from_disk(client, path, label, timeout, **kw):
        calls.append(label)
        if len(calls) == 1:
            raise EngineUnavailable("POST /pause: unreachable")
        return {"path": path}

    monkeypatch.setattr(eng.sync, "load_from_disk", load_from_disk)
    client = _DownClient()
    engine = eng.VLLMEngine(client, fetch=lambda v: {"method": "disk", "path": f"/w/v{v}"}, say=lambda m: None)
    engine.load_weights(2)
    assert engine.weight_version == 2 and calls == ["v2", "v2"] and client.waits == 1
    assert engine.stats["recoveries"] == 1 and engine.stats["loads"] == 1

    def never(client, path, label, timeout, **kw):
        raise EngineUnavailable("down for good")

    monkeypatch.setattr(eng.sync, "load_from_disk", never)
    with pytest.raises(EngineUnavailable, match="down for good"):
        engine.load_weights(3)
    assert engine.weight_version == 2  # still the version it fully loaded
    assert client.waits == 1 + pool.MAX_RECOVERIES
    # the live server refused the load (still labelled by it): raised at once, nothing to wait for
    client.label = "loading:v3"
    with pytest.raises(EngineUnavailable, match="down for good"):
        engine.load_weights(3)
    assert client.waits == 1 + pool.MAX_RECOVERIES and engine.weight_version == 2
    engine.close()


def test_a_fenced_off_trainer_cannot_commit_a_weight_version(tmp_path: Path):
    """A trainer of an older attempt (a zombie after the group restarted) publishes nothing: the store's attempt
    fencing refuses its commit, and the live attempt's version stays what it wrote."""
    from trainingrun.store import open_store
    from trainingrun.store.base import StaleAttempt
    from trainingrun.engines.vllm.publish import commit_version

    url = f"file://{tmp_path / 'store'}"
    zombie = open_store(url, attempt=0)
    live = open_store(url, attempt=1)
    try:
        assert commit_version(live, 1, {"method": "disk", "path": "/w/v00000001-a1"})
        with pytest.raises(StaleAttempt):
            commit_version(zombie, 2, {"method": "disk", "path": "/w/v00000002-a0"})
        assert live.latest_weights() == 1
        assert live.read_weights(1)[1]["path"] == "/w/v00000001-a1"
    finally:
        zombie.close()
        live.close()


def test_the_store_publisher_is_the_megatron_engines_and_refused_at_pipeline_parallel_size_2(tmp_path: Path, store):
    """weightSync store with the megatron engine: the engine table's store publisher. It publishes trainer rank 0's
    own state dict, which at PP 2 holds one stage of the model: the spec refuses that at admission (the CEL rule
    store-sync-single-stage and its Python twin: the API server, `trainingrun validate` and every loader), naming
    the field."""
    from trainingrun.engines.store_sync import StoreWeightPublisher
    from trainingrun.trainer.weights import make_publisher

    doc = run_doc(tmp_path, engine={"type": "megatron"}, sync="store")
    doc["spec"]["trainer"]["replicas"] = 2
    assert isinstance(make_publisher(parse_trainingrun(doc).spec, store, arch=ARCH, rank=0), StoreWeightPublisher)
    doc["spec"]["trainer"]["pipelineParallelSize"] = 2
    with pytest.raises(ValueError, match=r"weightSync\.type store publishes .* allowed: pipelineParallelSize 1"):
        parse_trainingrun(doc)
