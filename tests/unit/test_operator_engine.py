"""The operator's children for a run with the vLLM engine and no engine.url: the engine's ConfigMap (worker
extension), Pod (official vLLM image, restartPolicy Never: the operator replaces a failed engine, its budget in the
run's status, the run's volumes) and Service, created with the run's other base children; the rollout pod is given the engine's URL; a vllm run without model.hf is refused. (What the
lifecycle does with the engine's children and restarts: tests/unit/test_operator_status.py.)"""

from __future__ import annotations

import pytest

from trainingrun.api import parse_trainingrun
from trainingrun.api.constants import LABEL_ROLE
from trainingrun.operator import checks, render, vocabulary
from trainingrun.vllm import k8s
from trainingrun.contract.env import ENGINE_URL_ENV

OWNER = vocabulary.Owner(name="rl", namespace="ns1", uid="u-1")
VOLUMES = [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}]
MOUNTS = [{"name": "models", "mountPath": "/models"}]


def run_doc(engine: dict, hf: str | None = "/models/smol") -> dict:
    model = {"hf": hf, "seqLength": 512} if hf else {"preset": "tiny"}
    sync = "disk" if engine.get("type") == "vllm" else "store"
    return {
        "apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "rl"},
        "spec": {"model": model, "trainer": {"replicas": 2, "maxTokensPerGPU": 256},
                 "rollout": {"source": {"type": "generate", "generate": {}}, "engine": engine},
                 "weightSync": {"type": sync, "path": "/models/weights"},
                 "store": {"managed": True},
                 "podTemplate": {"volumes": VOLUMES, "volumeMounts": MOUNTS}}}


def run_of(engine: dict, hf: str | None = "/models/smol"):
    return parse_trainingrun(run_doc(engine, hf))


def test_engine_children_and_the_rollouts_url():
    run = run_of({"type": "vllm", "vllm": {"gpus": 1, "resources": {"requests": {"cpu": "4"}}}})
    assert checks.cluster_errors(run) == []
    children = render.render_children(run, OWNER, attempt=0)
    engine = [c for c in children if c["metadata"]["name"] == "rl-engine"]
    assert [c["kind"] for c in engine] == ["ConfigMap", "Service", "Pod"]
    cm, svc, pod = engine
    assert cm["data"] == k8s.extension_config_map_data()
    assert svc["spec"]["ports"][0]["port"] == k8s.ENGINE_PORT
    assert svc["spec"]["selector"][LABEL_ROLE] == "engine" == pod["metadata"]["labels"][LABEL_ROLE]
    assert pod["spec"]["restartPolicy"] == "Never" and "schedulerName" not in pod["spec"]
    c = pod["spec"]["containers"][0]
    assert c["image"].startswith("vllm/vllm-openai:") and c["args"][c["args"].index("--model") + 1] == "/models/smol"
    assert c["resources"] == {"requests": {"cpu": "4", "nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}
    assert MOUNTS[0] in c["volumeMounts"] and VOLUMES[0] in pod["spec"]["volumes"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    url = k8s.engine_url("rl-engine", "ns1")
    rollout = next(c for c in children if c["metadata"]["name"] == "rl-rollout-a0")
    assert {"name": ENGINE_URL_ENV, "value": url} in rollout["spec"]["containers"][0]["env"]


def test_a_user_engine_or_the_megatron_engine_gets_no_engine_pod():
    for engine in ({"type": "vllm", "url": "http://vllm.other:8000"}, {"type": "megatron"}):
        run = run_of(engine)
        names = {c.name for c in vocabulary.base_children(run, 0)}
        assert "rl-engine" not in names
        rollout = next(c for c in render.render_children(run, OWNER, 0) if c["metadata"]["name"] == "rl-rollout-a0")
        assert all(e["name"] != ENGINE_URL_ENV for e in rollout["spec"]["containers"][0]["env"])


def test_vllm_without_hf_weights_is_refused_naming_the_field():
    """A rule of the spec, so the API server refuses such a run at admission (and the operator's loader would too)."""
    from trainingrun.api import ManifestError
    from trainingrun.api.manifest import load_document
    from trainingrun.api.yamlcodec import dump_yaml, parse_yaml

    with pytest.raises(ManifestError) as err:
        load_document(parse_yaml(dump_yaml(run_doc({"type": "vllm"}, hf=None)), "rl.yaml")[0])
    assert any(": spec.model.hf: rollout.engine.type vllm loads Hugging Face weights" in line
               for line in err.value.lines), err.value.lines
