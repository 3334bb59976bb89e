"""Pure render + lifecycle decisions of the operator (no API server)."""

from __future__ import annotations

import copy
import datetime as dt

import yaml

from tests.kube import ROOT
from trainingrun.api import parse_trainingrun
from trainingrun.api.constants import LABEL_ATTEMPT, LABEL_RANK, LABEL_ROLE
from trainingrun.operator import checks, render, status, vocabulary
from trainingrun.operator.observe import Observed, PodObs, ProgressObs, Refusal, observe_pod
from trainingrun.plan import EXIT_CONFIG_ERROR

TINY = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
OWNER = vocabulary.Owner(name="tiny", namespace="ns1", uid="u-1")
T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)


def run_of(**spec):
    doc = copy.deepcopy(TINY)
    doc["spec"].update(spec)
    return parse_trainingrun(doc)


def pods_of(run, attempt, phase="Running", **overrides):
    out = []
    for role, rank in status.expected_group(run):
        name = vocabulary.Names("tiny").pod(role, rank, attempt)
        out.append(PodObs(name=name, role=role, rank=rank, attempt=attempt, phase=overrides.get(name, phase)))
    return out


def all_children(run, attempt=0):
    """Observed: every base child of the attempt exists."""
    return frozenset(c.key for c in vocabulary.base_children(run, attempt) if c.kind != "Pod")


def decide(run, st, pods=(), *, now=T0, attempt=0, **obs):
    """status.decide with every base child (and the store pod) observed, unless `children` is given."""
    store = [PodObs(name="tiny-store", role="store", rank=None, attempt=None, phase="Running")]
    obs.setdefault("children", all_children(run, attempt))
    obs.setdefault("config_hash", vocabulary.config_hash(run))
    return status.decide(run, st, Observed(pods=tuple(pods) + tuple(store), **obs), now=now)


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


def _pods(ds):
    return [c for c in ds.create if c.kind == "Pod" and c.role in ("rollout", "trainer")]


def test_lifecycle_new_pending_running():
    run = run_of()
    d = status.decide(run, None, Observed(generation=1), now=T0)
    assert d.status["phase"] == "Pending" and d.status["trainerReplicas"] == 2
    # base children first (what pods mount and resolve), then the three pods
    assert [c.key for c in d.create] == ["ConfigMap/tiny-config", "Service/tiny-trainers", "Service/tiny-store",
                                         "Pod/tiny-store", "Pod/tiny-rollout-a0", "Pod/tiny-trainer-0-a0",
                                         "Pod/tiny-trainer-1-a0"]
    st = d.status
    d = decide(run, st, pods_of(run, 0, phase="Pending"))
    assert d.status["phase"] == "Pending" and not d.create
    ready = next(c for c in d.status["conditions"] if c["type"] == "PodsReady")
    assert ready["status"] == "False" and ready["reason"] == "WaitingForPods" and "3 pod(s)" in ready["message"]
    d = decide(run, st, pods_of(run, 0), generation=2)
    assert d.status["phase"] == "Running" and d.events[-1][1] == "Running"
    assert {c["type"]: c.get("observedGeneration") for c in d.status["conditions"]} == {"PodsReady": 2, "Running": 2}


