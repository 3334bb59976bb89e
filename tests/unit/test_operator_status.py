"""The rules of `trainingrun.operator.status.decide`, one case per rule, in the order of the module docstring: the
sticky terminal phases, the rules every non-terminal phase checks first, then the phase handlers' one-rule helpers.
Pure: observations in, the next status and actions out (no API server)."""

from __future__ import annotations

import copy
import datetime as dt

import yaml

from tests.kube import ROOT
from trainingrun.api import parse_trainingrun
from trainingrun.api.constants import LABEL_ATTEMPT, LABEL_RANK, LABEL_REPLICA, LABEL_ROLE, LABEL_ROLE_ATTEMPT
from trainingrun.operator import status, vocabulary
from trainingrun.operator.observe import Observed, PodObs, ProgressObs, Refusal, observe_pod
from trainingrun.contract.errors import EXIT_CONFIG_ERROR

TINY = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)


def run_of(**spec):
    doc = copy.deepcopy(TINY)
    doc["spec"].update(spec)
    return parse_trainingrun(doc)


def pods_of(run, attempt, phase="Running", **overrides):
    out = []
    for role, rank in status.expected_group(run):
        name = vocabulary.Names(run.metadata.name).pod(role, rank, attempt)
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


def _pods(ds):
    return [c for c in ds.create if c.kind == "Pod" and c.role in ("rollout", "trainer")]


def _running(run):
    st = status.decide(run, None, Observed(), now=T0).status
    return decide(run, st, pods_of(run, 0)).status


def _restarting(run, failed_pod="tiny-trainer-1-a0"):
    """The status right after the running attempt 0 lost `failed_pod` (a counted restart)."""
    return decide(run, _running(run), pods_of(run, 0, **{failed_pod: "Failed"})).status


def _watched():
    """A running run with progressDeadlineSeconds 60, and the store's progress: step 3, written at 50 s."""
    run = run_of(failurePolicy={"maxRestarts": 0, "progressDeadlineSeconds": 60}, activeDeadlineSeconds=3600,
                 ttlSecondsAfterFinished=30)
    return run, _running(run), ProgressObs({"step": 3, "time": (T0 + dt.timedelta(seconds=50)).timestamp()})


def _engine_run(max_restarts: int = 3, replicas: int = 1):
    """A run with the vLLM engine and no engine.url: the operator runs its servers (R-engine-<i>)."""
    return parse_trainingrun({
        "apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "rl"},
        "spec": {"model": {"hf": "/models/smol", "seqLength": 512}, "trainer": {"replicas": 2, "maxTokensPerGPU": 256},
                 "rollout": {"source": {"type": "generate", "generate": {}},
                             "engine": {"type": "vllm", "replicas": replicas}},
                 "weightSync": {"type": "disk", "path": "/models/weights"}, "store": {"managed": True},
                 "failurePolicy": {"maxRestarts": max_restarts},
                 "podTemplate": {"volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
                                 "volumeMounts": [{"name": "models", "mountPath": "/models"}]}}})


# ------------------------------------------------------------------------------------------- terminal (sticky)
def test_terminal_phases_are_sticky():
    run = run_of(failurePolicy={"maxRestarts": 3, "backoffSeconds": 10})
    st = {**_restarting(run), "restarts": 3, "phase": "Running", "attempt": 1}
    d = decide(run, st, pods_of(run, 1, **{"tiny-trainer-0-a1": "Failed"}), attempt=1)
    assert d.status["phase"] == "Failed"
    d2 = decide(run, d.status, pods_of(run, 1, phase="Succeeded"), attempt=1)
    assert d2.status["phase"] == "Failed" and not d2.create


def test_ttl_after_finished_deletes_the_run():
    run = run_of(activeDeadlineSeconds=3600, ttlSecondsAfterFinished=30)
    done = decide(run, _running(run), pods_of(run, 0), now=T0 + dt.timedelta(seconds=3600)).status
    assert not decide(run, done, [], now=T0 + dt.timedelta(seconds=3620)).delete_run
    assert decide(run, done, [], now=T0 + dt.timedelta(seconds=3631)).delete_run


