"""The operator against an API server that behaves like a real cluster under faults: refused creates, pods stuck
Terminating on a lost node, evictions, a store the operator cannot read, an admission plugin that checks owner
references, a status the CRD schema refuses. One scenario per test, on its own TrainingRun; the operator runs
in-process (tests/kube.py `InProcessOperator`) against the KMock emulator with the fidelity layer.
"""

from __future__ import annotations

import pytest

from tests.kube import Cluster
from tests.services import wait_for
from trainingrun.api.constants import LABEL_NAME, LABEL_RUN


@pytest.fixture(scope="module")
def kube():
    with Cluster() as c, c.operator(interval=0.5) as op:
        c.op = op
        yield c


def env_of(pod: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}


def rv(obj: dict) -> int:
    return int(obj["metadata"]["resourceVersion"])


def test_refused_configmap_and_service_are_created_later_and_pods_wait_for_them(kube):
    """Defect 1: a child refused once (a webhook timeout, quota, an operator restart between status write and
    create) is created on a later reconcile; no pod exists before the ConfigMap it mounts and the Service its
    MASTER_ADDR resolves through."""
    ns = "d1"
    kube.new_run("d1", ns)  # creates the namespace
    kube.delete(kube.tr_path("d1", ns))
    wait_for(lambda: kube.run("d1", ns) is None, 10, "the first run gone")
    assert kube.emulator is not None
    kube.emulator.refuse("configmaps", ns, 500, "InternalError", "Internal error occurred: failed calling webhook "
                         '"validate.example.com": context deadline exceeded', times=2)
    kube.emulator.refuse("services", ns, 403, "Forbidden", 'services "d1-trainers" is forbidden: exceeded quota: '
                         "svc, requested: services=1, used: services=10, limited: services=10", times=2)
    kube.new_run("d1", ns)
    cm = wait_for(lambda: kube.get(f"/api/v1/namespaces/{ns}/configmaps/d1-config"), 20, "the ConfigMap")
    svc = wait_for(lambda: kube.get(f"/api/v1/namespaces/{ns}/services/d1-trainers"), 20, "the headless Service")
    pods = kube.wait_group("d1", 0, ns=ns)
    # pods were created only after what they mount and resolve existed
    assert min(rv(p) for p in pods) > max(rv(cm), rv(svc))
    assert "FailedCreate" in kube.reasons("d1", ns)
    kube.run_all("d1", 0, ns)


def test_permanent_refusal_fails_the_run_transient_is_retried(kube):
    """Defect 2: 422 Invalid from the API server (here: a validating webhook) fails the run with the server's
    message; a 429 is retried with a FailedCreate event until it passes."""
    ns = "d2"
    kube.new_run("d2-ok", ns)
    kube.wait_group("d2-ok", 0, ns=ns)
    lift = kube.emulator.refuse("pods", ns, 422, "Invalid", 'admission webhook "policy.example.com" denied the '
                                "request: spec.containers[0].image: Invalid value: images must come from "
                                "registry.example.com")
    kube.new_run("d2", ns)
    st = kube.wait_phase("d2", "Failed", ns)
    lift()
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "InvalidSpec"
    assert "registry.example.com" in st["message"] and "Pod" in st["message"]
    assert "InvalidSpec" in kube.reasons("d2", ns)
    # transient: 429 twice, then created
    kube.emulator.refuse("pods", ns, 429, "TooManyRequests", "the server has received too many requests and has "
                         "asked us to try again later", times=2)
    kube.new_run("d2-busy", ns)
    kube.wait_group("d2-busy", 0, ns=ns, timeout=30)
    assert kube.status("d2-busy", ns)["phase"] == "Pending"


