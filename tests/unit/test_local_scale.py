"""`trainingrun scale` and the local launcher's engine pool resize (issue 32 item 4, the launcher's rules) with stand-in
servers: new servers are listed only once healthy; a removed one leaves the list at once and is stopped only once the
rollout's pool applied a list without it; bad requests are refused naming the argument. The real vLLM run:
tests/integration/test_vllm_scale.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from trainingrun.api import load_trainingrun
from trainingrun.api.spec.engine import EngineSpec
from trainingrun.engines.pool import EnginePool
from trainingrun.engines.vllm.engine import AppliedList, read_urls, write_urls
from trainingrun.local import engine as local_engine
from trainingrun.local import scale
from trainingrun.local.rundir import RunDirLock

ROOT = Path(__file__).resolve().parents[2]


class FakeProc:
    def __init__(self):
        self.returncode = None

    def poll(self):
        return self.returncode


class FakeServer:
    made: list[FakeServer] = []

    def __init__(self, log_path: Path, port: int):
        self.url, self.log_path, self.proc, self.pid, self.starts = f"http://127.0.0.1:{port}", log_path, None, None, 0
        self.up, self.closed = False, False
        FakeServer.made.append(self)

    def start(self):
        self.proc, self.starts = FakeProc(), self.starts + 1

    def healthy(self):
        return self.up

    def close(self):
        self.closed = True


class Kind:
    title = "vLLM"

    @staticmethod
    def local(spec, *, log_path, port):
        return FakeServer(log_path, port)


@pytest.fixture
def pool(tmp_path, monkeypatch) -> local_engine.LocalEnginePool:
    FakeServer.made = []
    monkeypatch.setattr(local_engine, "server_kind", lambda spec: Kind)
    monkeypatch.setattr(local_engine, "LIVENESS_PERIOD", 0.0)
    doc = yaml.safe_load((ROOT / "examples" / "rl.yaml").read_text())
    doc["spec"]["rollout"]["engine"] = {"type": "vllm", "replicas": 1}
    doc["spec"]["model"] = {"hf": str(tmp_path)}  # not read: the servers are stand-ins
    doc["spec"]["weightSync"] = {"type": "disk"}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(doc))
    p = local_engine.LocalEnginePool(load_trainingrun(tmp_path / "spec.yaml"), tmp_path)
    p.start()
    FakeServer.made[0].up = True
    p.join_all()
    return p


def applied(pool, urls):
    time.sleep(0.01)
    write_urls(pool.applied_file, urls)


def test_max_replicas_is_the_api_bound():
    bound = next(m.le for m in EngineSpec.model_fields["replicas"].metadata if hasattr(m, "le"))
    assert local_engine.MAX_REPLICAS == bound


def test_a_new_server_is_listed_only_once_healthy_and_a_removed_one_stopped_once_let_go(pool):
    first = pool.replicas[0].url
    assert read_urls(str(pool.url_file)) == [first] and pool.size() == {"wanted": 1, "listed": 1, "leaving": 0}
    pool.resize_to(2)
    new = FakeServer.made[1]
    assert new.starts == 1 and pool.step() == [] and read_urls(str(pool.url_file)) == [first]  # starting: not listed
    new.up = True
    events = pool.step()
    assert len(events) == 1 and "engine-1 healthy" in events[0], events
    assert read_urls(str(pool.url_file)) == [first, new.url] and pool.size()["listed"] == 2
    assert pool.processes()["engine-1"]["listed"] is True
    applied(pool, [first, new.url])
    pool.resize_to(1)
    assert read_urls(str(pool.url_file)) == [first]  # off the list at once
    assert pool.step() == [] and not new.closed  # the applied list (older than the rewrite) still has it
    applied(pool, [first, new.url])  # a call that began before the rewrite: still in use
    assert pool.step() == [] and not new.closed
    assert pool.size() == {"wanted": 1, "listed": 1, "leaving": 1} and len(pool.check()) == 0
    applied(pool, [first])
    events = pool.step()
    assert new.closed and events == ["engine-1 stopped: the rollout's pool let it go"], events
    assert [r.name for r in pool.replicas] == ["engine-0"] and pool.size() == {"wanted": 1, "listed": 1, "leaving": 0}
    assert set(pool.processes()) == {"engine-0"}


def test_a_server_removed_before_it_joined_is_stopped_at_once_and_one_asked_back_stays(pool):
    pool.resize_to(3)
    pool.resize_to(2)  # engine-2 never joined: nothing can use it
    assert pool.step() == ["engine-2 stopped before it joined"] and FakeServer.made[2].closed
    FakeServer.made[1].up = True
    pool.step()
    pool.resize_to(1)
    pool.resize_to(2)  # asked back before it left: listed again, never stopped
    applied(pool, [pool.replicas[0].url])
    assert pool.step() == [] and not FakeServer.made[1].closed
    assert read_urls(str(pool.url_file)) == [r.url for r in pool.replicas]


@pytest.mark.parametrize("n", [0, 257])
def test_a_bad_size_is_refused_naming_the_field(pool, n):
    with pytest.raises(ValueError, match=r"replicas: .*spec\.rollout\.engine\.replicas"):
        pool.resize_to(n)


def test_the_pool_writes_each_list_it_applied(tmp_path):
    """The rollout's side: EnginePool's `applied` hook, written by `AppliedList` after each re-read list."""
    listed, out = tmp_path / "urls", tmp_path / "urls.applied"
    write_urls(listed, ["http://a", "http://b"])

    class Stub:
        url = ""

    pool = EnginePool([Stub(), Stub()], fetch=lambda v: {}, members=lambda: read_urls(str(listed)),
                      adapter_for=lambda url: Stub(), applied=AppliedList(str(out)), say=lambda m: None)
    pool._read_members()
    assert read_urls(str(out)) == ["http://a", "http://b"]
    write_urls(listed, ["http://a"])
    pool._read_members()
    assert read_urls(str(out)) == ["http://a"] and len(pool.replicas) == 1


def run_dir(tmp_path: Path, engine: dict) -> Path:
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"spec": {"rollout": {"engine": engine}}}))
    return tmp_path


def test_scale_refuses_bad_arguments_naming_them(tmp_path, capsys):
    d = run_dir(tmp_path, {"type": "vllm"})
    assert scale.refusal(d, 0).startswith("--replicas: 0; allowed: 1..256")
    assert scale.refusal(tmp_path / "nowhere", 2).startswith("RUN_DIR:")
    assert "no launcher runs" in scale.refusal(d, 2)
    assert "rollout.engine.url is set" in scale.refusal(run_dir(tmp_path, {"type": "vllm", "url": "http://x"}), 2)
    assert "rollout.engine.type is megatron" in scale.refusal(run_dir(tmp_path, {"type": "megatron"}), 2)
    args = scale.argparse.Namespace(run_dir=str(tmp_path), replicas=-1, wait=False, timeout=1.0)
    assert scale.run(args) == 1 and "--replicas: -1" in capsys.readouterr().err
    assert not (tmp_path / scale.SCALE_FILE).exists()


def test_scale_writes_the_request_the_launcher_reads_once(tmp_path):
    d = run_dir(tmp_path, {"type": "vllm"})
    requests = scale.ScaleRequests(d)
    assert requests.poll() == (None, "")
    with RunDirLock(d):  # a live launcher holds the directory
        assert scale.run(scale.argparse.Namespace(run_dir=str(d), replicas=3, wait=False, timeout=1.0)) == 0
    assert requests.poll() == (3, "") and requests.poll() == (None, "")
    (d / scale.SCALE_FILE).write_text(json.dumps({"replicas": "3"}))
    os.utime(d / scale.SCALE_FILE, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    n, problem = requests.poll()
    assert n is None and "replicas: '3'; allowed: an integer 1..256; ignored" in problem
    assert scale.ScaleRequests(d).poll() == (None, "")  # a new launcher clears an earlier request


def test_the_launcher_applies_a_scale_request_to_its_pool(tmp_path, monkeypatch):
    """The launcher's side end to end with stand-in server processes (tests/unit/test_vllm_wiring.py's FAKE_SERVER):
    `trainingrun scale` → the launcher's `_resize` starts engine-1, lists it once healthy (pids.json, engine-urls),
    then stops it once the rollout's list leaves it out; summary's `engine_resizes` says how long each took."""
    import sys
    from types import SimpleNamespace

    from tests.unit.test_vllm_wiring import FAKE_SERVER, _wait, make_run
    from trainingrun.engines.vllm.server import PYTHON_ENV
    from trainingrun.local.launcher import Launcher

    fake = tmp_path / "fake-vllm-python"
    fake.write_text(FAKE_SERVER.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv(PYTHON_ENV, str(fake))
    out = tmp_path / "out"
    launcher = Launcher(make_run(tmp_path, engine={"type": "vllm", "vllm": {"maxModelLen": 64}}), out, progress=None)
    launcher.prepare()
    with RunDirLock(out):
        try:
            assert launcher.start_engine() is None
            pool = launcher.engine
            launcher._pids_of = (SimpleNamespace(children=[]), 0, "file://store")
            args = scale.argparse.Namespace(run_dir=str(out), replicas=2, wait=False, timeout=1.0)
            assert scale.run(args) == 0
            _wait(lambda: launcher._resize() or scale.reached(out, 2))
            engine1 = pool.replicas[1].server
            pid1 = engine1.pid
            assert read_urls(str(pool.url_file)) == [r.url for r in pool.replicas] and engine1.proc.poll() is None
            assert scale.run(scale.argparse.Namespace(run_dir=str(out), replicas=1, wait=False, timeout=1.0)) == 0
            launcher._resize()
            assert read_urls(str(pool.url_file)) == [pool.replicas[0].url] and engine1.proc.poll() is None  # in use
            applied(pool, [pool.replicas[0].url])  # the rollout's pool let it go
            _wait(lambda: launcher._resize() or scale.reached(out, 1))
            assert engine1.proc is None and len(pool.replicas) == 1
            with pytest.raises(ProcessLookupError):
                os.kill(pid1, 0)  # stopped and reaped
            assert [(r["from"], r["to"]) for r in launcher.engine_resizes] == [(1, 2), (2, 1)]
            assert all(r["reached_after"] is not None for r in launcher.engine_resizes)
        finally:
            if launcher.engine is not None:
                launcher.engine.stop()
