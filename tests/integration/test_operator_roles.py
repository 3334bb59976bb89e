"""Failure rules per role (spec.failurePolicy.rules, RestartRole) and the other part-two behaviours of the operator,
scenario by scenario against the KMock emulator with the fidelity layer (tests/kube.py): the rollout and the engine
restarted alone, rules by exit code and reason, budgets and terminal states that live only in the TrainingRun's
status (children deleted by hand or by a TTL never reset them), a replacement that waits for its terminating
predecessor under Kueue, an engine that gets ready late, spec.managedBy, gang provider kubernetes, and a status write
lost to a conflict. The operator runs in-process (`InProcessOperator`).
"""

from __future__ import annotations

import kmock
import pytest

from tests.kube import Cluster
from tests.services import wait_for

POD = "/api/v1/namespaces/default/pods/"
FAST = {"backoffSeconds": 0}


@pytest.fixture(scope="module")
def kube():
    with Cluster() as c, c.operator(interval=0.5) as op:
        c.op = op
        yield c


def uid(pod: dict) -> str:
    return pod["metadata"]["uid"]


def role_entry(kube: Cluster, run: str, role: str, replica: int = 0) -> dict:
    return next((e for e in kube.status(run).get("roleRestarts") or []
                 if e["role"] == role and e.get("replica", 0) == replica), {})


def test_rollout_restarts_alone_on_its_own_budget_and_deleted_children_reset_nothing(kube):
    """Default rule 3: a failed rollout is replaced alone (R-rollout-a0-r1, same attempt) while the trainers keep
    running, counted in status.roleRestarts against failurePolicy.roles.rollout.maxRestarts (not maxRestarts, 0
    here); deleting the failed pods by hand (or a TTL) neither resets that budget nor re-runs the failed run.
    Fails on the code before rules (a rollout failure restarted the group, so maxRestarts 0 failed the run)."""
    kube.new_run("ro", failurePolicy={**FAST, "maxRestarts": 0, "roles": {"rollout": {"maxRestarts": 1}}})
    kube.run_all("ro", 0)
    trainers = {p["metadata"]["name"]: uid(p) for p in kube.pods("ro", role="trainer")}
    kube.set_pod("ro-rollout-a0", "Failed", exit_code=1)
    wait_for(lambda: kube.get(POD + "ro-rollout-a0-r1"), 15, "the rollout's replacement")
    st = kube.status("ro")
    assert st["attempt"] == 0 and st["restarts"] == 0
    entry = role_entry(kube, "ro", "rollout")
    assert entry["restarts"] == 1 and "ro-rollout-a0" in entry["lastFailure"]
    assert {p["metadata"]["name"]: uid(p) for p in kube.pods("ro", role="trainer") if kube.live_pod(p["metadata"]["name"])
            } == trainers, "the trainers were not touched"
    assert "RestartingRole" in kube.reasons("ro") and "RoleRestarted" in kube.reasons("ro")
    replacement = kube.get(POD + "ro-rollout-a0-r1")
    env = {e["name"]: e.get("value") for e in replacement["spec"]["containers"][0]["env"]}
    assert env["TRAININGRUN_ATTEMPT"] == "0" and env["TRAININGRUN_ROLE_ATTEMPT"] == "1"
    assert replacement["metadata"]["labels"]["trainingrun.dev/role-attempt"] == "1"
    kube.set_pod("ro-rollout-a0-r1", "Running")
    wait_for(lambda: kube.condition("ro", "PodsReady").get("status") == "True", 10, "PodsReady again")
    # the failed pod deleted by hand (or by a TTL controller): the budget stays used
    kube.delete(POD + "ro-rollout-a0")
    kube.op.settle("ro")
    assert role_entry(kube, "ro", "rollout")["restarts"] == 1 and kube.status("ro")["phase"] == "Running"
    # the second failure spends the role's budget: the run fails, naming it
    kube.set_pod("ro-rollout-a0-r1", "Failed", exit_code=1)
    st = kube.wait_phase("ro", "Failed")
    assert "failurePolicy.roles.rollout.maxRestarts" in st["message"] and "ro-rollout-a0-r1" in st["message"]
    # every pod of the failed run deleted by hand: still Failed, nothing re-created, the counters kept
    wait_for(lambda: all(kube.live_pod(n) is None for n in trainers), 10, "the failed run's live pods deleted")
    for pod in kube.pods("ro"):
        kube.delete(POD + pod["metadata"]["name"])
    kube.op.settle("ro")
    st = kube.status("ro")
    assert st["phase"] == "Failed" and role_entry(kube, "ro", "rollout")["restarts"] == 1
    assert [p["metadata"]["name"] for p in kube.pods("ro")] == []