# --------------------------------------------------------------------------------- before every non-terminal phase
def test_invalid_spec_fails_at_once_with_a_message_cut_to_fit():
    run = run_of(activeDeadlineSeconds=3600, ttlSecondsAfterFinished=30)
    # a message longer than the CRD admits is cut to fit, and says so
    d = decide(run, None, [], spec_errors=tuple(f"spec.x[{i}]: bad" * 20 for i in range(100)))
    assert d.status["phase"] == "Failed" and len(d.status["message"]) <= 4096
    assert d.status["message"].endswith("more characters)")
    assert all(len(c["message"]) <= 4096 for c in d.status["conditions"])


def test_permanent_refusal_fails_the_run_with_the_servers_message():
    run = run_of()
    st = status.decide(run, None, Observed(), now=T0).status
    invalid = Refusal("Pod", "tiny-rollout-a0", 422, "spec.containers[0].image: Invalid value", permanent=True)
    d = decide(run, st, [], refusal=invalid)
    assert d.status["phase"] == "Failed" and "Invalid value" in d.status["message"] and not d.create
    assert d.status["conditions"][-1]["reason"] == "InvalidSpec" or any(
        c["reason"] == "InvalidSpec" and c["status"] == "True" for c in d.status["conditions"])


def test_suspend_deletes_the_pods_and_resume_is_a_new_attempt():
    run = run_of(activeDeadlineSeconds=3600, ttlSecondsAfterFinished=30)
    suspended = run_of(suspend=True)
    d = decide(suspended, _running(run), pods_of(run, 0))
    assert d.status["phase"] == "Suspended" and len(d.delete_pods) == 3
    d = decide(run, d.status, [])
    assert d.status["phase"] == "Pending" and d.status["attempt"] == 1 and d.status["restarts"] == 0


# ------------------------------------------------------------------------------------------------- new → Pending
def test_a_new_run_creates_its_base_children_then_its_pods():
    run = run_of()
    d = status.decide(run, None, Observed(generation=1), now=T0)
    assert d.status["phase"] == "Pending" and d.status["trainerReplicas"] == 2
    # base children first (what pods mount and resolve), then the three pods
    assert [c.key for c in d.create] == ["ConfigMap/tiny-config", "Service/tiny-trainers", "Service/tiny-store",
                                         "Pod/tiny-store", "Pod/tiny-rollout-a0", "Pod/tiny-trainer-0-a0",
                                         "Pod/tiny-trainer-1-a0"]


# ------------------------------------------------------------------------------- Pending / Running / Restarting
def test_active_deadline_fails_the_run():
    run = run_of(activeDeadlineSeconds=3600, ttlSecondsAfterFinished=30)
    d = decide(run, _running(run), pods_of(run, 0), now=T0 + dt.timedelta(seconds=3600))
    assert d.status["phase"] == "Failed" and any(c["reason"] == "DeadlineExceeded" for c in d.status["conditions"])


