"""The engine pod's container and worker-extension ConfigMap (trainingrun/engines/vllm/k8s.py): the same server
command line as local runs, GPUs from the spec, readiness from /health, and an extension directory that imports in
the official image (the ConfigMap's items recreate exactly `server.extension_files()`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from trainingrun.api import parse_trainingrun
from trainingrun.engines.vllm import k8s
from trainingrun.engines.vllm.server import EXTENSION_CLS, LOGPROBS_MODE, extension_files


def run_spec(**vllm):
    return parse_trainingrun({
        "apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "r"},
        "spec": {"model": {"hf": "/models/smol", "seqLength": 512},
                 "trainer": {"replicas": 1, "maxTokensPerGPU": 256},
                 "rollout": {"source": {"type": "generate", "generate": {}},
                             "engine": {"type": "vllm", "vllm": vllm}},
                 "weightSync": {"type": "broadcast"}}}).spec


def test_gpu_engine_container():
    c = k8s.engine_container(run_spec(gpus=2, dtype="bfloat16", args=["--seed", "3"]), volume_mounts=[
        {"name": "models", "mountPath": "/models"}], resources={"limits": {"nvidia.com/gpu": 2}})
    assert c["image"] == "vllm/vllm-openai:v0.32.0" and c["command"] == ["python3"]
    a = c["args"]
    assert a[a.index("--model") + 1] == "/models/smol" and a[a.index("--host") + 1] == "0.0.0.0"
    assert a[a.index("--port") + 1] == str(k8s.ENGINE_PORT) and a[a.index("--max-model-len") + 1] == "512"
    assert a[a.index("--tensor-parallel-size") + 1] == "2" and "--enforce-eager" not in a  # CUDA graphs on GPUs
    assert a[a.index("--worker-extension-cls") + 1] == EXTENSION_CLS
    assert a[a.index("--logprobs-mode") + 1] == LOGPROBS_MODE and a[-2:] == ["--seed", "3"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["PYTHONPATH"] == k8s.EXTENSION_DIR and "OMP_NUM_THREADS" not in env
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": k8s.ENGINE_PORT}
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert {"name": k8s.EXTENSION_VOLUME, "mountPath": k8s.EXTENSION_DIR, "readOnly": True} in c["volumeMounts"]
    assert {"name": "models", "mountPath": "/models"} in c["volumeMounts"]
    assert c["resources"] == {"limits": {"nvidia.com/gpu": 2}}


def test_cpu_engine_container_runs_eager_with_one_thread_and_the_models_own_length():
    spec = run_spec()
    spec.model.seq_length = None
    c = k8s.engine_container(spec, volume_mounts=[], resources={})
    assert "--enforce-eager" in c["args"] and "--max-model-len" not in c["args"]
    assert "--tensor-parallel-size" not in c["args"] and "resources" not in c
    assert {"name": "OMP_NUM_THREADS", "value": "1"} in c["env"]


def test_extension_config_map_recreates_the_extension_directory_and_it_imports(tmp_path: Path):
    data = k8s.extension_config_map_data()
    assert all("/" not in key for key in data)
    volume = k8s.extension_volume("r-engine")
    assert volume["configMap"]["name"] == "r-engine"
    for item in volume["configMap"]["items"]:  # what the kubelet writes
        path = tmp_path / item["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(data[item["key"]])
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.py")) == sorted(extension_files())
    module, _, cls = EXTENSION_CLS.rpartition(".")
    out = subprocess.run([sys.executable, "-c", f"import {module} as m; print(m.{cls}.__name__)"], cwd=tmp_path,
                         capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0 and out.stdout.strip() == cls, out.stderr


def test_engine_url():
    """One URL per replica: its stable name under the engines' headless Service."""
    assert k8s.engine_url("r-engine", "ns") == f"http://engine-0.r-engine.ns.svc:{k8s.ENGINE_PORT}"
    assert k8s.engine_url("r-engine", "ns", 2).split(",") == [f"http://engine-{i}.r-engine.ns.svc:{k8s.ENGINE_PORT}"
                                                               for i in range(2)]
