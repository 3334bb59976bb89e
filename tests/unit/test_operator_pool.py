"""The engine pool's rules (`trainingrun.operator.pool`), on their own: each replica's current pod, an engine restarted
in place past its budget, each replica's failure, leaving the pool, its size, readiness, the pods it should have, and a
resize (the pods it removes, the size it reached).
(How `status.decide` applies them: tests/unit/test_operator_status.py; against the emulator:
tests/integration/test_engine_pool.py.)"""

from __future__ import annotations

from trainingrun import failure_policy as policy
from trainingrun.api import parse_trainingrun
from trainingrun.operator.observe import Observed, PodObs
from trainingrun.operator.pool import (
    current_engines, engine_failures, engine_not_ready, engine_pods, leave_pool, over_budget, pool_size,
    reached_size, removed,
)
from trainingrun.operator.roles import RoleLedger
from trainingrun.operator.vocabulary import Names

NOW = "2025-01-01T00:00:00Z"
NAMES = Names("rl")
SPENT = policy.Verdict(policy.Action.FAIL_RUN, "BackoffLimitExceeded", "all 1 restart(s) of "
                       "failurePolicy.roles.engine.maxRestarts used", "rule")


def _engine(replica: int, generation: int = 0, phase: str = "Running", node: int = 0, **kw) -> PodObs:
    return PodObs(name=NAMES.engine_pod(replica, generation, node), role="engine", rank=replica, attempt=None,
                  phase=phase, generation=generation, node=node, **kw)


def _down(ledger: RoleLedger, *replicas: int) -> None:
    for r in replicas:
        ledger.leave_pool("engine", r, failure=f"pod {NAMES.engine_pod(r, 0)} exited with code 137", now=NOW)


def test_each_replicas_current_pod_is_of_its_generation_live_first():
    ledger = RoleLedger([])
    ledger.restart("engine", 1, counted=True, failure="f", now=NOW, backoff=0)
    old, new = _engine(1, 0), _engine(1, 1, phase="Pending")
    deleting = _engine(0, 0, deleting=True)
    obs = Observed(pods=(old, new, deleting, _engine(2, 0)), gone=(_engine(2, 0, phase="Failed"),))
    got = current_engines(obs, ledger)
    # generation 1 for replica 1; the live pod over the gone one
    assert got == {(0, 0): deleting, (1, 0): new, (2, 0): obs.pods[3]}
    assert current_engines(Observed(gone=(_engine(3, 0, phase="Failed"),)), ledger)[(3, 0)].phase == "Failed"


def test_an_engine_restarted_in_place_past_the_budget_fails_the_run_naming_it():
    pods = [_engine(0, restarts=2), PodObs(name="rl-store", role="store", rank=None, attempt=None, phase="Running",
                                           restarts=9)]
    assert over_budget(pods, 2) is None  # the store's restarts are not the engine role's
    message = over_budget([*pods, _engine(1, restarts=3, waiting="CrashLoopBackOff")], 2)
    assert message == ("the run's vLLM server (pod rl-engine-1) restarted 3 times, more than "
                       "failurePolicy.roles.engine.maxRestarts=2; last: CrashLoopBackOff")


def test_engine_failures_judge_each_replica_in_the_pool():
    ledger = RoleLedger([])
    failed = _engine(0, phase="Failed", failure="pod rl-engine-0 container vllm exited with code 1",
                     exit_codes=(1,))
    engines = {(0, 0): failed, (2, 0): _engine(2), (3, 0): _engine(3, deleting=True)}
    _down(ledger, 4)
    ledger.restart("engine", 5, counted=True, failure="f", now=NOW, backoff=5)  # replacement not created yet
    obs = Observed(pods=tuple(engines.values()))
    found = list(engine_failures(obs, engines, ledger, replicas=6, phase="Running", names=NAMES))
    assert [(f.rank, f.name) for f in found] == [(0, "rl-engine-0"), (1, "rl-engine-1"), (3, "rl-engine-3")]
    assert found[0].code == 1 and found[0].description == failed.failure
    assert policy.DELETED in found[1].reasons and found[1].description == (
        "pod rl-engine-1 was deleted while the run was running")  # missing from a running run
    assert policy.DELETED in found[2].reasons  # deleted, not by the operator
    pending = list(engine_failures(obs, engines, ledger, replicas=6, phase="Pending", names=NAMES))
    assert [f.rank for f in pending] == [0, 3]  # a pending run's engine may simply not exist yet