def test_every_reconcile_creates_missing_children():
    run = run_of()
    st = status.decide(run, None, Observed(), now=T0).status
    # the ConfigMap was refused: pods exist without it; the next reconcile asks for it again
    d = decide(run, st, pods_of(run, 0, phase="Pending"), children=frozenset({"Service/tiny-trainers",
                                                                              "Service/tiny-store"}))
    assert [c.key for c in d.create] == ["ConfigMap/tiny-config"]
    # Running with the headless Service deleted: recreated (base children only, never pods of a running attempt)
    running = decide(run, st, pods_of(run, 0)).status
    d = decide(run, running, pods_of(run, 0), children=frozenset({"ConfigMap/tiny-config", "Service/tiny-store"}))
    assert d.status["phase"] == "Running" and [c.key for c in d.create] == ["Service/tiny-trainers"]
    # a refusal shows in the Pending run's message and condition; a permanent one fails the run
    refusal = Refusal("Pod", "tiny-rollout-a0", 403, "exceeded quota: gpus", permanent=False)
    d = decide(run, st, [], refusal=refusal)
    assert d.status["phase"] == "Pending" and "exceeded quota" in d.status["message"]
    invalid = Refusal("Pod", "tiny-rollout-a0", 422, "spec.containers[0].image: Invalid value", permanent=True)
    d = decide(run, st, [], refusal=invalid)
    assert d.status["phase"] == "Failed" and "Invalid value" in d.status["message"] and not d.create
    assert d.status["conditions"][-1]["reason"] == "InvalidSpec" or any(
        c["reason"] == "InvalidSpec" and c["status"] == "True" for c in d.status["conditions"])


def _running(run):
    st = status.decide(run, None, Observed(), now=T0).status
    return decide(run, st, pods_of(run, 0)).status


def test_restart_budget_and_exponential_backoff():
    run = run_of(failurePolicy={"maxRestarts": 3, "backoffSeconds": 10})
    st = _running(run)
    failed = pods_of(run, 0, **{"tiny-trainer-1-a0": "Failed"})
    d = decide(run, st, failed)
    assert d.status["phase"] == "Restarting" and d.status["restarts"] == 1 and d.status["attempt"] == 1
    assert sorted(d.delete_pods) == sorted(p.name for p in failed if p.phase == "Running")
    st = d.status
    # backoff not elapsed: nothing created
    d = decide(run, st, [], now=T0 + dt.timedelta(seconds=5), attempt=1)
    assert d.status["phase"] == "Restarting" and not _pods(d) and d.requeue_after == 5
    d = decide(run, st, [], now=T0 + dt.timedelta(seconds=10), attempt=1)
    assert d.status["phase"] == "Pending" and len(_pods(d)) == 3
    st = decide(run, d.status, pods_of(run, 1), attempt=1).status
    assert st["phase"] == "Running"
    # the second restart waits 2 x backoffSeconds
    d = decide(run, st, pods_of(run, 1, **{"tiny-rollout-a1": "Failed"}), attempt=1)
    assert d.status["restarts"] == 2 and "in 20s" in d.status["message"]
    # budget used: Failed with the failing pod in the message; terminal is sticky
    st = {**d.status, "restarts": 3, "phase": "Running", "attempt": 1}
    d = decide(run, st, pods_of(run, 1, **{"tiny-rollout-a1": "Failed"}), attempt=1)
    assert d.status["phase"] == "Failed" and "tiny-rollout-a1" in d.status["message"]
    d2 = decide(run, d.status, pods_of(run, 1, phase="Succeeded"), attempt=1)
    assert d2.status["phase"] == "Failed" and not d2.create