def test_rules_by_exit_code_and_reason_first_match_wins(kube):
    """failurePolicy.rules: a rollout exit code 3 restarts the whole group (rule 0, before default rule 3); an
    OOMKilled trainer fails the run at once (rule 1) although the group budget is not spent; the message cites the
    rule."""
    kube.new_run("rules", failurePolicy={**FAST, "maxRestarts": 5, "rules": [
        {"name": "bad-shard", "roles": ["rollout"], "exitCodes": [3], "action": "RestartGroup"},
        {"name": "oom", "roles": ["trainer"], "reasons": ["OOMKilled"], "action": "FailRun"}]})
    kube.run_all("rules", 0)
    kube.set_pod("rules-rollout-a0", "Failed", exit_code=3)
    kube.run_all("rules", 1)
    st = kube.status("rules")
    assert st["restarts"] == 1 and not st.get("roleRestarts")
    kube.set_pod("rules-trainer-1-a1", "Failed", exit_code=137, reason="OOMKilled")
    st = kube.wait_phase("rules", "Failed")
    assert "failurePolicy.rules[1] (oom)" in st["message"] and "rules-trainer-1-a1" in st["message"]
    assert st["restarts"] == 1


def test_replacement_waits_for_its_terminating_predecessor_under_kueue(kube):
    """A rollout evicted under Kueue whose pod still terminates (a finalizer, a slow shutdown): its replacement is
    created only once it is gone (two rollout writers at once; Kueue would delete the group's excess pod), in the
    same pod group, without using a budget (a disruption)."""
    kube.new_run("kq", queueName="team-a", failurePolicy={**FAST, "maxRestarts": 0})
    kube.run_all("kq", 0)
    kube.patch(POD + "kq-rollout-a0", {"metadata": {"finalizers": ["example.com/hold"]}})
    kube.evict("kq-rollout-a0")
    wait_for(lambda: "TerminatingPods" == kube.condition("kq", "PodsReady").get("reason"), 10,
             f"waiting for the terminating rollout (now {kube.status('kq')})")
    kube.op.settle("kq")
    assert kube.get(POD + "kq-rollout-a0-r1") is None
    kube.patch(POD + "kq-rollout-a0", {"metadata": {"finalizers": None}})
    new = wait_for(lambda: kube.get(POD + "kq-rollout-a0-r1"), 15, "the replacement once the old pod is gone")
    assert new["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "kq-a0"
    assert "kueue.x-k8s.io/retriable-in-group" not in (new["metadata"].get("annotations") or {})
    st = kube.status("kq")
    assert st["restarts"] == 0 and st["attempt"] == 0 and role_entry(kube, "kq", "rollout")["uncounted"] == 1


ENGINE_RUN = {
    "model": {"hf": "/models/smol", "seqLength": 64},
    "podTemplate": {"volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
                    "volumeMounts": [{"name": "models", "mountPath": "/models"}]},
    "rollout": {"source": {"type": "generate", "generate": {
        "prompts": {"type": "synthetic", "synthetic": {"task": "copy", "minLength": 2, "maxLength": 2}},
        "sampling": {"maxNewTokens": 4}, "reward": {"type": "token_match"}}},
        "engine": {"type": "vllm"}, "samplesPerRollout": 8, "groupSize": 4, "numRollouts": 3},
    "trainer": {"replicas": 2, "gpusPerReplica": 0, "maxTokensPerGPU": 256, "lossType": "ppo"},
    "weightSync": {"type": "disk", "path": "/models/weights"},
}


def test_engine_ready_late_then_restarted_alone(kube):
    """The run's vLLM server (R-engine-0): Running but not ready keeps the run Pending (PodsReady False,
    WaitingForEngine) without failing it; a failed engine is replaced alone (R-engine-0-r1) on
    failurePolicy.roles.engine, the rollout and the trainers untouched, the event naming replica 0."""
    kube.new_run("eng", failurePolicy={**FAST, "maxRestarts": 0, "roles": {"engine": {"maxRestarts": 2}}},
                 **ENGINE_RUN)
    engine = wait_for(lambda: kube.get(POD + "eng-engine-0"), 15, f"the engine pod (now {kube.status('eng')})")
    kube.set_pod("eng-store", "Running")
    for pod in kube.wait_group("eng", 0):
        kube.set_pod(pod["metadata"]["name"], "Running")
    kube.patch(POD + "eng-engine-0/status", {"status": {"phase": "Running", "containerStatuses": [{
        "name": engine["spec"]["containers"][0]["name"], "ready": False, "restartCount": 0,
        "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]}})
    ready = wait_for(lambda: (lambda c: c if c.get("reason") == "WaitingForEngine" else None)(
        kube.condition("eng", "PodsReady")), 10, f"WaitingForEngine (now {kube.status('eng')})")
    assert "eng-engine-0" in ready["message"] and ready["status"] == "False"
    kube.op.settle("eng")
    assert kube.status("eng")["phase"] == "Pending"  # late, not failed
    kube.set_pod("eng-engine-0", "Running")  # ready at last
    kube.wait_phase("eng", "Running")
    assert kube.condition("eng", "PodsReady").get("status") == "True"
    others = {p["metadata"]["name"]: uid(p) for p in kube.group_pods("eng", 0)}
    kube.set_pod("eng-engine-0", "Failed", exit_code=1)
    new = wait_for(lambda: kube.get(POD + "eng-engine-0-r1"), 15, "the engine's replacement")
    assert new["spec"]["restartPolicy"] == "Never" and new["metadata"]["labels"]["trainingrun.dev/replica"] == "0"
    assert {p["metadata"]["name"]: uid(p) for p in kube.group_pods("eng", 0)} == others
    st = kube.status("eng")
    assert st["restarts"] == 0 and st["attempt"] == 0 and role_entry(kube, "eng", "engine")["restarts"] == 1
    assert any("engine replica 0" in e["message"] for e in kube.events("eng") if e.get("reason") == "RestartingRole")
    kube.set_pod("eng-engine-0-r1", "Running")
    wait_for(lambda: kube.condition("eng", "PodsReady").get("status") == "True", 10, "PodsReady after the restart")


def test_engine_pool_replicas_restart_alone_and_leave_the_pool_beyond_the_budget(kube):
    """rollout.engine.replicas 2 (issue 20 through issue 22's mechanism): two engine pods R-engine-0/1 behind the
    headless Service R-engine (hostnames engine-<i>), each in the run's Kueue queue and its own pod group R-engine,
    gated by Kueue like the attempt's pods; engine-1 failing is replaced alone (R-engine-1-r1) on
    failurePolicy.roles.engine, engine-0, the rollout and the trainers untouched; failing again with the budget spent
    it leaves the pool (status.roleRestarts down, EngineDown) and the run goes on; engine-0 failing then fails the
    run naming both engine pods."""
    def kueue_webhook(request, obj):
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if request.resource.plural == "pods" and "kueue.x-k8s.io/queue-name" in labels:
            obj["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]

    spec = {**ENGINE_RUN, "rollout": {**ENGINE_RUN["rollout"], "engine": {"type": "vllm", "replicas": 2}}}
    kube.emulator.admission.append(kueue_webhook)
    try:
        kube.new_run("pl", queueName="team-a",
                     failurePolicy={**FAST, "maxRestarts": 0, "roles": {"engine": {"maxRestarts": 1}}}, **spec)
        engines = [wait_for(lambda i=i: kube.get(POD + f"pl-engine-{i}"), 15, f"engine pod {i}") for i in (0, 1)]
        group = kube.wait_group("pl", 0)
    finally:
        kube.emulator.admission.remove(kueue_webhook)
    service = kube.get("/api/v1/namespaces/default/services/pl-engine")
    assert service["spec"]["clusterIP"] == "None"
    for i, pod in enumerate(engines):
        labels = pod["metadata"]["labels"]
        assert labels["kueue.x-k8s.io/queue-name"] == "team-a" and labels["kueue.x-k8s.io/pod-group-name"] == "pl-engine"
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "2"
        assert pod["spec"]["schedulingGates"] == [{"name": "kueue.x-k8s.io/admission"}]
        assert pod["spec"]["hostname"] == f"engine-{i}" and pod["spec"]["subdomain"] == "pl-engine"
        assert pod["spec"]["restartPolicy"] == "Never" and labels["trainingrun.dev/replica"] == str(i)
    rollout = next(p for p in group if p["metadata"]["labels"]["trainingrun.dev/role"] == "rollout")
    env = {e["name"]: e.get("value") for e in rollout["spec"]["containers"][0]["env"]}
    assert env["TRAININGRUN_ENGINE_URL"].split(",") == [
        f"http://engine-{i}.pl-engine.default.svc:8000" for i in (0, 1)]
    for pod in [*engines, *group]:  # Kueue admits the workloads: gates removed
        kube.patch(POD + pod["metadata"]["name"], {"spec": {"schedulingGates": None}})
    kube.set_pod("pl-store", "Running")
    for name in ("pl-engine-0", "pl-engine-1"):
        kube.set_pod(name, "Running")
    kube.run_all("pl", 0)
    kube.wait_phase("pl", "Running")
    others = {p["metadata"]["name"]: uid(p) for p in [*kube.group_pods("pl", 0), kube.get(POD + "pl-engine-0")]}
    kube.set_pod("pl-engine-1", "Failed", exit_code=1)
    new = wait_for(lambda: kube.get(POD + "pl-engine-1-r1"), 15, "engine-1's replacement")
    assert new["spec"]["hostname"] == "engine-1" and new["metadata"]["labels"]["trainingrun.dev/role-attempt"] == "1"
    assert {p["metadata"]["name"]: uid(p) for p in [*kube.group_pods("pl", 0), kube.get(POD + "pl-engine-0")]
            } == others, "engine-0, the rollout and the trainers were not touched"
    assert role_entry(kube, "pl", "engine", 1)["restarts"] == 1 and kube.status("pl")["restarts"] == 0
    kube.set_pod("pl-engine-1-r1", "Running")
    kube.set_pod("pl-engine-1-r1", "Failed", exit_code=1)  # the engine role's budget (1) is spent
    wait_for(lambda: role_entry(kube, "pl", "engine", 1).get("down"), 15, f"engine-1 out of the pool "
             f"(now {kube.status('pl')})")
    kube.op.settle("pl")
    st = kube.status("pl")
    assert st["phase"] == "Running" and st["attempt"] == 0, st
    assert "EngineDown" in kube.reasons("pl") and kube.get(POD + "pl-engine-1-r2") is None
    assert {p["metadata"]["name"]: uid(p) for p in [*kube.group_pods("pl", 0), kube.get(POD + "pl-engine-0")]
            } == others
    kube.set_pod("pl-engine-0", "Failed", exit_code=3)
    failed = kube.wait_phase("pl", "Failed")
    assert "pl-engine-0" in failed["message"] and "pl-engine-1-r1" in failed["message"], failed


def test_managed_by_another_controller_is_left_alone(kube):
    """spec.managedBy kueue.x-k8s.io/multikueue: the operator creates nothing, adds no finalizer and writes no
    status (MultiKueue runs it on a worker cluster); a run managed by the operator's own name runs as usual."""
    kube.new_run("mk", managedBy="kueue.x-k8s.io/multikueue")
    kube.new_run("mk-own", managedBy="trainingrun.dev/operator")
    kube.wait_group("mk-own", 0)
    run = kube.run("mk")
    assert kube.pods("mk") == [] and not run.get("status") and not run["metadata"].get("finalizers")
    assert kube.items("/api/v1/namespaces/default/configmaps", "trainingrun.dev/run=mk") == []


def test_gang_provider_kubernetes_waits_for_the_api_then_links_pods(kube):
    """gangScheduling provider kubernetes: without scheduling.k8s.io served the run says so (FailedCreate) and creates
    no pod; once v1alpha2 is served, the attempt's Workload and PodGroup exist before its pods, which name the
    PodGroup in spec.schedulingGroup."""
    kube.new_run("kg", gangScheduling={"enabled": True, "provider": "kubernetes"},
                 podTemplate={"priorityClassName": "training"})
    wait_for(lambda: "scheduling.k8s.io" in (kube.status("kg").get("message") or ""), 10,
             f"the missing API in the message (now {kube.status('kg')})")
    assert kube.group_pods("kg", 0) == [] and "FailedCreate" in kube.reasons("kg")
    for plural, kind in (("workloads", "Workload"), ("podgroups", "PodGroup")):
        kube.emulator.resources[f"scheduling.k8s.io/v1alpha2/{plural}"] = kmock.ResourceInfo(
            kind=kind, namespaced=True, verbs={"get", "list", "watch", "create", "delete", "patch"})
    pods = kube.wait_group("kg", 0, timeout=40)
    base = "/apis/scheduling.k8s.io/v1alpha2/namespaces/default"
    workload, group = kube.get(f"{base}/workloads/kg-a0"), kube.get(f"{base}/podgroups/kg-a0")
    template = workload["spec"]["podGroupTemplates"][0]
    assert template["schedulingPolicy"]["gang"]["minCount"] == 3 and template["priorityClassName"] == "training"
    assert template["disruptionMode"] == "PodGroup" and group["spec"]["schedulingPolicy"]["gang"]["minCount"] == 3
    assert max(int(workload["metadata"]["resourceVersion"]), int(group["metadata"]["resourceVersion"])) < min(
        int(p["metadata"]["resourceVersion"]) for p in pods)
    assert all(p["spec"]["schedulingGroup"] == {"podGroupName": "kg-a0"} for p in pods)


def test_counters_survive_a_lost_status_write_and_operator_restarts(kube):
    """A status write lost to a conflict (409) right after a failure, and an operator restart after it: the restart
    is decided once, status.restarts and status.attempt only grow, and no second attempt starts."""
    kube.new_run("cf", failurePolicy={**FAST, "maxRestarts": 3})
    kube.run_all("cf", 0)
    refused = kube.emulator.refuse_update("trainingruns", "default", "cf", 409, "Conflict", "Operation cannot be "
                                          'fulfilled on trainingruns.trainingrun.dev "cf": the object has been '
                                          "modified; please apply your changes to the latest version and try again",
                                          subresource="status")
    try:
        kube.set_pod("cf-trainer-0-a0", "Failed", exit_code=1)
        kube.run_all("cf", 1)
    finally:
        kube.emulator.update_admission.clear()
    assert refused() == 1
    kube.op.restart()
    kube.op.settle("cf")
    seen = [(v.get("status") or {}).get("restarts", 0) for v in kube.history("trainingruns", "cf")]
    attempts = [(v.get("status") or {}).get("attempt", 0) for v in kube.history("trainingruns", "cf")]
    assert seen == sorted(seen) and attempts == sorted(attempts), (seen, attempts)
    st = kube.status("cf")
    assert st["restarts"] == 1 and st["attempt"] == 1 and st["phase"] == "Running"
    assert kube.group_pods("cf", 2) == [] and kube.reasons("cf").count("Restarting") == 1