def test_a_crash_looping_engine_uses_the_failure_budget_and_fails_the_run_naming_it():
    # Before: the engine pod (restartPolicy Always) was restarted by the kubelet for ever, outside the failure
    # policy; a vLLM server that cannot start (wrong model path, too little memory) left the run Running for ever.
    run = _engine_run(max_restarts=2)
    children = frozenset(c.key for c in vocabulary.base_children(run, 0) if c.kind != "Pod")
    st = {"phase": "Running", "attempt": 0, "restarts": 0}
    pod = {"metadata": {"name": "rl-engine-0", "labels": {LABEL_ROLE: "engine"}},
           "status": {"phase": "Running", "containerStatuses": [{
               "name": "vllm", "restartCount": 2,
               "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting"}},
               "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "finishedAt": "2025-01-01T00:00:00Z"}}}]}}
    group = [PodObs(name=vocabulary.Names("rl").pod(role, rank, 0), role=role, rank=rank, attempt=0, phase="Running")
             for role, rank in status.expected_group(run)]

    def decide_engine(engine_pod):
        return status.decide(run, dict(st), Observed(pods=(observe_pod(engine_pod), *group), children=children),
                             now=T0)

    assert observe_pod(pod).restarts == 2
    d = decide_engine(pod)  # within the budget: the rollout waits for the server, the run goes on
    assert d.status["phase"] == "Running"
    again = copy.deepcopy(pod)
    again["status"]["containerStatuses"][0]["restartCount"] = 3
    d = decide_engine(again)
    assert d.status["phase"] == "Failed"
    message = d.status["message"]
    assert "rl-engine-0" in message and "restarted 3 times" in message and "maxRestarts=2" in message, message
    assert "exited with code 1" in message, message
    assert any(r == "BackoffLimitExceeded" for _, r, _ in d.events)


def test_resize_restarts_the_group_at_the_new_size_not_counted():
    run = run_of(failurePolicy={"maxRestarts": 0, "progressDeadlineSeconds": 60}, activeDeadlineSeconds=3600,
                 ttlSecondsAfterFinished=30)
    st = _running(run)
    bigger = run_of(trainer={**TINY["spec"]["trainer"], "replicas": 4}, failurePolicy={"maxRestarts": 0})
    d = decide(bigger, st, pods_of(run, 0))
    assert d.status["phase"] == "Restarting" and d.status["restarts"] == 0 and d.status["disruptions"] == 0
    assert d.events[-1][:2] == ("Normal", "Resized") and "from 2 to 4" in d.events[-1][2]
    d = decide(bigger, d.status, [], attempt=1)
    assert d.status["phase"] == "Pending" and len(_pods(d)) == 5 and d.status["trainerReplicas"] == 4


def test_group_exit_restarts_within_the_budget_doubling_the_backoff_then_fails():
    run = run_of(failurePolicy={"maxRestarts": 3, "backoffSeconds": 10})
    st = _running(run)
    failed = pods_of(run, 0, **{"tiny-trainer-1-a0": "Failed"})
    d = decide(run, st, failed)
    assert d.status["phase"] == "Restarting" and d.status["restarts"] == 1 and d.status["attempt"] == 1
    assert sorted(d.delete_pods) == sorted(p.name for p in failed if p.phase == "Running")
    d = decide(run, d.status, [], now=T0 + dt.timedelta(seconds=10), attempt=1)
    st = decide(run, d.status, pods_of(run, 1), attempt=1).status
    assert st["phase"] == "Running"
    # the second restart waits 2 x backoffSeconds (a trainer: the rollout restarts alone, test_role_restart_*)
    d = decide(run, st, pods_of(run, 1, **{"tiny-trainer-0-a1": "Failed"}), attempt=1)
    assert d.status["restarts"] == 2 and "in 20s" in d.status["message"]
    # budget used: Failed with the failing pod in the message
    st = {**d.status, "restarts": 3, "phase": "Running", "attempt": 1}
    d = decide(run, st, pods_of(run, 1, **{"tiny-trainer-0-a1": "Failed"}), attempt=1)
    assert d.status["phase"] == "Failed" and "tiny-trainer-0-a1" in d.status["message"]


def test_group_exit_disruptions_do_not_use_the_budget():
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
    preempted = observe_pod({"metadata": {"name": "tiny-trainer-1-a0", "labels": {LABEL_ROLE: "trainer", LABEL_RANK: "1",
                                                                                 LABEL_ATTEMPT: "0"}},
                             "status": {"phase": "Running", "conditions": [
                                 {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]}})
    d = decide(run, st, [p for p in pods_of(run, 0) if p.name != preempted.name], gone=(preempted,))
    assert d.status["phase"] == "Restarting" and d.status["disruptions"] == 1


def test_a_device_taint_eviction_is_a_disruption():
    """Issue 32: DRA device taints (Kubernetes 1.37 GA) evict the pods of a failing device with the condition
    DisruptionTarget, reason DeviceTaintManagerEviction: a disruption (restart, no budget used), not a failure."""
    run = run_of(failurePolicy={"maxRestarts": 0, "backoffSeconds": 7})
    st = _running(run)
    tainted = observe_pod({"metadata": {"name": "tiny-trainer-1-a0", "labels": {LABEL_ROLE: "trainer", LABEL_RANK: "1",
                                                                               LABEL_ATTEMPT: "0"}},
                           "status": {"phase": "Failed", "conditions": [
                               {"type": "DisruptionTarget", "status": "True", "reason": "DeviceTaintManagerEviction",
                                "message": "Device Taint manager: deleting due to NoExecute taint"}]}})
    assert tainted.disruption and "DeviceTaintManagerEviction" in tainted.disruption
    pods = [p for p in pods_of(run, 0) if p.name != tainted.name] + [tainted]
    d = decide(run, st, pods)
    assert d.status["phase"] == "Restarting" and d.status["restarts"] == 0 and d.status["disruptions"] == 1


def test_group_exit_a_deleted_pod_is_a_failure():
    run = run_of(failurePolicy={"maxRestarts": 0, "backoffSeconds": 7})
    # a deleted pod without a disruption is a failure (budget 0: Failed)
    d = decide(run, _running(run), pods_of(run, 0)[:-1])
    assert d.status["phase"] == "Failed" and "was deleted" in d.status["message"]


def test_group_exit_success_of_every_trainer_wins():
    run = run_of(failurePolicy={"maxRestarts": 0, "backoffSeconds": 7})
    # every trainer Succeeded and the rollout Failed in one observation: Succeeded
    d = decide(run, _running(run), pods_of(run, 0, phase="Succeeded", **{"tiny-rollout-a0": "Failed"}))
    assert d.status["phase"] == "Succeeded"


def test_group_exit_a_config_error_fails_at_once():
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


def test_progress_deadline_fails_a_run_without_new_steps_but_not_while_progress_is_unknown():
    run, st, fresh = _watched()
    d = decide(run, st, pods_of(run, 0), now=T0 + dt.timedelta(seconds=100), progress=fresh)
    assert d.status["phase"] == "Running" and d.status["step"] == 3
    d = decide(run, st, pods_of(run, 0), now=T0 + dt.timedelta(seconds=111), progress=fresh)
    assert d.status["phase"] == "Failed" and "no progress" in d.status["message"]
    unknown = ProgressObs(fresh.value, error="ConnectionError: Authentication required")
    d = decide(run, st, pods_of(run, 0), now=T0 + dt.timedelta(seconds=500), progress=unknown)
    assert d.status["phase"] == "Running"
    # readable again at 500 s: the deadline counts from then, not from the last step at 50 s
    back = decide(run, d.status, pods_of(run, 0), now=T0 + dt.timedelta(seconds=500), progress=fresh).status
    assert back["phase"] == "Running"
    assert decide(run, back, pods_of(run, 0), now=T0 + dt.timedelta(seconds=550), progress=fresh).status["phase"] == (
        "Running")
    assert decide(run, back, pods_of(run, 0), now=T0 + dt.timedelta(seconds=561), progress=fresh).status["phase"] == (
        "Failed")


def test_wait_backoff_before_the_next_attempt():
    run = run_of(failurePolicy={"maxRestarts": 3, "backoffSeconds": 10})
    st = _restarting(run)
    # backoff not elapsed: nothing created
    d = decide(run, st, [], now=T0 + dt.timedelta(seconds=5), attempt=1)
    assert d.status["phase"] == "Restarting" and not _pods(d) and d.requeue_after == 5
    d = decide(run, st, [], now=T0 + dt.timedelta(seconds=10), attempt=1)
    assert d.status["phase"] == "Pending" and len(_pods(d)) == 3


def test_wait_terminating_pods_block_until_the_timeout():
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


def test_ensure_children_creates_what_is_missing_on_every_reconcile():
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


def test_an_engine_replica_beyond_the_budget_leaves_the_pool_and_only_an_empty_pool_fails_the_run():
    """A pool of 2 (engine pods restartPolicy Never, replaced by the failure policy): engine-1 failed is replaced
    alone (rl-engine-1-r1, trainers untouched, status.roleRestarts); failed again with failurePolicy.roles.engine's
    budget spent it leaves the pool (roleRestarts marks it down, an EngineDown event, never replaced), the run goes on
    with engine-0; once engine-0 fails too the run fails naming both pods and their last exits."""
    run = _engine_run(max_restarts=1, replicas=2)
    children = frozenset(c.key for c in vocabulary.base_children(run, 0) if c.kind != "Pod")
    st = {"phase": "Running", "attempt": 0, "restarts": 0}
    group = [PodObs(name=vocabulary.Names("rl").pod(role, rank, 0), role=role, rank=rank, attempt=0, phase="Running")
             for role, rank in status.expected_group(run)]

    def engine(i: int, generation: int, phase: str = "Running"):
        name = vocabulary.Names("rl").engine_pod(i, generation)
        state = ({"running": {}} if phase == "Running" else
                 {"terminated": {"exitCode": 137, "reason": "OOMKilled", "finishedAt": "2025-01-01T00:00:00Z"}})
        return observe_pod({"metadata": {"name": name, "labels": {
                                LABEL_ROLE: "engine", LABEL_REPLICA: str(i), LABEL_ROLE_ATTEMPT: str(generation)}},
                            "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True"}],
                                       "containerStatuses": [{"name": "vllm", "restartCount": 0, "state": state,
                                                              "ready": phase == "Running"}]}})

    def decide(st, *engines):
        return status.decide(run, dict(st), Observed(pods=(*engines, *group), children=children), now=T0)

    d = decide(st, engine(0, 0), engine(1, 0, "Failed"))
    assert d.status["phase"] == "Running" and not d.delete_pods, d.status
    entry = next(e for e in d.status["roleRestarts"] if e["role"] == "engine" and e["replica"] == 1)
    assert entry["restarts"] == 1 and not entry.get("down")
    d = status.decide(run, dict(d.status), Observed(pods=(engine(0, 0), engine(1, 0, "Failed"), *group),
                                                    children=children), now=T0 + dt.timedelta(seconds=120))
    assert "Pod/rl-engine-1-r1" in {c.key for c in d.create} and not {c.key for c in d.create} & {
        f"Pod/{p.name}" for p in group}
    d = decide(d.status, engine(0, 0), engine(1, 0, "Failed"), engine(1, 1, "Failed"))  # the replacement failed too
    assert d.status["phase"] == "Running" and not d.delete_pods, d.status
    entry = next(e for e in d.status["roleRestarts"] if e["role"] == "engine" and e["replica"] == 1)
    assert entry["down"] is True and entry["restarts"] == 1 and "rl-engine-1-r1" in entry["lastFailure"]
    assert [(t, r) for t, r, m in d.events if "rl-engine-1-r1" in m] == [("Warning", "EngineDown")]
    again = decide(d.status, engine(0, 0), engine(1, 1, "Failed"))
    assert again.status["phase"] == "Running" and not [e for e in again.events if e[1] == "EngineDown"]  # said once
    assert not [c for c in again.create if c.role == "engine"]  # out of the pool: never replaced again
    d = decide(again.status, engine(0, 0, "Failed"), engine(1, 1, "Failed"))
    assert d.status["phase"] == "Failed", d.status
    message = d.status["message"]
    assert "rl-engine-0" in message and "rl-engine-1-r1" in message and "137" in message, message