def test_pod_stuck_terminating_stops_blocking_after_the_timeout(kube):
    """Defect 3: a pod of the old attempt held in Terminating (a lost node) blocks the restart only for
    failurePolicy.terminatingTimeoutSeconds, and the message names it meanwhile. Every pod knows its attempt, and
    trainer hostnames are per attempt (the rendezvous name never resolves to a dying pod)."""
    kube.new_run("d3", failurePolicy={"maxRestarts": 2, "backoffSeconds": 0, "terminatingTimeoutSeconds": 3})
    kube.run_all("d3", 0)
    held = "d3-trainer-1-a0"
    kube.patch(f"/api/v1/namespaces/default/pods/{held}", {"metadata": {"finalizers": ["test.example.com/lost-node"]}})
    kube.set_pod("d3-trainer-0-a0", "Failed", exit_code=1)
    wait_for(lambda: held in (kube.status("d3").get("message") or ""), 10,
             f"the message naming the pod still terminating (now {kube.status('d3')})")
    assert kube.get(f"/api/v1/namespaces/default/pods/{held}")["metadata"]["deletionTimestamp"]
    assert kube.group_pods("d3", 1) == []
    pods = kube.wait_group("d3", 1, timeout=15)  # after terminatingTimeoutSeconds
    assert kube.get(f"/api/v1/namespaces/default/pods/{held}") is not None  # still there: it no longer blocks
    assert "TerminatingTimeout" in kube.reasons("d3")
    for pod in pods:
        env, labels = env_of(pod), pod["metadata"]["labels"]
        assert env["TRAININGRUN_ATTEMPT"] == labels["trainingrun.dev/attempt"] == "1"
        if labels["trainingrun.dev/role"] == "trainer":
            assert pod["spec"]["hostname"] == f"trainer-{labels['trainingrun.dev/rank']}-a1"
            assert env["MASTER_ADDR"] == "trainer-0-a1.d3-trainers.default.svc"
    kube.patch(f"/api/v1/namespaces/default/pods/{held}", {"metadata": {"finalizers": None}})


def test_evictions_restart_without_using_the_restart_budget(kube):
    """Defect 4: a node-pressure eviction (pod Failed, reason Evicted) and an Eviction-API eviction (condition
    DisruptionTarget, then deleted) each restart the group without using maxRestarts (0 here), counted in
    status.disruptions; an application failure then fails the run."""
    kube.new_run("d4", failurePolicy={"maxRestarts": 0, "backoffSeconds": 0})
    kube.run_all("d4", 0)
    kube.set_pod("d4-trainer-1-a0", "Failed", exit_code=137, pod_reason="Evicted")
    kube.run_all("d4", 1)
    st = kube.status("d4")
    assert st["restarts"] == 0 and st["disruptions"] == 1 and st["attempt"] == 1
    disrupted = [e["message"] for e in kube.events("d4") if e.get("reason") == "Disrupted"]
    assert len(disrupted) == 1 and "d4-trainer-1-a0" in disrupted[0] and "Evicted" in disrupted[0]
    kube.evict("d4-trainer-0-a1")  # (an evicted rollout restarts alone: test_operator_roles.py)
    kube.run_all("d4", 2)
    st = kube.status("d4")
    assert st["restarts"] == 0 and st["disruptions"] == 2
    kube.set_pod("d4-trainer-0-a2", "Failed", exit_code=1)
    st = kube.wait_phase("d4", "Failed")
    assert st["disruptions"] == 2 and "maxRestarts" in st["message"]


def test_trainers_succeeded_and_rollout_failed_in_one_observation_is_success(kube):
    """Defect 5: success of every trainer wins over a failure seen in the same observation (here: the operator was
    down while the pods finished)."""
    kube.new_run("d5")
    kube.run_all("d5", 0)
    kube.op.stop()
    kube.set_pod("d5-rollout-a0", "Failed", exit_code=1)
    kube.set_pod("d5-trainer-0-a0", "Succeeded")
    kube.set_pod("d5-trainer-1-a0", "Succeeded")
    kube.op.start()
    st = kube.wait_phase("d5", "Succeeded")
    assert st["restarts"] == 0 and st["attempt"] == 0
    assert kube.group_pods("d5", 1) == []