def test_engine_failures_are_judged_one_at_a_time():
    """The caller acts on a failure before the next replica is judged: a replica that left the pool meanwhile is not
    judged again."""
    ledger = RoleLedger([])
    engines = {(0, 0): _engine(0, phase="Failed"), (1, 0): _engine(1, phase="Failed")}
    failures = engine_failures(Observed(pods=tuple(engines.values())), engines, ledger, replicas=2, phase="Running",
                               names=NAMES)
    assert next(failures).rank == 0
    _down(ledger, 1)
    assert list(failures) == []


def test_a_replica_with_its_budget_spent_leaves_the_pool_and_the_last_one_fails_the_run():
    ledger = RoleLedger([])
    ledger.restart("engine", 1, counted=True, failure="f", now=NOW, backoff=0)
    one = policy.Failure(name="rl-engine-1-r1", kind=policy.ExitKind.FAILURE, role="engine", rank=1,
                         description="pod rl-engine-1-r1 exited with code 137")
    served, message = leave_pool(ledger, one, SPENT, replicas=3, names=NAMES, now=NOW)
    assert served and ledger.down("engine", 1) and not ledger.replacing("engine", 1)
    assert message == ("pod rl-engine-1-r1 exited with code 137; all 1 restart(s) of failurePolicy.roles.engine."
                       "maxRestarts used: engine replica 1 (pod rl-engine-1-r1) leaves the pool; 2 of 3 engine(s) "
                       "left: rl-engine-0, rl-engine-2")
    assert pool_size(ledger, 3) == 2
    _down(ledger, 0)
    last = policy.Failure(name="rl-engine-2", kind=policy.ExitKind.FAILURE, role="engine", rank=2,
                          description="pod rl-engine-2 exited with code 1")
    served, message = leave_pool(ledger, last, SPENT, replicas=3, names=NAMES, now=NOW)
    assert not served and pool_size(ledger, 3) == 0
    assert message == ("no engine of the pool is left (all 1 restart(s) of failurePolicy.roles.engine.maxRestarts "
                       "used): pod rl-engine-0: pod rl-engine-0 exited with code 137; pod rl-engine-1-r1: pod "
                       "rl-engine-1-r1 exited with code 137; pod rl-engine-2: pod rl-engine-2 exited with code 1")


def test_the_pool_is_ready_when_every_replica_in_it_is():
    ledger = RoleLedger([])
    assert engine_not_ready({(0, 0): _engine(0, ready=True)}, ledger, replicas=1, names=NAMES) is None
    reason, message = engine_not_ready({(0, 0): _engine(0, ready=True), (1, 0): _engine(1, phase="Pending",
                                                                            waiting="ImagePullBackOff")},
                                       ledger, replicas=2, names=NAMES)
    assert reason == "WaitingForEngine" and "pod rl-engine-1 is not ready yet (ImagePullBackOff)" in message
    ledger.restart("engine", 1, counted=True, failure="f", now=NOW, backoff=0)
    reason, message = engine_not_ready({(0, 0): _engine(0, ready=True)}, ledger, replicas=2, names=NAMES)
    assert reason == "RestartingRole" and "pod rl-engine-1-r1 is not ready yet (the rollout" in message
    _down(ledger, 1)
    # the others serve
    assert engine_not_ready({(0, 0): _engine(0, ready=True)}, ledger, replicas=2, names=NAMES) is None


def test_each_replica_in_the_pool_has_a_pod_of_its_generation():
    run = parse_trainingrun({
        "apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "rl"},
        "spec": {"model": {"hf": "/models/smol", "seqLength": 512}, "trainer": {"replicas": 1, "maxTokensPerGPU": 256},
                 "rollout": {"source": {"type": "generate", "generate": {}}, "engine": {"type": "vllm", "replicas": 3}},
                 "weightSync": {"type": "disk", "path": "/models/weights"},
                 "podTemplate": {"volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
                                 "volumeMounts": [{"name": "models", "mountPath": "/models"}]}}})
    ledger = RoleLedger([])
    ledger.restart("engine", 2, counted=True, failure="f", now=NOW, backoff=0)
    _down(ledger, 1)
    pods = engine_pods(run, ledger)
    assert [(r, c.kind, c.name, c.generation) for r, c in pods] == [
        (0, "Pod", "rl-engine-0", 0), (2, "Pod", "rl-engine-2-r1", 1)]