def test_ensure_children_creates_missing_engine_children_but_not_a_running_engine_pod():
    run = _engine_run()
    st = {"phase": "Pending", "attempt": 0, "restarts": 0}
    d = status.decide(run, dict(st), Observed(pods=(), children=frozenset()), now=T0)
    created = {c.key for c in d.create}
    assert {"ConfigMap/rl-engine", "Service/rl-engine", "Pod/rl-engine-0"} <= created
    engine_pod = PodObs(name="rl-engine-0", role="engine", rank=0, attempt=None, phase="Running")
    children = frozenset(c.key for c in vocabulary.base_children(run, 0) if c.kind != "Pod")
    d = status.decide(run, dict(st), Observed(pods=(engine_pod,), children=children), now=T0)
    assert "Pod/rl-engine-0" not in {c.key for c in d.create}


def test_pods_ready_runs_the_attempt_once_every_pod_runs():
    run = run_of()
    st = status.decide(run, None, Observed(generation=1), now=T0).status
    d = decide(run, st, pods_of(run, 0, phase="Pending"))
    assert d.status["phase"] == "Pending" and not d.create
    ready = next(c for c in d.status["conditions"] if c["type"] == "PodsReady")
    assert ready["status"] == "False" and ready["reason"] == "WaitingForPods" and "3 pod(s)" in ready["message"]
    d = decide(run, st, pods_of(run, 0), generation=2)
    assert d.status["phase"] == "Running" and d.events[-1][1] == "Running"
    assert {c["type"]: c.get("observedGeneration") for c in d.status["conditions"]} == {"PodsReady": 2, "Running": 2}


