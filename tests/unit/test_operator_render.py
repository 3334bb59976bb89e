"""Pure render + lifecycle decisions of the operator (no API server)."""

from __future__ import annotations

import copy
import datetime as dt

import yaml

from tests.kube import ROOT
from trainingrun.api import parse_trainingrun
from trainingrun.api.constants import LABEL_ATTEMPT, LABEL_RANK, LABEL_ROLE
from trainingrun.operator import render, status
from trainingrun.plan import EXIT_CONFIG_ERROR

TINY = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
OWNER = render.Owner(name="tiny", namespace="ns1", uid="u-1")
T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)


def run_of(**spec):
    doc = copy.deepcopy(TINY)
    doc["spec"].update(spec)
    return parse_trainingrun(doc)


def pods_of(run, attempt, phase="Running", **overrides):
    out = []
    for role, rank in status.expected_group(run):
        name = render.Names("tiny").pod(role, rank, attempt)
        out.append(status.PodObs(name=name, role=role, rank=rank, attempt=attempt,
                                 phase=overrides.get(name, phase)))
    return out


def test_children_gang_and_store():
    run = run_of(gangScheduling={"enabled": True, "provider": "volcano"}, trainer={**TINY["spec"]["trainer"], "replicas": 3})
    children = render.render_children(run, OWNER, attempt=2)
    kinds = [c["kind"] for c in children]
    assert kinds == ["ConfigMap", "Service", "Pod", "Service", "PodGroup", "Pod", "Pod", "Pod", "Pod"]
    pg = children[4]
    assert pg["spec"]["minMember"] == 4
    trainers = [c for c in children if c["kind"] == "Pod" and c["metadata"]["labels"].get(LABEL_ROLE) == "trainer"]
    assert [t["metadata"]["name"] for t in trainers] == [f"tiny-trainer-{r}-a2" for r in range(3)]
    for t in trainers:
        assert t["spec"]["schedulerName"] == "volcano"
        assert t["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "tiny"
        assert t["metadata"]["labels"][LABEL_ATTEMPT] == "2"
        assert "nvidia.com/gpu" not in t["spec"]["containers"][0].get("resources", {}).get("limits", {})
    assert all(c["metadata"]["ownerReferences"][0]["uid"] == "u-1" for c in children)
    # an external store: no managed Redis
    ext = run_of(store={"url": "redis://r:6379/0"})
    assert render.render_store(ext, OWNER) == []
    assert render.store_url(ext, "ns1") == "redis://r:6379/0?prefix=trainingrun.ns1.tiny"


def test_cluster_errors_name_the_field():
    assert render.cluster_errors(run_of()) == []
    errs = render.cluster_errors(run_of(store={"url": "file:///tmp/s"}))
    assert len(errs) == 1 and errs[0].startswith("spec.store.url")
    doc = copy.deepcopy(TINY)
    doc["metadata"]["name"] = "9" + "a" * 50
    errs = render.cluster_errors(parse_trainingrun(doc))
    assert errs and all(e.startswith("metadata.name") for e in errs)
    # the operator's own config volume and mount cannot be taken by podTemplate (the API server would refuse the pods)
    clash = run_of(podTemplate={"volumes": [{"name": "config", "emptyDir": {}}, {"name": "ok", "emptyDir": {}}],
                                "volumeMounts": [{"name": "ok", "mountPath": "/etc/trainingrun/"}]})
    errs = render.cluster_errors(clash)
    assert [e.split(":")[0] for e in errs] == ["spec.podTemplate.volumes[0].name",
                                               "spec.podTemplate.volumeMounts[0].mountPath"], errs
    pod = render.render_pods(run_of(podTemplate={"volumes": [{"name": "ok", "emptyDir": {}}]}), OWNER, 0)[0]
    names = [v["name"] for v in pod["spec"]["volumes"]]
    assert render.CONFIG_VOLUME in names and len(set(names)) == len(names)


def test_lifecycle_new_pending_running():
    run = run_of()
    d = status.decide(run, None, [], now=T0, generation=1)
    assert d.status["phase"] == "Pending" and d.create_base and len(d.create_pods) == 3 and d.create_store_pod
    st = d.status
    d = status.decide(run, st, pods_of(run, 0, phase="Pending"), now=T0)
    assert d.status["phase"] == "Pending" and not d.create_pods
    d = status.decide(run, st, pods_of(run, 0), now=T0)
    assert d.status["phase"] == "Running" and d.events[-1][1] == "Running"


def _running(run):
    st = status.decide(run, None, [], now=T0).status
    return status.decide(run, st, pods_of(run, 0), now=T0).status


def test_restart_budget_and_backoff():
    run = run_of(failurePolicy={"maxRestarts": 1, "backoffSeconds": 10})
    st = _running(run)
    failed = pods_of(run, 0, **{"tiny-trainer-1-a0": "Failed"})
    d = status.decide(run, st, failed, now=T0)
    assert d.status["phase"] == "Restarting" and d.status["restarts"] == 1 and d.status["attempt"] == 1
    assert sorted(d.delete_pods) == sorted(p.name for p in failed if p.phase == "Running")
    st = d.status
    # backoff not elapsed: nothing created
    d = status.decide(run, st, [], now=T0 + dt.timedelta(seconds=5))
    assert d.status["phase"] == "Restarting" and not d.create_pods and d.requeue_after == 5
    d = status.decide(run, st, [], now=T0 + dt.timedelta(seconds=10))
    assert d.status["phase"] == "Pending" and len(d.create_pods) == 3
    st = status.decide(run, d.status, pods_of(run, 1), now=T0).status
    assert st["phase"] == "Running"
    # budget used: Failed with the failing pod in the message; terminal is sticky
    pods = pods_of(run, 1, **{"tiny-rollout-a1": "Failed"})
    d = status.decide(run, st, pods, now=T0)
    assert d.status["phase"] == "Failed" and "tiny-rollout-a1" in d.status["message"]
    d2 = status.decide(run, d.status, pods_of(run, 1, phase="Succeeded"), now=T0)
    assert d2.status["phase"] == "Failed" and not d2.create_pods


def test_exit_code_config_error_and_deleted_pod():
    run = run_of()
    st = _running(run)
    obs = status.observe_pod({
        "metadata": {"name": "tiny-trainer-0-a0", "labels": {LABEL_ROLE: "trainer", LABEL_RANK: "0",
                                                             LABEL_ATTEMPT: "0"}},
        "status": {"phase": "Failed", "containerStatuses": [
            {"name": "trainer", "state": {"terminated": {"exitCode": EXIT_CONFIG_ERROR, "reason": "Error"}}}]},
    })
    assert "code 78" in obs.failure
    pods = [p for p in pods_of(run, 0) if p.name != obs.name] + [obs]
    d = status.decide(run, st, pods, now=T0)
    assert d.status["phase"] == "Failed" and d.status["restarts"] == 0
    assert d.status["conditions"][-1]["reason"] == "ConfigError" or any(
        c["reason"] == "ConfigError" and c["status"] == "True" for c in d.status["conditions"])
    # a pod deleted while running counts as a failure
    d = status.decide(run, st, pods_of(run, 0)[:-1], now=T0)
    assert d.status["phase"] == "Restarting" and "was deleted" in d.status["message"]


def test_hang_detection_deadline_suspend_ttl():
    run = run_of(failurePolicy={"maxRestarts": 0, "progressDeadlineSeconds": 60}, activeDeadlineSeconds=3600,
                 ttlSecondsAfterFinished=30)
    st = _running(run)
    fresh = {"step": 3, "time": (T0 + dt.timedelta(seconds=50)).timestamp()}
    d = status.decide(run, st, pods_of(run, 0), now=T0 + dt.timedelta(seconds=100), progress=fresh)
    assert d.status["phase"] == "Running" and d.status["step"] == 3
    d = status.decide(run, st, pods_of(run, 0), now=T0 + dt.timedelta(seconds=111), progress=fresh)
    assert d.status["phase"] == "Failed" and "no progress" in d.status["message"]
    d = status.decide(run, st, pods_of(run, 0), now=T0 + dt.timedelta(seconds=3600), progress={"time": 1e12})
    assert d.status["phase"] == "Failed" and any(c["reason"] == "DeadlineExceeded" for c in d.status["conditions"])
    done = d.status
    assert not status.decide(run, done, [], now=T0 + dt.timedelta(seconds=3620)).delete_run
    assert status.decide(run, done, [], now=T0 + dt.timedelta(seconds=3631)).delete_run
    suspended = run_of(suspend=True)
    d = status.decide(suspended, _running(run), pods_of(run, 0), now=T0)
    assert d.status["phase"] == "Suspended" and len(d.delete_pods) == 3
    d = status.decide(run, d.status, [], now=T0)
    assert d.status["phase"] == "Pending" and d.status["attempt"] == 1 and d.status["restarts"] == 0


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
    obs = status.observe_pod(pod)
    assert "tiny-trainer-1-a0" in obs.waiting and "Insufficient nvidia.com/gpu" in obs.waiting
    run = run_of()
    st = status.decide(run, None, [], now=T0).status
    pods = [p for p in pods_of(run, 0, phase="Pending") if p.name != obs.name] + [obs]
    d = status.decide(run, st, pods, now=T0)
    assert d.status["phase"] == "Pending" and d.status["message"] == obs.waiting
    # scheduled (condition True): no waiting reason, the plain count
    pod["status"]["conditions"] = [{**unschedulable, "status": "True"}]
    assert status.observe_pod(pod).waiting is None


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
    assert any("podTemplate.volumes[0].name" in e and "'dshm'" in e for e in render.cluster_errors(clash))


def test_runs_sharing_an_external_redis_get_their_own_keys():
    from trainingrun.store import open_store

    a = render.store_url(run_of(store={"url": "redis://redis.infra:6379/2"}), "ns1")
    assert a == "redis://redis.infra:6379/2?prefix=trainingrun.ns1.tiny"
    assert open_store(a).prefix == "trainingrun.ns1.tiny"  # the store accepts the key it is given
    assert render.store_url(run_of(store={"url": "redis://r:6379/0?prefix=mine"}), "ns1").endswith("?prefix=mine")


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
