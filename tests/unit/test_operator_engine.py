"""The operator's children for a run with the vLLM engine and no engine.url: the engine's ConfigMap (worker
extension), Pod (official vLLM image, restartPolicy Never: the operator replaces a failed engine, its budget in the
run's status, the run's volumes) and Service, created with the run's other base children; the rollout pod is given the engine's URL; a vllm run without model.hf is refused. (What the
lifecycle does with the engine's children and restarts: tests/unit/test_operator_status.py.)"""

from __future__ import annotations

import pytest

from trainingrun.api import parse_trainingrun
from trainingrun.api.constants import LABEL_ROLE
from trainingrun.operator import checks, render, vocabulary
from trainingrun.engines.vllm import k8s
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
    engine = [c for c in children if c["metadata"]["name"] in ("rl-engine", "rl-engine-0")]
    assert [c["kind"] for c in engine] == ["ConfigMap", "Service", "Pod"]
    cm, svc, pod = engine
    assert cm["data"] == k8s.extension_config_map_data()
    assert svc["spec"]["ports"][0]["port"] == k8s.ENGINE_PORT
    assert svc["spec"]["selector"][LABEL_ROLE] == "engine" == pod["metadata"]["labels"][LABEL_ROLE]
    assert pod["spec"]["restartPolicy"] == "Never" and "schedulerName" not in pod["spec"]
    assert svc["spec"]["clusterIP"] == "None" and pod["spec"]["subdomain"] == "rl-engine"
    c = pod["spec"]["containers"][0]
    assert c["image"].startswith("vllm/vllm-openai:") and c["args"][c["args"].index("--model") + 1] == "/models/smol"
    assert c["resources"] == {"requests": {"cpu": "4", "nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}
    assert MOUNTS[0] in c["volumeMounts"] and VOLUMES[0] in pod["spec"]["volumes"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    url = f"http://{pod['spec']['hostname']}.rl-engine.ns1.svc:{k8s.ENGINE_PORT}"
    rollout = next(c for c in children if c["metadata"]["name"] == "rl-rollout-a0")
    assert {"name": ENGINE_URL_ENV, "value": url} in rollout["spec"]["containers"][0]["env"]


@pytest.mark.parametrize("gang_provider", [None, "volcano"])
def test_a_pool_of_engine_pods_is_in_the_runs_kueue_queue_and_a_serving_gang_of_its_own(gang_provider):
    """rollout.engine.replicas 3: three engine pods, each with a stable name under one headless Service, in the run's
    Kueue queue as the pod group rl-engine (3 pods) and, with gang scheduling, in the serving PodGroup rl-engine
    (minMember 3, their GPUs) — not in an attempt's group: they outlive attempts. The rollout gets the 3 URLs."""
    doc = run_doc({"type": "vllm", "replicas": 3, "vllm": {"gpus": 2, "resources": {"requests": {"cpu": "4"}}}})
    doc["spec"]["queueName"] = "team-a"
    if gang_provider:
        doc["spec"]["gangScheduling"] = {"enabled": True, "provider": gang_provider}
    run = parse_trainingrun(doc)
    assert checks.cluster_errors(run) == []
    children = render.render_children(run, OWNER, attempt=4)
    pods = [c for c in children if c["kind"] == "Pod" and c["metadata"]["labels"][LABEL_ROLE] == "engine"]
    assert [p["metadata"]["name"] for p in pods] == ["rl-engine-0", "rl-engine-1", "rl-engine-2"]
    assert [p["spec"]["hostname"] for p in pods] == ["engine-0", "engine-1", "engine-2"]
    services = [c for c in children if c["kind"] == "Service" and c["metadata"]["name"] == "rl-engine"]
    assert len(services) == 1 and services[0]["spec"]["clusterIP"] == "None"
    for p in pods:
        labels, annotations = p["metadata"]["labels"], p["metadata"]["annotations"]
        assert labels["kueue.x-k8s.io/queue-name"] == "team-a" and labels["kueue.x-k8s.io/pod-group-name"] == "rl-engine"
        assert annotations["kueue.x-k8s.io/pod-group-total-count"] == "3"
        assert p["spec"]["subdomain"] == "rl-engine"
        if gang_provider:
            assert annotations["scheduling.k8s.io/group-name"] == "rl-engine" and p["spec"]["schedulerName"] == "volcano"
    groups = [c for c in children if c["kind"] == "PodGroup"]
    if gang_provider:
        serving = next(g for g in groups if g["metadata"]["name"] == "rl-engine")
        assert serving["spec"]["minMember"] == 3 and serving["spec"]["minResources"] == {"cpu": "12",
                                                                                        "nvidia.com/gpu": "6"}
        attempt = next(g for g in groups if g["metadata"]["name"] == "rl-a4")
        assert attempt["spec"]["minMember"] == 3  # rollout + 2 trainers: the engines are not in it
    else:
        assert groups == []
    rollout = next(c for c in children if c["metadata"]["name"] == "rl-rollout-a4")
    env = {e["name"]: e["value"] for e in rollout["spec"]["containers"][0]["env"]}
    assert env[ENGINE_URL_ENV].split(",") == [f"http://engine-{i}.rl-engine.ns1.svc:{k8s.ENGINE_PORT}" for i in range(3)]
    # a child is rendered by itself as in the list (the operator re-creates a deleted engine pod alone)
    one = vocabulary.Child("Pod", "rl-engine-2", role="engine", rank=2)
    assert render.render_child(run, OWNER, one, attempt=5) == pods[2]


def test_engine_pool_serving_group_with_gang_provider_kubernetes():
    """Provider kubernetes: the engines' serving group is a Workload + PodGroup R-engine (gang minCount = replicas)
    beside the attempt's R-a<k> (minCount = rollout + trainers); engine pods name their PodGroup in
    spec.schedulingGroup; a replacement of replica 2 in generation 1 is R-engine-2-r1 with the same hostname."""
    doc = run_doc({"type": "vllm", "replicas": 3, "vllm": {"gpus": 2}})
    doc["spec"]["gangScheduling"] = {"enabled": True, "provider": "kubernetes"}
    run = parse_trainingrun(doc)
    children = render.render_children(run, OWNER, attempt=1)
    by = {(c["kind"], c["metadata"]["name"]): c for c in children}
    for kind in ("Workload", "PodGroup"):
        assert (kind, "rl-engine") in by and (kind, "rl-a1") in by
    workload, group = by[("Workload", "rl-engine")], by[("PodGroup", "rl-engine")]
    assert workload["spec"]["podGroupTemplates"][0]["schedulingPolicy"]["gang"]["minCount"] == 3
    assert group["spec"]["workloadRef"]["workloadName"] == "rl-engine"
    assert by[("Workload", "rl-a1")]["spec"]["podGroupTemplates"][0]["schedulingPolicy"]["gang"]["minCount"] == 3
    pods = [c for c in children if c["kind"] == "Pod" and c["metadata"]["labels"][LABEL_ROLE] == "engine"]
    assert all(p["spec"]["schedulingGroup"] == {"podGroupName": "rl-engine"} for p in pods)
    names = {c.key for c in vocabulary.base_children(run, 1)}
    assert {"Workload/rl-engine", "PodGroup/rl-engine", "Workload/rl-a1", "PodGroup/rl-a1"} <= names
    again = render.render_child(run, OWNER, vocabulary.engine_child(run, 2, 1), attempt=1)
    assert again["metadata"]["name"] == "rl-engine-2-r1" and again["spec"]["hostname"] == "engine-2"
    assert again["metadata"]["labels"]["trainingrun.dev/role-attempt"] == "1"


def test_engine_replicas_are_for_the_runs_own_servers():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="engine.replicas counts the run's own vLLM servers"):
        run_of({"type": "vllm", "url": "http://a:8000,http://b:8000", "replicas": 2})
    run = run_of({"type": "vllm", "url": "http://a:8000,http://b:8000"})
    assert run.spec.rollout.engine.urls == ["http://a:8000", "http://b:8000"]
    assert not vocabulary.engine_is_managed(run)


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


def test_engine_pods_claim_their_devices_by_dra():
    """Issue 32: rollout.engine.vllm.resourceClaims on every engine pod and its container; the GPUs come from the
    claims (no nvidia.com/gpu, none in the engines' pod group); vLLM's tensor-parallel size is still vllm.gpus."""
    import kubernetes_validate

    from trainingrun.operator import gang

    claims = [{"name": "gpus", "resourceClaimTemplateName": "h200x2"}]
    doc = run_doc({"type": "vllm", "replicas": 2,
                   "vllm": {"gpus": 2, "resourceClaims": claims, "resources": {"requests": {"cpu": "4"}}}})
    doc["spec"]["gangScheduling"] = {"enabled": True, "provider": "volcano"}
    run = parse_trainingrun(doc)
    assert checks.cluster_errors(run) == []
    pods = [c for c in render.render_children(run, OWNER, attempt=0)
            if c["kind"] == "Pod" and c["metadata"]["labels"][LABEL_ROLE] == "engine"]
    assert len(pods) == 2
    for pod in pods:
        c = pod["spec"]["containers"][0]
        assert pod["spec"]["resourceClaims"] == claims
        assert c["resources"] == {"requests": {"cpu": "4"}, "claims": [{"name": "gpus"}]}
        assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "2"
        kubernetes_validate.validate(pod, "1.37.0", strict=True)
    assert "nvidia.com/gpu" not in gang.engine_min_resources(run)