def test_pods_ready_says_why_not_a_refusal():
    run = run_of()
    st = status.decide(run, None, Observed(), now=T0).status
    # a refusal shows in the Pending run's message and condition
    refusal = Refusal("Pod", "tiny-rollout-a0", 403, "exceeded quota: gpus", permanent=False)
    d = decide(run, st, [], refusal=refusal)
    assert d.status["phase"] == "Pending" and "exceeded quota" in d.status["message"]


def test_pods_ready_says_why_not_the_schedulers_reason_or_kueue():
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


def test_read_progress_copies_the_stores_progress_and_says_when_it_cannot():
    run, st, fresh = _watched()
    d = decide(run, st, pods_of(run, 0), now=T0 + dt.timedelta(seconds=100), progress=fresh)
    assert d.status["step"] == 3
    unknown = ProgressObs(fresh.value, error="ConnectionError: Authentication required")
    d = decide(run, st, pods_of(run, 0), now=T0 + dt.timedelta(seconds=500), progress=unknown)
    cond = next(c for c in d.status["conditions"] if c["type"] == "ProgressUnknown")
    assert cond["status"] == "True" and "Authentication required" in cond["message"]


def test_engine_pool_resize_updates_the_list_first_then_removes_and_counts_the_pool():
    """spec.rollout.engine.replicas 3 -> 1 on a running run: the ConfigMap (the rollout's list of URLs) is updated
    first; the removed replicas' pods are deleted only once it holds the new list, without ending any group; the
    pool's size (status.engineReplicas) stays 3 until they are gone, EnginePoolResizing True meanwhile. 1 -> 2: the
    added replica is created at once, its missing pod is no failure, the run stays whole until it is ready."""
    run3, run1 = _engine_run(replicas=3), _engine_run(replicas=1)
    children = frozenset(c.key for c in vocabulary.base_children(run1, 0) if c.kind != "Pod")
    group = [PodObs(name=vocabulary.Names("rl").pod(role, rank, 0), role=role, rank=rank, attempt=0, phase="Running")
             for role, rank in status.expected_group(run1)]
    group.append(PodObs(name="rl-store", role="store", rank=None, attempt=None, phase="Running"))

    def engine(i: int, ready: bool = True) -> PodObs:
        return PodObs(name=vocabulary.Names("rl").engine_pod(i), role="engine", rank=i, attempt=None,
                      phase="Running", ready=ready)

    st = {"phase": "Running", "attempt": 0, "restarts": 0, "engineReplicas": 3}
    old_hash = vocabulary.config_hash(run3)
    assert old_hash != vocabulary.config_hash(run1)
    d = status.decide(run1, dict(st), Observed(pods=(*group, engine(0), engine(1), engine(2)), children=children,
                                               config_hash=old_hash), now=T0)
    assert [c.key for c in d.update] == ["ConfigMap/rl-config"] and not d.replace_pods and not d.delete_pods
    assert d.status["engineReplicas"] == 3 and d.status["phase"] == "Running"
    resizing = next(c for c in d.status["conditions"] if c["type"] == "EnginePoolResizing")
    assert resizing["status"] == "True" and "from 3 to 1" in resizing["message"]
    assert ("Normal", "ResizingEnginePool") in [(t, r) for t, r, _ in d.events]
    d = status.decide(run1, dict(d.status), Observed(pods=(*group, engine(0), engine(1), engine(2)),
                                                     children=children, config_hash=vocabulary.config_hash(run1)),
                      now=T0)
    assert d.replace_pods == ["rl-engine-1", "rl-engine-2"] and not d.delete_pods and not d.update
    assert d.status["engineReplicas"] == 3 and not d.status.get("roleRestarts")
    d = status.decide(run1, dict(d.status), Observed(pods=(*group, engine(0)), children=children,
                                                     config_hash=vocabulary.config_hash(run1)), now=T0)
    assert d.status["engineReplicas"] == 1 and not d.create and d.status["phase"] == "Running"
    assert ("Normal", "EnginePoolResized") in [(t, r) for t, r, _ in d.events]
    run2 = _engine_run(replicas=2)
    d = status.decide(run2, dict(d.status), Observed(pods=(*group, engine(0)), children=children,
                                                     config_hash=vocabulary.config_hash(run2)), now=T0)
    assert "Pod/rl-engine-1" in {c.key for c in d.create} and not d.status.get("roleRestarts")  # joins, not missing
    assert d.status["engineReplicas"] == 1
    d = status.decide(run2, dict(d.status), Observed(pods=(*group, engine(0), engine(1, ready=False)),
                                                     children=children, config_hash=vocabulary.config_hash(run2)),
                      now=T0)
    ready = next(c for c in d.status["conditions"] if c["type"] == "PodsReady")
    assert ready["status"] == "True" and d.status["engineReplicas"] == 1  # not waited for: the run is whole
    d = status.decide(run2, dict(d.status), Observed(pods=(*group, engine(0), engine(1)), children=children,
                                                     config_hash=vocabulary.config_hash(run2)), now=T0)
    assert d.status["engineReplicas"] == 2
    assert d.status["engineSelector"] == ("app.kubernetes.io/name=trainingrun,trainingrun.dev/run=rl,"
                                         "trainingrun.dev/role=engine")
