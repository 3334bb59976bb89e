"""The operator's children for a run with the vLLM engine and no engine.url: the engine's ConfigMap (worker
extension), Pod (official vLLM image, restartPolicy Always, the run's volumes) and Service, created with the run's
other base children; the rollout pod is given the engine's URL; a vllm run without model.hf is refused."""

from __future__ import annotations

import datetime as dt

import pytest

from trainingrun.api import parse_trainingrun
from trainingrun.api.constants import LABEL_ROLE
from trainingrun.operator import checks, render, status, vocabulary
from trainingrun.operator.observe import Observed, PodObs
from trainingrun.vllm import k8s
from trainingrun.vllm.engine import ENGINE_URL_ENV

T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
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
    assert pod["spec"]["restartPolicy"] == "Always" and "schedulerName" not in pod["spec"]
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


def test_missing_engine_children_are_created_and_a_running_engine_pod_is_not_recreated():
    run = run_of({"type": "vllm"})
    st = {"phase": "Pending", "attempt": 0, "restarts": 0}
    d = status.decide(run, dict(st), Observed(pods=(), children=frozenset()), now=T0)
    created = {c.key for c in d.create}
    assert {"ConfigMap/rl-engine", "Service/rl-engine", "Pod/rl-engine"} <= created
    engine_pod = PodObs(name="rl-engine", role="engine", rank=None, attempt=None, phase="Running")
    children = frozenset(c.key for c in vocabulary.base_children(run, 0) if c.kind != "Pod")
    d = status.decide(run, dict(st), Observed(pods=(engine_pod,), children=children), now=T0)
    assert "Pod/rl-engine" not in {c.key for c in d.create}


def test_a_crash_looping_engine_uses_the_failure_budget_and_fails_the_run_naming_it():
    # Before: the engine pod (restartPolicy Always) was restarted by the kubelet for ever, outside the failure
    # policy; a vLLM server that cannot start (wrong model path, too little memory) left the run Running for ever.
    import copy

    from trainingrun.operator.observe import observe_pod

    doc = run_of({"type": "vllm"}).model_dump(by_alias=True, exclude_none=True)
    doc["spec"]["failurePolicy"] = {"maxRestarts": 2}
    run = parse_trainingrun(doc)
    children = frozenset(c.key for c in vocabulary.base_children(run, 0) if c.kind != "Pod")
    st = {"phase": "Running", "attempt": 0, "restarts": 0}
    pod = {"metadata": {"name": "rl-engine", "labels": {LABEL_ROLE: "engine"}},
           "status": {"phase": "Running", "containerStatuses": [{
               "name": "vllm", "restartCount": 2,
               "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting"}},
               "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "finishedAt": "2025-01-01T00:00:00Z"}}}]}}
    group = [PodObs(name=vocabulary.Names("rl").pod(role, rank, 0), role=role, rank=rank, attempt=0, phase="Running")
             for role, rank in status.expected_group(run)]

    def decide(engine_pod):
        return status.decide(run, dict(st), Observed(pods=(observe_pod(engine_pod), *group), children=children),
                             now=T0)

    assert observe_pod(pod).restarts == 2
    d = decide(pod)  # within the budget: the rollout waits for the server, the run goes on
    assert d.status["phase"] == "Running"
    again = copy.deepcopy(pod)
    again["status"]["containerStatuses"][0]["restartCount"] = 3
    d = decide(again)
    assert d.status["phase"] == "Failed"
    message = d.status["message"]
    assert "rl-engine" in message and "restarted 3 times" in message and "maxRestarts=2" in message, message
    assert "exited with code 1" in message, message
    assert any(r == "BackoffLimitExceeded" for _, r, _ in d.events)
