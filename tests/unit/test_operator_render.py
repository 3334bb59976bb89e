"""Pure rendering of the operator's children, the cluster checks and the vocabulary (no API server); the lifecycle
decisions are tests/unit/test_operator_status.py."""

from __future__ import annotations

import copy

import yaml

from tests.kube import ROOT
from trainingrun.api import parse_trainingrun
from trainingrun.api.constants import LABEL_ATTEMPT, LABEL_RANK, LABEL_ROLE
from trainingrun.operator import checks, render, vocabulary

TINY = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
OWNER = vocabulary.Owner(name="tiny", namespace="ns1", uid="u-1")


def run_of(**spec):
    doc = copy.deepcopy(TINY)
    doc["spec"].update(spec)
    return parse_trainingrun(doc)


def test_children_gang_and_store():
    run = run_of(gangScheduling={"enabled": True, "provider": "volcano", "queue": "research"},
                 trainer={**TINY["spec"]["trainer"], "replicas": 3,
                          "resources": {"requests": {"cpu": "2", "memory": "4Gi"}}},
                 rollout={**TINY["spec"]["rollout"], "resources": {"requests": {"cpu": "500m"}}},
                 podTemplate={"priorityClassName": "training"})
    children = render.render_children(run, OWNER, attempt=2)
    kinds = [c["kind"] for c in children]
    assert kinds == ["ConfigMap", "Service", "Service", "Pod", "PodGroup", "Pod", "Pod", "Pod", "Pod"]
    pg = children[4]
    assert pg["metadata"]["name"] == "tiny-a2" and pg["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    # minResources: 3 trainers x (2 cpu, 4Gi) + the rollout's 500m
    assert pg["spec"] == {"minMember": 4, "minResources": {"cpu": "6500m", "memory": str(3 * 4 * 2**30)},
                          "queue": "research", "priorityClassName": "training"}
    trainers = [c for c in children if c["kind"] == "Pod" and c["metadata"]["labels"].get(LABEL_ROLE) == "trainer"]
    assert [t["metadata"]["name"] for t in trainers] == [f"tiny-trainer-{r}-a2" for r in range(3)]
    for t in trainers:
        assert t["spec"]["schedulerName"] == "volcano"
        assert t["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "tiny-a2"
        assert t["metadata"]["labels"][LABEL_ATTEMPT] == "2"
        assert "nvidia.com/gpu" not in t["spec"]["containers"][0].get("resources", {}).get("limits", {})
    assert all(c["metadata"]["ownerReferences"][0]["uid"] == "u-1" for c in children)
    # an external store: no managed Redis
    ext = run_of(store={"url": "redis://r:6379/0"})
    assert render.render_store(ext, OWNER) == []
    assert vocabulary.store_url(ext, "ns1") == "redis://r:6379/0?prefix=trainingrun.ns1.tiny"


def test_gang_providers_are_pluggable_renderers():
    from trainingrun.operator import gang

    cosched = run_of(gangScheduling={"enabled": True, "provider": "coscheduling"}, schedulerName="scheduler-plugins",
                     trainer={**TINY["spec"]["trainer"], "gpusPerReplica": 2})
    pg = render.render_podgroup(cosched, OWNER, 0)
    assert pg["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert pg["spec"] == {"minMember": 3, "minResources": {"nvidia.com/gpu": "4"}}  # 2 trainers x 2 GPUs
    pod = render.render_pods(cosched, OWNER, 0)[1]
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "tiny-a0"
    assert pod["spec"]["schedulerName"] == "scheduler-plugins"
    assert set(gang.PROVIDERS) == {"volcano", "coscheduling"}
    assert render.render_podgroup(run_of(), OWNER, 0) is None


def test_kueue_pod_group_labels_per_attempt_and_real_pod_schema():
    import kubernetes_validate

    run = run_of(queueName="team-a")
    for attempt in (0, 3):
        pods = render.render_pods(run, OWNER, attempt)
        for pod in pods:
            labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
            assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
            assert labels["kueue.x-k8s.io/pod-group-name"] == f"tiny-a{attempt}"
            assert annotations["kueue.x-k8s.io/pod-group-total-count"] == str(len(pods))
    # every child the operator creates is valid for the real Kubernetes schemas (strict: no unknown fields)
    for child in render.render_children(run_of(queueName="team-a", store={"managed": True}), OWNER, 1):
        for version in ("1.29.0", "1.33.0"):
            kubernetes_validate.validate(child, version, strict=True)
    assert "kueue.x-k8s.io/queue-name" not in render.render_pods(run_of(), OWNER, 0)[0]["metadata"]["labels"]


def test_every_pod_knows_its_attempt_and_trainer_hostnames_are_per_attempt():
    run = run_of()
    for attempt in (0, 2):
        for pod in render.render_pods(run, OWNER, attempt):
            env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
            assert env["TRAININGRUN_ATTEMPT"] == pod["metadata"]["labels"][LABEL_ATTEMPT] == str(attempt)
            if "RANK" in env:
                assert env["MASTER_ADDR"] == f"trainer-0-a{attempt}.tiny-trainers.ns1.svc"
            if pod["metadata"]["labels"][LABEL_ROLE] == "trainer":
                assert pod["spec"]["hostname"] == f"trainer-{pod['metadata']['labels'][LABEL_RANK]}-a{attempt}"
    # the ConfigMap carries a hash of its content: a resize changes it
    cm = render.render_config_map(run, OWNER)
    bigger = run_of(trainer={**TINY["spec"]["trainer"], "replicas": 4})
    assert cm["metadata"]["annotations"]["trainingrun.dev/spec-hash"] == vocabulary.config_hash(run)
    assert vocabulary.config_hash(bigger) != vocabulary.config_hash(run)


def test_cluster_errors_name_the_field():
    assert checks.cluster_errors(run_of()) == []
    errs = checks.cluster_errors(run_of(store={"url": "file:///tmp/s"}))
    assert len(errs) == 1 and errs[0].startswith("spec.store.url")
    doc = copy.deepcopy(TINY)
    doc["metadata"]["name"] = "9" + "a" * 50
    errs = checks.cluster_errors(parse_trainingrun(doc))
    assert errs and all(e.startswith("metadata.name") for e in errs)
    # the operator's own config volume and mount cannot be taken by podTemplate (the API server would refuse the pods)
    clash = run_of(podTemplate={"volumes": [{"name": "config", "emptyDir": {}}, {"name": "ok", "emptyDir": {}}],
                                "volumeMounts": [{"name": "ok", "mountPath": "/etc/trainingrun/"}]})
    errs = checks.cluster_errors(clash)
    assert [e.split(":")[0] for e in errs] == ["spec.podTemplate.volumes[0].name",
                                               "spec.podTemplate.volumeMounts[0].mountPath"], errs
    pod = render.render_pods(run_of(podTemplate={"volumes": [{"name": "ok", "emptyDir": {}}]}), OWNER, 0)[0]
    names = [v["name"] for v in pod["spec"]["volumes"]]
    assert vocabulary.CONFIG_VOLUME in names and len(set(names)) == len(names)


def test_pod_template_volumes_reach_every_container():
    run = run_of(podTemplate={
        "volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": "tiny-shared"}}],
        "volumeMounts": [{"name": "shared", "mountPath": "/checkpoints"}],
    })
    pods = render.render_pods(run, OWNER, attempt=0)
    assert len(pods) == 1 + run.spec.trainer.replicas
    for pod in pods:
        assert {"name": "shared", "persistentVolumeClaim": {"claimName": "tiny-shared"}} in pod["spec"]["volumes"]
        mounts = pod["spec"]["containers"][0]["volumeMounts"]
        assert {"name": "shared", "mountPath": "/checkpoints"} in mounts
        assert any(m["name"] == "config" for m in mounts)  # the run's own config mount stays


