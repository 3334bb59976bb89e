"""The operator's contract and lifecycle, scenario by scenario, against the KMock emulator with the fidelity layer
(tests/kube.py): the operator runs in-process (`InProcessOperator`); pod phases are set the way a kubelet would
(PATCH pods/status). tests/integration/test_operator_cli.py runs `trainingrun operator` as a process;
test_operator_faults.py covers refusals, disruptions and other cluster faults.
"""

from __future__ import annotations

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.kube import ROOT, Cluster
from tests.services import wait_for

TINY = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())


@pytest.fixture(scope="module")
def cluster():
    with Cluster() as c, c.operator(interval=1.0) as op:
        c.op = op
        yield c


def make_run(cluster: Cluster, name: str, **spec_overrides) -> dict:
    return cluster.new_run(name, **spec_overrides)


def test_create_renders_children_with_contract(cluster):
    run = make_run(cluster, "alpha", trainer={**TINY["spec"]["trainer"], "gpusPerReplica": 1,
                                               "resources": {"requests": {"cpu": "2"}, "limits": {"memory": "4Gi"}}},
                   podTemplate={"nodeSelector": {"pool": "gpu"}, "priorityClassName": "high"},
                   schedulerName="custom-sched")
    uid = run["metadata"]["uid"]
    pods = cluster.wait_group("alpha", 0)
    by_role = {(p["metadata"]["labels"]["trainingrun.dev/role"], p["metadata"]["labels"].get("trainingrun.dev/rank")): p
               for p in pods}
    assert set(by_role) == {("rollout", None), ("trainer", "0"), ("trainer", "1")}
    for pod in pods + cluster.pods("alpha", role="store"):
        meta = pod["metadata"]
        assert meta["labels"]["app.kubernetes.io/name"] == "trainingrun"
        assert meta["labels"]["trainingrun.dev/run"] == "alpha"
        assert meta["ownerReferences"][0]["uid"] == uid and meta["ownerReferences"][0]["controller"] is True
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    trainer0 = by_role[("trainer", "0")]
    assert trainer0["metadata"]["labels"]["trainingrun.dev/attempt"] == "0"
    spec = trainer0["spec"]
    assert spec["restartPolicy"] == "Never" and spec["schedulerName"] == "custom-sched"
    assert spec["nodeSelector"] == {"pool": "gpu"} and spec["priorityClassName"] == "high"
    assert spec["hostname"] == "trainer-0-a0" and spec["subdomain"] == "alpha-trainers"
    c = spec["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "2" and env["TRAININGRUN_RUN"] == "alpha"
    assert env["MASTER_ADDR"] == "trainer-0-a0.alpha-trainers.default.svc" and env["TRAININGRUN_ATTEMPT"] == "0"
    assert env["TRAININGRUN_STORE_URL"] == "redis://alpha-store.default.svc:6379/0"
    assert env["TRAININGRUN_CONFIG"] == "/etc/trainingrun/run.yaml"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["resources"]["requests"]["cpu"] == "2"
    rollout = by_role[("rollout", None)]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in rollout.get("resources", {}).get("limits", {})
    svc = cluster.get("/api/v1/namespaces/default/services/alpha-trainers")
    assert svc["spec"]["clusterIP"] == "None" and svc["metadata"]["ownerReferences"][0]["uid"] == uid
    cm = cluster.get("/api/v1/namespaces/default/configmaps/alpha-config")
    assert yaml.safe_load(cm["data"]["run.yaml"])["spec"]["trainer"]["replicas"] == 2
    assert cluster.get("/api/v1/namespaces/default/services/alpha-store") is not None
    st = cluster.wait_phase("alpha", "Pending")
    assert st["observedGeneration"] == 1 and st["startTime"]
    wait_for(lambda: "Created" in cluster.reasons("alpha"), 10, "Created event")

    # simulated pod phases → status; all trainers Succeeded → Succeeded, sticky
    cluster.run_all("alpha", 0)
    # the rollout ends first, as in a run: once every trainer succeeded the operator deletes the pods still live, and
    # a rollout pod set Succeeded after the trainers could be gone by then (HTTP 404; seen on a loaded machine)
    for pod in sorted(pods, key=lambda p: p["metadata"]["labels"]["trainingrun.dev/role"] != "rollout"):
        cluster.set_pod(pod["metadata"]["name"], "Succeeded")
    st = cluster.wait_phase("alpha", "Succeeded")
    assert st["completionTime"] and st["restarts"] == 0
    assert any(c["type"] == "Succeeded" and c["status"] == "True" for c in st["conditions"])
    cluster.set_pod(by_role[("trainer", "1")]["metadata"]["name"], "Failed", exit_code=1)
    wait_for(lambda: "Succeeded" in cluster.reasons("alpha"), 10, "Succeeded event")
    cluster.op.settle("alpha")  # the operator saw the late failure and kept the run Succeeded
    assert cluster.status("alpha")["phase"] == "Succeeded"
    assert len(cluster.group_pods("alpha", 1)) == 0

    # deletion → children garbage-collected
    cluster.delete(cluster.tr_path("alpha"))
    wait_for(lambda: cluster.run("alpha") is None, 15, "the run to be deleted")
    assert cluster.pods("alpha") == []
    assert cluster.get("/api/v1/namespaces/default/configmaps/alpha-config") is None


def test_dra_claims_reach_every_trainer_pod_and_its_container(cluster):
    """Issue 32's acceptance: a run with trainer.resourceClaims; every trainer pod the operator creates carries them,
    its container claims each, and asks for no device-plugin GPUs; the run gets going."""
    claims = [{"name": "gpus", "resourceClaimTemplateName": "h100x4"}]
    make_run(cluster, "claims", trainer={**TINY["spec"]["trainer"], "replicas": 3, "gpusPerReplica": 4,
                                         "resourceClaims": claims})
    pods = cluster.wait_group("claims", 0, n=4)
    trainers = [p for p in pods if p["metadata"]["labels"]["trainingrun.dev/role"] == "trainer"]
    assert len(trainers) == 3
    for pod in trainers:
        c = pod["spec"]["containers"][0]
        assert pod["spec"]["resourceClaims"] == claims
        assert c["resources"]["claims"] == [{"name": "gpus"}] and "nvidia.com/gpu" not in str(c["resources"])
    assert cluster.status("claims").get("phase") in ("Pending", "Running")
    cluster.delete(cluster.tr_path("claims"))


def test_gpu_example_pods_volumes_store_and_scheduling_message(cluster):
    """examples/gpu-8x.yaml as shipped (namespace ml, managed store, 8 x 1 GPU, shared claim, GPU node placement)."""
    doc = yaml.safe_load((ROOT / "examples" / "gpu-8x.yaml").read_text())
    ns, name, tmpl = doc["metadata"]["namespace"], doc["metadata"]["name"], doc["spec"]["podTemplate"]
    cluster.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    cluster.create(cluster.tr_path(ns=ns), doc)
    pods = wait_for(lambda: (lambda ps: ps if len(ps) == 10 else None)(cluster.pods(name, ns)), 15, "9 pods + store")
    by_name = {p["metadata"]["name"]: p for p in pods}
    store = by_name.pop(f"{name}-store")
    svc = cluster.get(f"/api/v1/namespaces/{ns}/services/{name}-store")
    assert svc["spec"]["selector"].items() <= store["metadata"]["labels"].items()
    port = store["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert svc["spec"]["ports"][0]["targetPort"] == port
    ranks = set()
    for pod in by_name.values():
        spec, c = pod["spec"], pod["spec"]["containers"][0]
        role = pod["metadata"]["labels"]["trainingrun.dev/role"]
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["TRAININGRUN_STORE_URL"] == f"redis://{name}-store.{ns}.svc:{svc['spec']['ports'][0]['port']}/0"
        assert env["TRAININGRUN_RUN"] == name
        assert spec["nodeSelector"] == tmpl["nodeSelector"] and spec["tolerations"] == tmpl["tolerations"]
        assert spec["priorityClassName"] == tmpl["priorityClassName"]
        claims = {v["name"]: v for v in spec["volumes"]}
        assert claims["shared"]["persistentVolumeClaim"]["claimName"] == "grpo-llama-1b-shared"
        mounts = [m for m in c["volumeMounts"] if m["name"] == "shared"]
        assert mounts == tmpl["volumeMounts"]
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
        if role == "trainer":
            ranks.add(env["RANK"])
            assert env["RANK"] == pod["metadata"]["labels"]["trainingrun.dev/rank"] and env["WORLD_SIZE"] == "8"
            assert env["MASTER_ADDR"] == f"trainer-0-a0.{name}-trainers.{ns}.svc"
            assert gpus == 1 and c["resources"]["requests"]["nvidia.com/gpu"] == 1
            assert c["resources"]["requests"]["memory"] == "64Gi" and c["resources"]["limits"]["memory"] == "96Gi"
        else:
            assert role == "rollout" and gpus is None
    assert ranks == {str(r) for r in range(8)}
    # a pod the scheduler cannot place: its reason reaches the run's message (kubectl get tr -o wide / describe)
    trainer = f"{name}-trainer-5-a0"
    cluster.patch(f"/api/v1/namespaces/{ns}/pods/{trainer}/status", {"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}})
    wait_for(lambda: "Insufficient nvidia.com/gpu" in (cluster.status(name, ns).get("message") or ""), 10,
             f"the scheduler's reason in the message (now {cluster.status(name, ns)})")
    assert trainer in cluster.status(name, ns)["message"]
    created = [e for e in cluster.events(name, ns) if e.get("reason") == "Created"]
    assert created and created[0]["source"]["component"] == "trainingrun-operator"
    cluster.delete(cluster.tr_path(name, ns))


def test_refused_pod_creation_is_reported_then_retried(cluster):
    """An admission refusal (here: ResourceQuota) shows as a Warning event and in the message; pods come once lifted."""
    ns = "quota"
    refusal = ('pods "q-trainer-0-a0" is forbidden: exceeded quota: gpus, requested: nvidia.com/gpu=1, '
               'used: nvidia.com/gpu=8, limited: nvidia.com/gpu=8')
    assert cluster.emulator is not None
    cluster.new_run("q", ns)
    cluster.delete(cluster.tr_path("q", ns))
    wait_for(lambda: cluster.run("q", ns) is None and not cluster.pods("q", ns), 10, "a clean namespace")
    lift = cluster.emulator.refuse("pods", ns, 403, "Forbidden", refusal)
    cluster.new_run("q", ns)
    events = wait_for(lambda: [e for e in cluster.events("q", ns) if e.get("reason") == "FailedCreate"] or None, 10,
                      "a FailedCreate event")
    assert events[0]["type"] == "Warning" and "exceeded quota" in events[0]["message"]
    wait_for(lambda: "exceeded quota" in (cluster.status("q", ns).get("message") or ""), 10,
             f"the refusal in the run's message (now {cluster.status('q', ns)})")
    lift()
    wait_for(lambda: len(group_pods_ns(cluster, "q", ns)) == 3, 15, "the pods once the quota allows them")
    wait_for(lambda: "waiting for 3 pod(s)" in (cluster.status("q", ns).get("message") or ""), 10,
             f"the refusal gone from the message (now {cluster.status('q', ns)})")
    assert len([e for e in cluster.events("q", ns) if e.get("reason") == "FailedCreate"]) == 1  # not one per retry
    cluster.delete(cluster.tr_path("q", ns))


def group_pods_ns(cluster: Cluster, name: str, ns: str) -> list[dict]:
    return [p for p in cluster.pods(name, ns) if p["metadata"]["labels"]["trainingrun.dev/role"] != "store"]


def test_failure_restarts_whole_group_then_fails_sticky(cluster):
    make_run(cluster, "beta", failurePolicy={"maxRestarts": 1, "backoffSeconds": 0})
    cluster.run_all("beta", 0)
    first = {p["metadata"]["name"] for p in cluster.group_pods("beta", 0)}
    cluster.set_pod("beta-trainer-1-a0", "Failed", exit_code=137, reason="OOMKilled")
    new = cluster.wait_group("beta", 1)
    assert not first & {p["metadata"]["name"] for p in new}
    st = cluster.status("beta")
    assert st["restarts"] == 1 and st["attempt"] == 1
    # the whole previous group was deleted, not only the failed pod
    assert wait_for(lambda: [p for p in cluster.pods("beta", attempt="0")
                             if p["status"]["phase"] != "Failed"] == [], 10, "attempt-0 pods deleted")
    assert "Restarting" in cluster.reasons("beta")
    cluster.run_all("beta", 1)
    # (a trainer: a failed rollout restarts alone, test_operator_roles.py)
    cluster.set_pod("beta-trainer-0-a1", "Failed", exit_code=2)
    st = cluster.wait_phase("beta", "Failed")
    assert "beta-trainer-0-a1" in st["message"] and "code 2" in st["message"] and "maxRestarts" in st["message"]
    assert st["restarts"] == 1
    # running pods of a failed run are deleted (GPUs freed); the failed pod stays for its logs
    wait_for(lambda: cluster.group_pods("beta", 1) == [
        cluster.get("/api/v1/namespaces/default/pods/beta-trainer-0-a1")], 10, "live pods of the failed run deleted")
    # sticky: later pod changes never move it
    cluster.set_pod("beta-trainer-0-a1", "Succeeded")
    cluster.op.settle("beta")
    assert cluster.status("beta")["phase"] == "Failed"
    assert cluster.group_pods("beta", 2) == []


def test_config_error_exit_code_fails_at_once(cluster):
    make_run(cluster, "gamma")
    cluster.run_all("gamma", 0)
    cluster.set_pod("gamma-trainer-0-a0", "Failed", exit_code=78)
    st = cluster.wait_phase("gamma", "Failed")
    assert st["restarts"] == 0 and "78" in st["message"]
    assert any(c["type"] == "Failed" and c["reason"] == "ConfigError" for c in st["conditions"])


def test_runtime_invalid_spec_fails_with_event(cluster):
    # passes the schema (numAttentionHeads alone is fine) but the preset's hiddenSize 64 is not divisible by 5
    make_run(cluster, "delta", model={"preset": "tiny", "numAttentionHeads": 5})
    st = cluster.wait_phase("delta", "Failed")
    assert "spec.model" in st["message"] and "divisible" in st["message"]
    wait_for(lambda: "InvalidSpec" in cluster.reasons("delta"), 10, "InvalidSpec event")
    assert cluster.pods("delta") == []


def test_a_run_whose_memory_plan_does_not_fit_fails_before_any_pod(cluster):
    # a llama-8b in fp32 on one 24 GiB GPU per trainer: admitted by the API server, refused by the memory plan
    trainer = dict(TINY["spec"]["trainer"], replicas=1, gpusPerReplica=1, maxTokensPerGPU=4096, gpuMemoryGiB=24)
    make_run(cluster, "toobig", model={"preset": "llama-8b"}, trainer=trainer)
    st = cluster.wait_phase("toobig", "Failed")
    assert "spec.trainer.gpuMemoryGiB: the trainer does not fit" in st["message"]
    assert "optimizer states" in st["message"] and "trainer.optimizer.distributed" in st["message"]
    wait_for(lambda: "InvalidSpec" in cluster.reasons("toobig"), 10, "InvalidSpec event")
    assert cluster.pods("toobig") == []


def test_suspend_resume_and_ignored_spec_change(cluster):
    make_run(cluster, "eps")
    cluster.run_all("eps", 0)
    cluster.patch(cluster.tr_path("eps"), {"spec": {"suspend": True, "seed": 99}})
    cluster.wait_phase("eps", "Suspended")
    wait_for(lambda: cluster.group_pods("eps", 0) == [], 10, "pods deleted on suspend")
    wait_for(lambda: "SpecChangeIgnored" in cluster.reasons("eps"), 10, "SpecChangeIgnored event")
    cluster.patch(cluster.tr_path("eps"), {"spec": {"suspend": False}})
    pods = cluster.wait_group("eps", 1)
    assert len([p for p in pods if p["metadata"]["labels"]["trainingrun.dev/role"] == "trainer"]) == 2
    cm = cluster.get("/api/v1/namespaces/default/configmaps/eps-config")
    assert yaml.safe_load(cm["data"]["run.yaml"])["spec"]["seed"] == 1234  # the frozen spec: seed is not mutable
    st = cluster.status("eps")
    assert st["restarts"] == 0 and st["attempt"] == 1 and st["observedGeneration"] >= 3
    assert "Resumed" in cluster.reasons("eps")


def test_changing_replicas_restarts_the_group_at_the_new_size(cluster):
    """Elastic data parallelism (operator side): a new spec.trainer.replicas restarts the group at that size from
    the last checkpoint; not counted as a restart; an Event says so; the pods read the new size."""
    make_run(cluster, "rho", failurePolicy={"maxRestarts": 0, "backoffSeconds": 0})
    cluster.run_all("rho", 0)
    cluster.patch(cluster.tr_path("rho"), {"spec": {"trainer": {"replicas": 3}}})
    pods = cluster.wait_group("rho", 1, n=4)
    st = cluster.status("rho")
    assert st["restarts"] == 0 and st["disruptions"] == 0 and st["trainerReplicas"] == 3
    resized = [e["message"] for e in cluster.events("rho") if e.get("reason") == "Resized"]
    assert len(resized) == 1 and "from 2 to 3" in resized[0] and "checkpoint" in resized[0]
    assert "SpecUpdated" in cluster.reasons("rho") and "SpecChangeIgnored" not in cluster.reasons("rho")
    cm = cluster.get("/api/v1/namespaces/default/configmaps/rho-config")
    assert yaml.safe_load(cm["data"]["run.yaml"])["spec"]["trainer"]["replicas"] == 3
    # the ConfigMap was up to date before the new attempt's pods were created
    assert int(cm["metadata"]["resourceVersion"]) < min(int(p["metadata"]["resourceVersion"]) for p in pods)
    for pod in pods:
        env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
        if "WORLD_SIZE" in env:
            assert env["WORLD_SIZE"] == "3"
    cluster.run_all("rho", 1, n=4)
    assert cluster.status("rho")["phase"] == "Running"


def test_progress_from_real_redis_and_operator_restart(cluster, redis):
    import time

    make_run(cluster, "zeta", store={"url": redis.url})
    cluster.run_all("zeta", 0)
    assert cluster.pods("zeta", role="store") == []  # external store: no managed redis
    from trainingrun.store import open_store

    # the trainers write progress to the store URL their pods were given (the run's own key prefix on a shared Redis)
    trainer = cluster.pods("zeta", role="trainer")[0]
    env = {e["name"]: e["value"] for e in trainer["spec"]["containers"][0]["env"]}
    assert env["TRAININGRUN_STORE_URL"].startswith(redis.url + "?prefix=")
    store = open_store(env["TRAININGRUN_STORE_URL"])
    t0 = time.time()
    store.put_json("progress", {"step": 7, "samples_consumed": 93, "last_global_batch_size": 12, "rollout": 2,
                                "attempt": 0, "time": t0})
    st = wait_for(lambda: (lambda s: s if s.get("step") == 7 else None)(cluster.status("zeta")), 10, "progress")
    assert st["samplesConsumed"] == 93 and st["lastGlobalBatchSize"] == 12 and st["rollout"] == 2
    total = TINY["spec"]["rollout"]["numRollouts"]
    # status.progress: rollouts 0..2 trained of numRollouts; no pace yet (one record)
    assert {k: v for k, v in st["progress"].items() if k != "paceFrom"} == {
        "rolloutsDone": 3, "rolloutsTotal": total, "percentage": 300 // total,
        "updatedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0))}

    # operator restarted mid-run: no duplicate pods, status continues
    names = sorted(p["metadata"]["name"] for p in cluster.pods("zeta"))
    cluster.op.restart()  # a new operator: nothing in memory
    store.put_json("progress", {"step": 8, "samples_consumed": 105, "last_global_batch_size": 12, "rollout": 3,
                                "attempt": 0, "time": t0 + 20})
    wait_for(lambda: cluster.status("zeta").get("step") == 8, 15, "progress after operator restart")
    # the pace is measured from the record before the restart (its anchor lives in the status): 1 rollout in 20 s
    # (the anchor's time is kept to the second: up to 1 s more)
    progress = cluster.status("zeta")["progress"]
    eta = progress["estimatedRemainingSeconds"]
    assert progress["rolloutsDone"] == 4 and (total - 4) * 20 <= eta <= (total - 4) * 21
    assert sorted(p["metadata"]["name"] for p in cluster.pods("zeta")) == names
    assert cluster.status("zeta")["phase"] == "Running" and cluster.status("zeta")["restarts"] == 0
    store.close()

    # operator metrics
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in families() for s in fam.samples}
    assert samples[("trainingrun_operator_runs", (("phase", "Running"),))] >= 1
    assert samples[("trainingrun_operator_reconcile_seconds_count", (("handler", "reconcile"),))] > 0
    # the run's progress as a per-run gauge (what the new operator process read from the store)
    assert run_series(cluster, "zeta")["trainingrun_operator_run_step"] == {(): 8}
    assert run_series(cluster, "zeta")["trainingrun_operator_run_progress_percent"] == {(): 400 // total}
    assert run_series(cluster, "zeta")["trainingrun_operator_run_eta_seconds"] == {(): eta}


PHASES = ("Pending", "Running", "Restarting", "Succeeded", "Failed", "Suspended")


def families():
    """The operator's metrics as Prometheus would scrape them (the in-process operator's registry)."""
    from trainingrun.operator import metrics

    return list(text_string_to_metric_families(generate_latest(metrics.REGISTRY).decode()))


def run_series(cluster: Cluster, run: str, ns: str = "default") -> dict[str, dict[tuple, float]]:
    """The operator's per-run series of one run: {metric: {labels other than namespace/run: value}}."""
    out: dict[str, dict[tuple, float]] = {}
    for fam in families():
        for s in fam.samples:
            if s.labels.get("run") == run and s.labels.get("namespace") == ns:
                rest = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("namespace", "run")))
                out.setdefault(s.name, {})[rest] = s.value
    return out


def wait_run_series(cluster: Cluster, run: str, phase: str, restarts: int) -> dict[str, dict[tuple, float]]:
    """Wait until the per-run series show `phase` (1, every other phase 0) and `restarts`."""
    want = {("phase", p): float(p == phase) for p in PHASES}

    def ready():
        series = run_series(cluster, run)
        phases = {k[0]: v for k, v in series.get("trainingrun_operator_run_phase", {}).items()}
        ok = phases == want and series.get("trainingrun_operator_run_restarts") == {(): restarts}
        return series if ok else None

    return wait_for(ready, 15, f"per-run series of {run}: phase {phase}, restarts {restarts} "
                               f"(now {run_series(cluster, run)})")


def test_per_run_metrics_follow_phase_and_restarts_and_go_with_the_run(cluster):
    make_run(cluster, "eta", failurePolicy={"maxRestarts": 1, "backoffSeconds": 0})
    cluster.wait_phase("eta", "Pending")
    series = wait_run_series(cluster, "eta", "Pending", 0)
    assert series["trainingrun_operator_run_step"] == {(): 0}  # status.step before any progress
    cluster.run_all("eta", 0)
    wait_run_series(cluster, "eta", "Running", 0)
    cluster.set_pod("eta-trainer-0-a0", "Failed", exit_code=1)
    cluster.wait_group("eta", 1)
    assert cluster.status("eta")["restarts"] == 1
    cluster.run_all("eta", 1)
    wait_run_series(cluster, "eta", "Running", 1)
    cluster.set_pod("eta-trainer-1-a1", "Failed", exit_code=2)
    cluster.wait_phase("eta", "Failed")
    wait_run_series(cluster, "eta", "Failed", 1)
    # the aggregate gauge still counts it
    runs = {s.labels["phase"]: s.value for fam in families() for s in fam.samples if s.name == "trainingrun_operator_runs"}
    assert runs["Failed"] >= 1

    cluster.delete(cluster.tr_path("eta"))
    wait_for(lambda: cluster.run("eta") is None, 15, "the run to be deleted")
    wait_for(lambda: run_series(cluster, "eta") == {}, 10, f"no series of eta (now {run_series(cluster, 'eta')})")


def test_kueue_pod_group_waits_for_admission(cluster):
    """spec.queueName: the pods carry Kueue's pod-group labels (per attempt) and wait, gated, until Kueue admits the
    workload; the run says so meanwhile (here the emulator plays Kueue's webhook and its admission)."""
    def kueue_webhook(request, obj):
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if request.resource.plural == "pods" and "kueue.x-k8s.io/queue-name" in labels:
            obj["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]

    cluster.emulator.admission.append(kueue_webhook)
    try:
        make_run(cluster, "kappa", queueName="team-a")
        pods = cluster.wait_group("kappa", 0)
    finally:
        cluster.emulator.admission.remove(kueue_webhook)
    for pod in pods:
        labels = pod["metadata"]["labels"]
        assert labels["kueue.x-k8s.io/queue-name"] == "team-a" and labels["kueue.x-k8s.io/pod-group-name"] == "kappa-a0"
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "3"
    ready = wait_for(lambda: (lambda c: c if c.get("reason") == "WaitingForAdmission" else None)(
        cluster.condition("kappa", "PodsReady")), 10, f"WaitingForAdmission (now {cluster.status('kappa')})")
    assert "team-a" in ready["message"] and cluster.status("kappa")["phase"] == "Pending"
    for pod in pods:  # Kueue admits the workload: gates removed, the scheduler places the pods
        cluster.patch(f"/api/v1/namespaces/default/pods/{pod['metadata']['name']}", {"spec": {"schedulingGates": None}})
    cluster.run_all("kappa", 0)
    # a restart is a new pod group (a new workload); the old group's pods are marked so Kueue frees its quota
    cluster.set_pod("kappa-trainer-1-a0", "Failed", exit_code=1)
    new = cluster.wait_group("kappa", 1)
    assert {p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] for p in new} == {"kappa-a1"}
    for name in ("kappa-rollout-a0", "kappa-trainer-0-a0"):
        versions = cluster.history("pods", name)
        assert cluster.get(f"/api/v1/namespaces/default/pods/{name}") is None
        assert versions[-1]["metadata"]["annotations"]["kueue.x-k8s.io/retriable-in-group"] == "false"


def test_gang_scheduling_podgroup_per_attempt(cluster):
    """Volcano gang scheduling: the attempt's PodGroup exists before its pods; a restart replaces it; without the
    PodGroup API (404) the run reports it and creates no pod."""
    import kmock

    make_run(cluster, "pg-missing", gangScheduling={"enabled": True, "provider": "volcano"})
    wait_for(lambda: "not served" in (cluster.status("pg-missing").get("message") or ""), 10,
             f"the missing PodGroup API in the message (now {cluster.status('pg-missing')})")
    assert cluster.group_pods("pg-missing", 0) == [] and "FailedCreate" in cluster.reasons("pg-missing")
    cluster.emulator.resources["scheduling.volcano.sh/v1beta1/podgroups"] = kmock.ResourceInfo(
        kind="PodGroup", namespaced=True, verbs={"get", "list", "watch", "create", "delete", "patch"})
    pods = cluster.wait_group("pg-missing", 0, timeout=30)  # retried with backoff until the API exists
    pg_path = "/apis/scheduling.volcano.sh/v1beta1/namespaces/default/podgroups"
    pg = cluster.get(f"{pg_path}/pg-missing-a0")
    assert pg["spec"]["minMember"] == 3 and int(pg["metadata"]["resourceVersion"]) < min(
        int(p["metadata"]["resourceVersion"]) for p in pods)
    assert all(p["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "pg-missing-a0" for p in pods)
    cluster.run_all("pg-missing", 0)
    cluster.set_pod("pg-missing-trainer-0-a0", "Failed", exit_code=1)
    cluster.wait_group("pg-missing", 1)
    assert cluster.get(f"{pg_path}/pg-missing-a1") is not None
    wait_for(lambda: cluster.get(f"{pg_path}/pg-missing-a0") is None, 10, "the old attempt's PodGroup deleted")