def test_unreadable_progress_is_unknown_not_a_hang(kube, redis):
    """Defect 6: a store the operator cannot read (here: Redis with a password the operator lacks) is reported as
    ProgressUnknown with the error, and the progress deadline does not count that time; once progress can be read
    again, the deadline counts again."""
    import time

    import redis as redis_py

    from trainingrun.store import open_store

    kube.new_run("d6", store={"url": redis.url},
                 failurePolicy={"maxRestarts": 0, "backoffSeconds": 0, "progressDeadlineSeconds": 4})
    kube.run_all("d6", 0)
    store = open_store(env_of(kube.pods("d6", role="trainer")[0])["TRAININGRUN_STORE_URL"])
    store.put_json("progress", {"step": 3, "samples_consumed": 30, "last_global_batch_size": 10, "rollout": 0,
                                "attempt": 0, "time": time.time()})
    wait_for(lambda: kube.status("d6").get("step") == 3, 10, "progress in the status")
    admin = redis_py.Redis(port=redis.port)
    admin.config_set("requirepass", "s3cret")
    admin.client_kill_filter(_type="normal", skipme=True)  # connections made before the password must log in again
    cond = wait_for(lambda: (lambda c: c if c.get("status") == "True" else None)(kube.condition("d6", "ProgressUnknown")),
                    10, f"a ProgressUnknown condition (now {kube.status('d6')})")
    assert "auth" in cond["message"].lower(), cond
    kube.op.settle("d6", count=12)  # 6 s of reconciles > progressDeadlineSeconds, progress unreadable throughout
    st = kube.status("d6")
    assert st["phase"] == "Running" and st["restarts"] == 0, st
    # readable again (no new step since): the deadline counts from then and fires
    admin = redis_py.Redis(port=redis.port, password="s3cret")
    admin.config_set("requirepass", "")
    wait_for(lambda: kube.condition("d6", "ProgressUnknown").get("status") == "False", 10, "progress readable")
    st = kube.wait_phase("d6", "Failed", timeout=15)
    assert "no progress" in st["message"] and "last step 3" in st["message"]
    store.close()


def test_pods_are_watched_with_a_server_side_label_selector(kube):
    """Defect 7: the operator's pod watch asks the API server for the run's pods only."""
    params = kube.emulator.watch_params.get("/v1/pods") or {}
    selector = params.get("labelSelector", "")
    assert f"{LABEL_NAME}=trainingrun" in selector and LABEL_RUN in selector, params


def test_owner_references_permission_enforcement_allows_the_operators_creates(kube):
    """Defect 8: with OwnerReferencesPermissionEnforcement (OpenShift), children with blockOwnerDeletion need
    update on trainingruns/finalizers: the chart's rules grant it, so the run gets its pods."""
    from trainingrun.operator import rbac

    off = kube.emulator.enforce_owner_references(list(rbac.RULES))
    try:
        kube.new_run("d8", "d8")
        kube.wait_group("d8", 0, ns="d8")
        assert kube.get("/api/v1/namespaces/d8/configmaps/d8-config") is not None
    finally:
        off()


def test_long_messages_fit_the_crd_and_conditions_follow_conventions(kube):
    """Defect 9: a message longer than the CRD allows (here: 40 invalid volumes) is cut to fit, so the status patch
    is accepted and the run fails visibly; conditions carry observedGeneration; a Pending run says why in a
    condition."""
    volumes = [{"name": "config", "emptyDir": {}} for _ in range(40)]
    kube.new_run("d9", podTemplate={"volumes": volumes})
    st = kube.wait_phase("d9", "Failed")
    assert "spec.podTemplate.volumes[0].name" in st["message"] and len(st["message"]) <= 4096
    failed = kube.condition("d9", "Failed")
    assert failed["reason"] == "InvalidSpec" and failed["observedGeneration"] == 1
    kube.new_run("d9-pending")
    kube.wait_group("d9-pending", 0)
    ready = wait_for(lambda: (lambda c: c if c.get("reason") == "WaitingForPods" else None)(
        kube.condition("d9-pending", "PodsReady")), 10, "a PodsReady condition saying the run waits for its pods")
    assert ready["status"] == "False" and "waiting for 3 pod(s)" in ready["message"]