def test_every_worker_of_a_multi_gpu_pod_declares_its_metrics_port():
    run = run_of(trainer={**TINY["spec"]["trainer"], "replicas": 2, "gpusPerReplica": 4})
    trainers = [p for p in render.render_pods(run, OWNER, attempt=0) if p["metadata"]["labels"][LABEL_ROLE] == "trainer"]
    base = run.spec.metrics.port
    for pod in trainers:
        container = pod["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"] if p["name"].startswith("metrics")}
        assert ports == {"metrics": base, "metrics-1": base + 1, "metrics-2": base + 2, "metrics-3": base + 3}
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 4


def test_managed_store_has_memory_guaranteed_resources_and_spec_overrides():
    default = run_of(store={"managed": True})
    pod = render.render_store(default, OWNER)[0]
    res = pod["spec"]["containers"][0]["resources"]
    assert res["requests"]["memory"] == res["limits"]["memory"]  # not the first pod evicted under memory pressure
    sized = run_of(store={"managed": True, "resources": {"requests": {"memory": "8Gi"}, "limits": {"memory": "8Gi"}}})
    assert render.render_store(sized, OWNER)[0]["spec"]["containers"][0]["resources"] == {
        "requests": {"memory": "8Gi"}, "limits": {"memory": "8Gi"}}