def test_disruptions_do_not_use_the_budget_and_success_wins():
    run = run_of(failurePolicy={"maxRestarts": 0, "backoffSeconds": 7})
    st = _running(run)
    evicted = observe_pod({"metadata": {"name": "tiny-trainer-0-a0", "labels": {LABEL_ROLE: "trainer", LABEL_RANK: "0",
                                                                              LABEL_ATTEMPT: "0"}},
                           "status": {"phase": "Failed", "reason": "Evicted", "message": "low on memory"}})
    assert evicted.disruption and "Evicted" in evicted.disruption
    pods = [p for p in pods_of(run, 0) if p.name != evicted.name] + [evicted]
    d = decide(run, st, pods)
    assert d.status["phase"] == "Restarting" and d.status["restarts"] == 0 and d.status["disruptions"] == 1
    assert d.requeue_after == 7 and d.events[-1][1] == "Disrupted"
    # DisruptionTarget on a pod that was deleted (the Eviction API): known from its last state
    preempted = observe_pod({"metadata": {"name": "tiny-rollout-a0", "labels": {LABEL_ROLE: "rollout",
                                                                               LABEL_ATTEMPT: "0"}},
                             "status": {"phase": "Running", "conditions": [
                                 {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]}})
    d = decide(run, st, [p for p in pods_of(run, 0) if p.name != preempted.name], gone=(preempted,))
    assert d.status["phase"] == "Restarting" and d.status["disruptions"] == 1
    # a deleted pod without a disruption is a failure (budget 0: Failed)
    d = decide(run, st, pods_of(run, 0)[:-1])
    assert d.status["phase"] == "Failed" and "was deleted" in d.status["message"]
    # every trainer Succeeded and the rollout Failed in one observation: Succeeded
    d = decide(run, st, pods_of(run, 0, phase="Succeeded", **{"tiny-rollout-a0": "Failed"}))
    assert d.status["phase"] == "Succeeded"


def test_exit_code_config_error():
    run = run_of()
    st = _running(run)
    obs = observe_pod({
        "metadata": {"name": "tiny-trainer-0-a0", "labels": {LABEL_ROLE: "trainer", LABEL_RANK: "0",
                                                             LABEL_ATTEMPT: "0"}},
        "status": {"phase": "Failed", "containerStatuses": [
            {"name": "trainer", "state": {"terminated": {"exitCode": EXIT_CONFIG_ERROR, "reason": "Error"}}}]},
    })
    assert "code 78" in obs.failure
    pods = [p for p in pods_of(run, 0) if p.name != obs.name] + [obs]
    d = decide(run, st, pods)
    assert d.status["phase"] == "Failed" and d.status["restarts"] == 0
    assert any(c["reason"] == "ConfigError" and c["status"] == "True" for c in d.status["conditions"])


def test_terminating_pods_block_until_the_timeout():
    run = run_of(failurePolicy={"maxRestarts": 2, "backoffSeconds": 0, "terminatingTimeoutSeconds": 60})
    st = decide(run, _running(run), pods_of(run, 0, **{"tiny-trainer-0-a0": "Failed"})).status
    assert st["phase"] == "Restarting"
    lost = PodObs(name="tiny-trainer-1-a0", role="trainer", rank=1, attempt=0, phase="Running", deleting=True,
                  deleted_at=T0.timestamp())
    d = decide(run, st, [lost], now=T0 + dt.timedelta(seconds=30), attempt=1)
    assert d.status["phase"] == "Restarting" and "tiny-trainer-1-a0" in d.status["message"] and not _pods(d)
    d = decide(run, st, [lost], now=T0 + dt.timedelta(seconds=61), attempt=1)
    assert d.status["phase"] == "Pending" and len(_pods(d)) == 3
    assert any(e[1] == "TerminatingTimeout" and "tiny-trainer-1-a0" in e[2] for e in d.events)


def test_progress_unknown_pauses_hang_detection_and_resize_restarts():
    run = run_of(failurePolicy={"maxRestarts": 0, "progressDeadlineSeconds": 60}, activeDeadlineSeconds=3600,
                 ttlSecondsAfterFinished=30)
    st = _running(run)
    fresh = ProgressObs({"step": 3, "time": (T0 + dt.timedelta(seconds=50)).timestamp()})
    d = decide(run, st, pods_of(run, 0), now=T0 + dt.timedelta(seconds=100), progress=fresh)
    assert d.status["phase"] == "Running" and d.status["step"] == 3
    d = decide(run, st, pods_of(run, 0), now=T0 + dt.timedelta(seconds=111), progress=fresh)
    assert d.status["phase"] == "Failed" and "no progress" in d.status["message"]
    unknown = ProgressObs(fresh.value, error="ConnectionError: Authentication required")
    d = decide(run, st, pods_of(run, 0), now=T0 + dt.timedelta(seconds=500), progress=unknown)
    assert d.status["phase"] == "Running"
    cond = next(c for c in d.status["conditions"] if c["type"] == "ProgressUnknown")
    assert cond["status"] == "True" and "Authentication required" in cond["message"]
    # readable again at 500 s: the deadline counts from then, not from the last step at 50 s
    back = decide(run, d.status, pods_of(run, 0), now=T0 + dt.timedelta(seconds=500), progress=fresh).status
    assert back["phase"] == "Running"
    assert decide(run, back, pods_of(run, 0), now=T0 + dt.timedelta(seconds=550), progress=fresh).status["phase"] == (
        "Running")
    assert decide(run, back, pods_of(run, 0), now=T0 + dt.timedelta(seconds=561), progress=fresh).status["phase"] == (
        "Failed")
    # a resize restarts the group at the new size, not counted
    bigger = run_of(trainer={**TINY["spec"]["trainer"], "replicas": 4}, failurePolicy={"maxRestarts": 0})
    d = decide(bigger, st, pods_of(run, 0))
    assert d.status["phase"] == "Restarting" and d.status["restarts"] == 0 and d.status["disruptions"] == 0
    assert d.events[-1][:2] == ("Normal", "Resized") and "from 2 to 4" in d.events[-1][2]
    d = decide(bigger, d.status, [], attempt=1)
    assert d.status["phase"] == "Pending" and len(_pods(d)) == 5 and d.status["trainerReplicas"] == 4


def test_deadline_suspend_ttl_and_long_messages():
    run = run_of(activeDeadlineSeconds=3600, ttlSecondsAfterFinished=30)
    st = _running(run)
    d = decide(run, st, pods_of(run, 0), now=T0 + dt.timedelta(seconds=3600))
    assert d.status["phase"] == "Failed" and any(c["reason"] == "DeadlineExceeded" for c in d.status["conditions"])
    done = d.status
    assert not decide(run, done, [], now=T0 + dt.timedelta(seconds=3620)).delete_run
    assert decide(run, done, [], now=T0 + dt.timedelta(seconds=3631)).delete_run
    suspended = run_of(suspend=True)
    d = decide(suspended, _running(run), pods_of(run, 0))
    assert d.status["phase"] == "Suspended" and len(d.delete_pods) == 3
    d = decide(run, d.status, [])
    assert d.status["phase"] == "Pending" and d.status["attempt"] == 1 and d.status["restarts"] == 0
    # a message longer than the CRD admits is cut to fit, and says so
    d = decide(run, None, [], spec_errors=tuple(f"spec.x[{i}]: bad" * 20 for i in range(100)))
    assert d.status["phase"] == "Failed" and len(d.status["message"]) <= 4096
    assert d.status["message"].endswith("more characters)")
    assert all(len(c["message"]) <= 4096 for c in d.status["conditions"])


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


def test_pending_pod_reports_the_schedulers_reason():
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}
    pod = {"metadata": {"name": "tiny-trainer-1-a0", "labels": {LABEL_ROLE: "trainer", LABEL_RANK: "1",
                                                                 LABEL_ATTEMPT: "0"}},
           "status": {"phase": "Pending", "conditions": [unschedulable]}}
    obs = observe_pod(pod)
    assert "tiny-trainer-1-a0" in obs.waiting and "Insufficient nvidia.com/gpu" in obs.waiting
    run = run_of()
    st = status.decide(run, None, Observed(), now=T0).status
    pods = [p for p in pods_of(run, 0, phase="Pending") if p.name != obs.name] + [obs]
    d = decide(run, st, pods)
    assert d.status["phase"] == "Pending" and d.status["message"] == obs.waiting
    # Kueue holds the pods (scheduling gate) until it admits the workload
    gated = [PodObs(name=p.name, role=p.role, rank=p.rank, attempt=0, phase="Pending",
                    gated=("kueue.x-k8s.io/admission",)) for p in pods_of(run, 0)]
    d = decide(run_of(queueName="team-a"), st, gated)
    ready = next(c for c in d.status["conditions"] if c["type"] == "PodsReady")
    assert ready["reason"] == "WaitingForAdmission" and "team-a" in ready["message"]
    # scheduled (condition True): no waiting reason, the plain count
    pod["status"]["conditions"] = [{**unschedulable, "status": "True"}]
    assert observe_pod(pod).waiting is None


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
