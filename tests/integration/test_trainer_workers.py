"""The trainer's per-pod supervisor (gpusPerReplica = G > 1) with stand-in workers: ranks and ports it hands out,
failure propagation (78 stays 78) without orphans, signal forwarding.

The real `trainingrun trainer` is the supervisor; only its workers are a small stand-in program (through
TRAININGRUN_CHILD_COMMAND, as the local launcher's tests do), so each case runs in about a second. The same paths
with real Megatron workers are in test_local_e2e.py.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.services import pid_alive, wait_for
from trainingrun.trainer.workers import exit_status, is_worker, worker_env

ROOT = Path(__file__).resolve().parents[2]

# Stand-in worker: records its environment and pid, then behaves as $STUB_MODE says for its LOCAL_RANK.
STUB = r'''
import json, os, signal, sys, time
out = os.environ["STUB_DIR"]
lr = int(os.environ["LOCAL_RANK"])
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TRAININGRUN_NODE_RANK", "TRAININGRUN_NUM_NODES",
        "TRAININGRUN_METRICS_PORT", "MASTER_ADDR", "MASTER_PORT", "TRAININGRUN_CONFIG"]
rec = {k: os.environ.get(k) for k in keys}
rec["pid"], rec["argv"] = os.getpid(), sys.argv[1:]
mode = os.environ.get("STUB_MODE", "ok")
if mode != "ok":  # workers that are stopped record the SIGTERM (PR_SET_PDEATHSIG's SIGKILL cannot be trapped)
    def on_term(signum, frame):
        open(os.path.join(out, f"term-{lr}"), "w").write(str(signum))
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
with open(os.path.join(out, f"w{lr}.json.tmp"), "w") as f:
    json.dump(rec, f)
os.replace(os.path.join(out, f"w{lr}.json.tmp"), os.path.join(out, f"w{lr}.json"))
if mode == "ok":
    sys.exit(0)
if mode == "fail78" and lr == 1:
    time.sleep(0.5)
    sys.exit(78)
if mode == "kill9" and lr == 0:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
while True:
    time.sleep(0.1)
'''


def _spec(path: Path, gpus: int) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["spec"]["trainer"].update(replicas=2, gpusPerReplica=gpus)
    path.write_text(yaml.safe_dump(doc))
    return path


def _start(tmp_path: Path, mode: str, *, gpus: int = 3, node_rank: int = 1) -> subprocess.Popen:
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env.update({
        "TRAININGRUN_CONFIG": str(_spec(tmp_path / "run.yaml", gpus)), "RANK": str(node_rank), "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555", "TRAININGRUN_METRICS_PORT": "9500",
        "TRAININGRUN_CHILD_COMMAND": shlex.join([sys.executable, str(stub)]),
        "STUB_DIR": str(tmp_path), "STUB_MODE": mode,
    })
    return subprocess.Popen([sys.executable, "-m", "trainingrun", "trainer", "--wait-timeout", "5"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _workers(tmp_path: Path, n: int) -> list[dict]:
    wait_for(lambda: all((tmp_path / f"w{i}.json").exists() for i in range(n)), 20, f"{n} workers started",
             interval=0.05)
    return [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(n)]


def test_worker_env_is_torchrun_style():
    base = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "a", "MASTER_PORT": "1", "TRAININGRUN_METRICS_PORT": "100"}
    envs = [worker_env(base, node_rank=2, num_nodes=3, nproc=4, local_rank=i) for i in range(4)]
    assert [e["RANK"] for e in envs] == ["8", "9", "10", "11"] and {e["WORLD_SIZE"] for e in envs} == {"12"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"] and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"4"}
    assert [e["TRAININGRUN_METRICS_PORT"] for e in envs] == ["100", "101", "102", "103"]
    assert all((e["TRAININGRUN_NODE_RANK"], e["TRAININGRUN_NUM_NODES"], e["MASTER_ADDR"]) == ("2", "3", "a")
               for e in envs)
    assert base["RANK"] == "2" and all(is_worker(e) for e in envs) and not is_worker(base)
    assert (exit_status(78), exit_status(0), exit_status(-9)) == (78, 0, 137)


def test_supervisor_starts_g_workers_with_global_ranks(tmp_path):
    proc = _start(tmp_path, "ok", gpus=3, node_rank=1)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    ws = _workers(tmp_path, 3)
    assert [w["RANK"] for w in ws] == ["3", "4", "5"] and {w["WORLD_SIZE"] for w in ws} == {"6"}
    assert [w["LOCAL_RANK"] for w in ws] == ["0", "1", "2"] and {w["LOCAL_WORLD_SIZE"] for w in ws} == {"3"}
    assert {(w["TRAININGRUN_NODE_RANK"], w["TRAININGRUN_NUM_NODES"]) for w in ws} == {("1", "2")}
    assert [w["TRAININGRUN_METRICS_PORT"] for w in ws] == ["9500", "9501", "9502"]
    assert {(w["MASTER_ADDR"], w["MASTER_PORT"]) for w in ws} == {("127.0.0.1", "29555")}
    assert all(w["argv"] == ["trainer", "--wait-timeout", "5.0"] for w in ws)
    assert not (tmp_path / "w3.json").exists()


def test_failing_worker_stops_the_others_and_78_stays_78(tmp_path):
    proc = _start(tmp_path, "fail78", gpus=3)
    try:
        ws = _workers(tmp_path, 3)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 78, out
    assert "worker 1 (rank 4) failed with exit 78" in out
    assert {p.name for p in tmp_path.glob("term-*")} == {"term-0", "term-2"}, "the others were not SIGTERMed"
    assert not [w["pid"] for w in ws if pid_alive(w["pid"])], "workers left behind"


def test_worker_killed_by_signal_gives_128_plus_n(tmp_path):
    proc = _start(tmp_path, "kill9", gpus=2)
    ws = _workers(tmp_path, 2)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGKILL, out
    assert not [w["pid"] for w in ws if pid_alive(w["pid"])]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_is_forwarded_to_every_worker(tmp_path, sig):
    proc = _start(tmp_path, "trap", gpus=2)
    try:
        ws = _workers(tmp_path, 2)
        time.sleep(0.2)
        proc.send_signal(sig)  # the supervisor only, as a kubelet does
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, out
    # each worker's SIGTERM handler ran (SIGINT is forwarded as SIGINT: the stub does not trap it, it dies of it)
    if sig == signal.SIGTERM:
        assert [(tmp_path / f"term-{i}").read_text() for i in range(2)] == [str(int(sig))] * 2
    assert not [w["pid"] for w in ws if pid_alive(w["pid"])]


def test_bad_spec_fails_in_the_supervisor_with_78(tmp_path):
    (tmp_path / "run.yaml").write_text("apiVersion: trainingrun.dev/v1alpha1\nkind: TrainingRun\nmetadata: {name: x}\n"
                                       "spec: {trainer: {replicas: 0}}\n")
    env = {**os.environ, "TRAININGRUN_CONFIG": str(tmp_path / "run.yaml"), "TRAININGRUN_STORE_URL": "file:///nonexistent"}
    env.pop("LOCAL_RANK", None)
    res = subprocess.run([sys.executable, "-m", "trainingrun", "trainer"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 78, res.stderr
    assert "replicas" in res.stderr