def test_a_replica_joining_the_pool_in_a_resize_is_not_missing_and_a_removed_one_is_not_judged():
    """Resize 2 -> 3: replica 2 without a pod yet is joining (size 2), not deleted; replica 1 without a pod is
    deleted. Resize 3 -> 1: the removed replicas' pods (failed or not) are not judged."""
    ledger = RoleLedger([])
    engines = {(0, 0): _engine(0)}
    obs = Observed(pods=tuple(engines.values()))
    got = list(engine_failures(obs, engines, ledger, replicas=3, phase="Running", names=NAMES, size=2))
    assert [f.name for f in got] == ["rl-engine-1"] and got[0].reasons == frozenset({policy.DELETED})
    failed = _engine(2, phase="Failed", failure="exit 1", exit_codes=(1,))
    engines = {(0, 0): _engine(0), (1, 0): _engine(1), (2, 0): failed}
    obs = Observed(pods=tuple(engines.values()))
    assert list(engine_failures(obs, engines, ledger, replicas=1, phase="Running", names=NAMES, size=3)) == []


def test_the_pool_reaches_its_new_size_once_added_replicas_are_ready_and_removed_ones_gone():
    ledger = RoleLedger([])
    up = {(0, 0): _engine(0), (1, 0): _engine(1), (2, 0): _engine(2, ready=False)}
    live = list(up.values())
    assert reached_size(up, live, ledger, size=2, wanted=3) == 2  # engine-2 not ready yet
    up[(2, 0)] = _engine(2, ready=True)
    assert reached_size(up, list(up.values()), ledger, size=2, wanted=3) == 3
    _down(ledger, 2)  # a replica out of the pool is not waited for
    assert reached_size({(0, 0): _engine(0), (1, 0): _engine(1)}, [_engine(0), _engine(1)], ledger, size=2,
                        wanted=3) == 3
    down = {(0, 0): _engine(0, ready=True), (1, 0): _engine(1, ready=True), (2, 0): _engine(2, ready=True)}
    assert removed(down.values(), 1) == ["rl-engine-1", "rl-engine-2"]
    assert reached_size(down, list(down.values()), RoleLedger([]), size=3, wanted=1) == 3  # still draining
    terminating = [down[(0, 0)], _engine(1, deleting=True)]
    assert removed([p for p in terminating if not p.deleting], 1) == []
    assert reached_size({(0, 0): down[(0, 0)]}, [down[(0, 0)]], RoleLedger([]), size=3, wanted=1) == 1


def test_a_multi_node_replica_is_judged_as_one_engine_by_all_its_pods():
    """rollout.engine.vllm.nodes 2: replica i is a leader (node 0) and a worker (node 1). A failed or missing worker is
    its replica's failure (one per replica, naming the pod); the replica is ready only when both pods are; its
    replacement is both pods in the next generation."""
    ledger = RoleLedger([])
    pods = [_engine(r, node=n, ready=True) for r in range(2) for n in range(2)]
    engines = {(p.rank, p.node): p for p in pods}
    obs = Observed(pods=tuple(pods))
    assert list(engine_failures(obs, engines, ledger, replicas=2, phase="Running", names=NAMES, nodes=2)) == []
    assert engine_not_ready(engines, ledger, replicas=2, names=NAMES, nodes=2) is None
    worker = _engine(1, node=1, phase="Failed", failure="pod rl-engine-1-n1 container vllm exited with code 1",
                     exit_codes=(1,))
    engines[(1, 1)] = worker
    obs = Observed(pods=tuple(engines.values()))
    [failure] = engine_failures(obs, engines, ledger, replicas=2, phase="Running", names=NAMES, nodes=2)
    assert (failure.rank, failure.name, failure.code) == (1, "rl-engine-1-n1", 1)
    assert "engine replica 1, node 1 of 2: the whole replica is replaced" in failure.description
    del engines[(1, 1)]  # a worker gone from a running run
    obs = Observed(pods=tuple(engines.values()))
    [failure] = engine_failures(obs, engines, ledger, replicas=2, phase="Running", names=NAMES, nodes=2)
    assert failure.name == "rl-engine-1-n1" and policy.DELETED in failure.reasons
    reason, message = engine_not_ready(engines, ledger, replicas=2, names=NAMES, nodes=2)
    assert reason == "WaitingForEngine" and "pod rl-engine-1-n1 is not ready yet" in message
    assert reached_size(engines, list(engines.values()), ledger, size=1, wanted=2, nodes=2) == 1