def test_multi_worker_trainer_pods_get_a_memory_backed_dev_shm():
    multi = run_of(trainer={**TINY["spec"]["trainer"], "replicas": 2, "gpusPerReplica": 4})
    for pod in render.render_pods(multi, OWNER, attempt=0):
        mounts = {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        trainer = pod["metadata"]["labels"][LABEL_ROLE] == "trainer"
        assert ("/dev/shm" in mounts) == trainer
        if trainer:
            assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["spec"]["volumes"]
    single = run_of()
    assert all("/dev/shm" not in {m["mountPath"] for m in p["spec"]["containers"][0]["volumeMounts"]}
               for p in render.render_pods(single, OWNER, attempt=0))
    clash = run_of(podTemplate={"volumes": [{"name": "dshm", "emptyDir": {}}]})
    assert any("podTemplate.volumes[0].name" in e and "'dshm'" in e for e in checks.cluster_errors(clash))


def test_runs_sharing_an_external_redis_get_their_own_keys():
    from trainingrun.store import open_store

    a = vocabulary.store_url(run_of(store={"url": "redis://redis.infra:6379/2"}), "ns1")
    assert a == "redis://redis.infra:6379/2?prefix=trainingrun.ns1.tiny"
    assert open_store(a).prefix == "trainingrun.ns1.tiny"  # the store accepts the key it is given
    assert vocabulary.store_url(run_of(store={"url": "redis://r:6379/0?prefix=mine"}), "ns1").endswith("?prefix=mine")


def test_a_re_created_run_gets_a_later_epoch_and_fresh_external_store_keys():
    # The operator passes the run's uid and creationTimestamp (handlers.parse_run). Before, a TrainingRun deleted and
    # re-created with the same name shared the old run's external store keys and checkpoint fence at attempt 0, and
    # every trainer was refused (exit 78) by the old run's newer attempts.
    def incarnation(uid, created, **spec):
        doc = copy.deepcopy(TINY)
        doc["spec"].update(spec)
        doc["metadata"].update(uid=uid, creationTimestamp=created)
        return parse_trainingrun(doc)

    first = incarnation("0f1e2d3c-aaaa-bbbb", "2026-11-30T10:00:00Z", store={"url": "redis://r:6379/0"})
    again = incarnation("9a8b7c6d-cccc-dddd", "2026-11-30T10:05:00Z", store={"url": "redis://r:6379/0"})
    assert vocabulary.store_url(first, "ns1") == "redis://r:6379/0?prefix=trainingrun.ns1.tiny.0f1e2d3c"
    assert vocabulary.store_url(again, "ns1") == "redis://r:6379/0?prefix=trainingrun.ns1.tiny.9a8b7c6d"

    def epochs(run):
        return {e["value"] for p in render.render_pods(run, OWNER, attempt=0) for c in p["spec"]["containers"]
                for e in c.get("env", []) if e["name"] == "TRAININGRUN_RUN_EPOCH"}

    assert epochs(first) == {"1796032800"} and epochs(again) == {"1796033100"}
    assert epochs(run_of()) == set()  # unknown creation time: epoch 0, the variable is left out
    assert vocabulary.run_epoch(incarnation("u", "not a time")) == 0
    # what the operator parses from a TrainingRun object keeps both
    from trainingrun.operator.handlers import parse_run

    body = copy.deepcopy(TINY)
    body["metadata"].update(namespace="ns1", uid="9a8b7c6d-cccc-dddd", creationTimestamp="2026-11-30T10:05:00Z")
    assert vocabulary.run_epoch(parse_run(body)) == 1796033100


def test_wandb_api_key_reaches_the_trainers_from_a_secret_only():
    metrics = {"port": 9400, "wandb": {"project": "p", "apiKeySecret": {"name": "wandb"}}}
    pods = render.render_pods(run_of(metrics=metrics), OWNER, attempt=0)
    for pod in pods:
        env = pod["spec"]["containers"][0]["env"]
        keys = [e for e in env if e["name"] == "WANDB_API_KEY"]
        if pod["metadata"]["labels"][LABEL_ROLE] == "trainer":
            assert keys == [{"name": "WANDB_API_KEY",
                             "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}}]
        else:
            assert keys == []
    plain = render.render_pods(run_of(metrics={"port": 9400, "wandb": {"project": "p", "mode": "offline"}}), OWNER,
                               attempt=0)
    assert not any(e["name"] == "WANDB_API_KEY" for p in plain for e in p["spec"]["containers"][0]["env"])


def test_reward_service_headers_reach_the_rollout_from_secrets_only():
    """reward.remote / reward.judge headers (the run's reward and the evaluation's): each a secretKeyRef env on the
    rollout container, named by api.spec.rollout.header_env; no value anywhere in a pod, nothing on the trainers."""
    rollout = {**TINY["spec"]["rollout"], "source": {"type": "generate", "generate": {
        "reward": {"type": "remote", "remote": {"url": "http://rm:8000/score", "headers": {
            "Authorization": {"name": "rm", "key": "token"}, "X-Team": {"name": "rm", "key": "team"}}}}}},
        "eval": {"intervalRollouts": 4, "prompts": {}, "reward": {"type": "judge", "judge": {
            "url": "http://judge:8000/v1", "model": "m", "headers": {"Authorization": {"name": "judge"}}}}}}
    pods = render.render_pods(run_of(rollout=rollout), OWNER, attempt=0)
    for pod in pods:
        env = pod["spec"]["containers"][0]["env"]
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "valueFrom" in e}
        if pod["metadata"]["labels"][LABEL_ROLE] == "rollout":
            assert refs == {"TRAININGRUN_REWARD_HEADER_AUTHORIZATION": {"name": "rm", "key": "token"},
                            "TRAININGRUN_REWARD_HEADER_X_TEAM": {"name": "rm", "key": "team"},
                            "TRAININGRUN_EVAL_HEADER_AUTHORIZATION": {"name": "judge", "key": "api-key"}}
        else:
            assert refs == {}


def test_each_child_is_rendered_by_its_own_renderer_as_exactly_that_object():
    """`render_child` looks the child's (kind, role) up in RENDERERS: the object it returns is that child (kind, name,
    role label), for every child a run with every optional part (managed store, gang scheduling, the vLLM engine) has;
    a child nothing renders is refused naming it, not rendered as something else."""
    import pytest

    run = parse_trainingrun({
        "apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "tiny"},
        "spec": {"model": {"hf": "/models/smol", "seqLength": 512}, "trainer": {"replicas": 2, "maxTokensPerGPU": 256},
                 "rollout": {"source": {"type": "generate", "generate": {}}, "engine": {"type": "vllm"}},
                 "weightSync": {"type": "disk"}, "store": {"managed": True},
                 "gangScheduling": {"enabled": True}}})
    native = run.model_copy(update={"spec": run.spec.model_copy(update={
        "gang_scheduling": run.spec.gang_scheduling.model_copy(update={"provider": "kubernetes"})})})
    children = [(run, c) for c in vocabulary.base_children(run, 1)] + [
        (native, c) for c in vocabulary.base_children(native, 1) if c.kind == "Workload"] + [
        (run, vocabulary.engine_child(run, 0, 2))] + [
        (run, vocabulary.Child("Pod", vocabulary.Names("tiny").pod(role, rank, 1), role=role, rank=rank))
        for role, rank in (("rollout", None), ("trainer", 0), ("trainer", 1))]
    assert {(c.kind, c.role) for _, c in children} == set(render.RENDERERS)
    for run, child in children:
        obj = render.render_child(run, OWNER, child, 1)
        assert (obj["kind"], obj["metadata"]["name"]) == (child.kind, child.name)
        assert obj["metadata"]["labels"].get(LABEL_ROLE) == child.role
        if child.rank is not None:  # a trainer's rank; an engine's replica (and its generation)
            rank_label = "trainingrun.dev/replica" if child.role == "engine" else LABEL_RANK
            assert obj["metadata"]["labels"][rank_label] == str(child.rank)
        if child.kind == "Pod" and child.role in ("rollout", "engine"):
            assert obj["metadata"]["labels"]["trainingrun.dev/role-attempt"] == str(child.generation)
    with pytest.raises(ValueError, match="no renderer for Secret/tiny-x"):
        render.render_child(run, OWNER, vocabulary.Child("Secret", "tiny-x", role="trainer"), 1)


def test_kubernetes_gang_objects_and_pods_match_the_served_versions_schemas():
    """gangScheduling provider kubernetes: the Workload, PodGroup and pods the operator renders for each
    scheduling.k8s.io version it supports are valid for that Kubernetes release's own schemas (strict: no unknown
    field) — v1alpha2 (1.36) and v1beta1 (1.37) — with the gang's size, the run's priority class and whole-gang
    disruption in each version's shape."""
    import kubernetes_validate

    run = run_of(gangScheduling={"enabled": True, "provider": "kubernetes"},
                 podTemplate={"priorityClassName": "training"}, placement={"trainer": {"kueue": {
                     "sliceRequired": "nvidia.com/gpu.clique", "sliceSize": 2}}}, queueName="team-a")
    for version, release, disruption in (("v1alpha2", "1.36.0", "PodGroup"), ("v1beta1", "1.37.0", {"all": {}})):
        children = render.render_children(run, OWNER, 1, gang_version=version)
        by_kind = {c["kind"]: c for c in children if c["apiVersion"] == f"scheduling.k8s.io/{version}"}
        assert set(by_kind) == {"Workload", "PodGroup"}
        template = by_kind["Workload"]["spec"]["podGroupTemplates"][0]
        assert template["schedulingPolicy"] == {"gang": {"minCount": 3}} and template["priorityClassName"] == "training"
        assert template["disruptionMode"] == disruption
        pods = [c for c in children if c["kind"] == "Pod" and c["metadata"]["labels"].get(LABEL_ROLE) != "store"]
        assert len(pods) == 3 and all(p["spec"]["schedulingGroup"] == {"podGroupName": "tiny-a1"} for p in pods)
        trainers = [p for p in pods if p["metadata"]["labels"][LABEL_ROLE] == "trainer"]
        assert all(p["metadata"]["annotations"]["kueue.x-k8s.io/podset-slice-size"] == "2" for p in trainers)
        for child in children:
            kubernetes_validate.validate(child, release, strict=True)


def test_topology_placement_per_role_kueue_annotations_and_volcano_sub_groups():
    """spec.placement: Kueue TAS annotations on the role's pods (trainers indexed by rank, so a slice is consecutive
    ranks), none on the other role; Volcano's network topology as a sub-group of the attempt's PodGroup per role."""
    run = run_of(queueName="team-a", placement={
        "rollout": {"kueue": {"preferred": "cloud.provider.com/topology-rack"}},
        "trainer": {"kueue": {"required": "cloud.provider.com/topology-block", "sliceRequired": "nvidia.com/gpu.clique",
                              "sliceSize": 2}}})
    pods = {p["metadata"]["labels"][LABEL_ROLE] + p["metadata"]["labels"].get(LABEL_RANK, ""): p
            for p in render.render_pods(run, OWNER, 0)}
    assert pods["rollout"]["metadata"]["annotations"]["kueue.x-k8s.io/podset-preferred-topology"] == (
        "cloud.provider.com/topology-rack")
    assert "kueue.x-k8s.io/podset-required-topology" not in pods["rollout"]["metadata"]["annotations"]
    for rank in (0, 1):
        meta = pods[f"trainer{rank}"]["metadata"]
        assert meta["labels"]["kueue.x-k8s.io/pod-group-pod-index"] == str(rank)
        assert {k: v for k, v in meta["annotations"].items() if "podset" in k} == {
            "kueue.x-k8s.io/podset-required-topology": "cloud.provider.com/topology-block",
            "kueue.x-k8s.io/podset-slice-required-topology": "nvidia.com/gpu.clique",
            "kueue.x-k8s.io/podset-slice-size": "2"}
    volcano = run_of(gangScheduling={"enabled": True, "provider": "volcano"},
                     placement={"trainer": {"volcano": {"mode": "hard", "highestTierAllowed": 1, "subGroupSize": 1}}})
    pg = render.render_podgroup(volcano, OWNER, 0)
    assert pg["spec"]["subGroupPolicy"] == [{"name": "trainer", "networkTopology": {"mode": "hard",
                                                                                    "highestTierAllowed": 1},
                                             "subGroupSize": 1, "labelSelector": {"matchLabels": {LABEL_ROLE:
                                                                                                  "trainer"}}}]
    assert "subGroupPolicy" not in render.render_podgroup(run_of(gangScheduling={"enabled": True}), OWNER, 0)["spec"]


def test_dra_claims_reach_every_trainer_pod_and_its_container_and_no_device_plugin_gpus():
    """Issue 32: trainer.resourceClaims (core/v1 PodResourceClaim) on every trainer pod, claimed by its container;
    the GPUs come from the claims (no nvidia.com/gpu request, none in the pod group's minResources); the rollout pod
    claims nothing. Valid for the real Kubernetes 1.37 schemas."""
    import kubernetes_validate

    from trainingrun.operator import gang

    claims = [{"name": "gpus", "resourceClaimTemplateName": "h100x8"}, {"name": "nic", "resourceClaimName": "rdma"}]
    run = run_of(trainer={**TINY["spec"]["trainer"], "replicas": 3, "gpusPerReplica": 8, "resourceClaims": claims,
                          "resources": {"limits": {"memory": "64Gi"}}},
                 gangScheduling={"enabled": True, "provider": "volcano"})
    pods = render.render_pods(run, OWNER, 0)
    trainers = [p for p in pods if p["metadata"]["labels"][LABEL_ROLE] == "trainer"]
    assert len(trainers) == 3
    for pod in trainers:
        assert pod["spec"]["resourceClaims"] == claims
        resources = pod["spec"]["containers"][0]["resources"]
        assert resources["claims"] == [{"name": "gpus"}, {"name": "nic"}]
        assert resources["limits"] == {"memory": "64Gi"} and "requests" not in resources  # no nvidia.com/gpu
        kubernetes_validate.validate(pod, "1.37.0", strict=True)
    rollout = next(p for p in pods if p["metadata"]["labels"][LABEL_ROLE] == "rollout")
    assert "resourceClaims" not in rollout["spec"]
    assert "claims" not in rollout["spec"]["containers"][0].get("resources", {})
    assert "nvidia.com/gpu" not in gang.min_resources(run)
    # without claims: the device plugin's GPUs, as before
    plain = run_of(trainer={**TINY["spec"]["trainer"], "gpusPerReplica": 8})
    pod = next(p for p in render.render_pods(plain, OWNER, 0) if p["metadata"]["labels"][LABEL_ROLE] == "trainer")
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert "resourceClaims" not in pod["spec"]


def test_a_bad_claim_is_refused_naming_the_field_and_the_claim():
    import pytest
    from pydantic import ValidationError

    for claims, why in (([{"name": "gpus"}], "'gpus' has neither"),
                        ([{"name": "gpus", "resourceClaimName": "a", "resourceClaimTemplateName": "b"}], "'gpus' has both"),
                        ([{"name": "gpus", "resourceClaimName": "a"}, {"name": "gpus", "resourceClaimName": "b"}],
                         "'gpus' is named twice"),
                        ([{"name": "GPUs", "resourceClaimName": "a"}], "pattern")):
        with pytest.raises(ValidationError) as err:
            run_of(trainer={**TINY["spec"]["trainer"], "resourceClaims": claims})
        assert "resourceClaims" in str(err.value) and why in str(err.value), str(err.value)
