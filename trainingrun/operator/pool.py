"""The engine pool's rules (`spec.rollout.engine.replicas` engine pods, each replica on its own), as pure functions of
the observations and the ledger of roles restarted alone (`trainingrun.operator.roles.RoleLedger`); `status.decide`
applies them to the status it writes.

  current_engines        each replica's pods of its current generation, by (replica, node)
  over_budget            an engine pod the kubelet restarted in place more often than the engine role's budget
  engine_failures        each replica whose current pod failed, was disrupted or deleted (one missing from a running
                         run counts as deleted, unless its replacement is not created yet or it joins the pool in a
                         resize); a replica out of the pool is never judged again
  leave_pool             an engine replica that failed with the role's budget spent leaves the pool (marked `down`,
                         never replaced) while another replica serves; the last one leaving fails the run, naming
                         every engine pod of the pool and its last failure
  pool_size              the replicas still in the pool
  out_of_pool            the live pods of replicas out of the pool (a multi-node replica's pods that did not fail
                         with it): deleted, they would hold their GPUs for nothing
  engine_not_ready       the first replica in the pool whose pod is not ready (a running run is not whole meanwhile)
  engine_pods            the pod each replica in the pool should have (of its current generation)
  removed                the live pods of replicas a resize took out of the pool (replica >= the wanted size)
  reached_size           the pool's size as it runs (status.engineReplicas): the wanted size once every added
                         replica's pod is ready and every removed one's pod is gone, else the size before

A multi-node replica (rollout.engine.vllm.nodes N > 1) is N pods, a leader (node 0) and its workers, judged as one
engine: the first of its pods that failed, was disrupted or went missing is the replica's failure, and its replacement
is the whole replica in the next generation (the older generation's live pods are superseded: `roles.superseded`); it
is ready when every one of its pods is.

A resize (spec.rollout.engine.replicas changed on a running run): the run's ConfigMap gets the new list of URLs
first (the rollout re-reads it, $TRAININGRUN_ENGINE_URL_FILE); an added replica's pod is created at once (it joins the
pool: not judged missing and not waited for until it was ready once); a removed replica's pod is deleted once the
ConfigMap holds the new list, without touching the trainers, the rollout or the other replicas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

from trainingrun import failure_policy as policy
from trainingrun.api.constants import ROLE_ENGINE
from trainingrun.operator.observe import Observed, PodObs
from trainingrun.operator.roles import RoleLedger
from trainingrun.operator.vocabulary import Child, Names, engine_child, engine_nodes, engine_replicas


Engines = dict[tuple[int, int], PodObs]  # (replica, node) -> the pod


def current_engines(obs: Observed, ledger: RoleLedger) -> Engines:
    """Each engine replica's pods of its current generation (the live one, else one being deleted, else the last seen
    deleted), by (replica, node)."""
    return obs.pick(lambda p: p.role == ROLE_ENGINE and p.generation == ledger.generation(ROLE_ENGINE, p.rank or 0),
                    lambda p: (p.rank or 0, p.node))


def over_budget(live: Iterable[PodObs], budget: int) -> str | None:
    """An engine pod restarted in place by the kubelet (an engine pod created by an operator before 0.2, with
    restartPolicy Always; engine pods of this operator have restartPolicy Never and are replaced by the failure
    policy) uses the engine role's budget: the message that fails the run when one restarted more than `budget` times
    (None: none did)."""
    for p in live:
        if p.role == ROLE_ENGINE and p.restarts > budget:
            why = p.failure or p.waiting or "no exit recorded"
            return (f"the run's vLLM server (pod {p.name}) restarted {p.restarts} times, more than "
                    f"failurePolicy.roles.engine.maxRestarts={budget}; last: {why}")
    return None


def engine_failures(obs: Observed, engines: Engines, ledger: RoleLedger, *, replicas: int, phase: str,
                    names: Names, size: int | None = None, nodes: int = 1) -> Iterator[policy.Failure]:
    """Each engine replica's failure (the first of its `nodes` pods that failed or went missing), in replica order
    (lazily: the caller may act on one before the next is judged); see the module docstring. `size`: the pool's size
    as it ran (status.engineReplicas; default `replicas`): a replica from `size` up joins the pool, its pods not
    created or seen yet."""
    size = replicas if size is None else size
    for replica in range(replicas):
        if ledger.down(ROLE_ENGINE, replica):
            continue  # out of the pool
        for node in range(nodes):
            p = engines.get((replica, node))
            if p is not None:
                failure = obs.failure_of(p, phase)
            elif phase == "Running" and replica < size and not ledger.replacing(ROLE_ENGINE, replica):
                name = names.engine_pod(replica, ledger.generation(ROLE_ENGINE, replica), node)
                failure = policy.Failure(name=name, kind=policy.ExitKind.FAILURE, role=ROLE_ENGINE, rank=replica,
                                         reasons=frozenset({policy.DELETED}),
                                         description=f"pod {name} was deleted while the run was running")
            else:
                failure = None
            if failure is not None:
                if nodes > 1:  # the replica is replaced whole: say so in what the status and events carry
                    failure = dataclasses.replace(failure, description=f"{failure.description} (engine replica "
                                                  f"{replica}, node {node} of {nodes}: the whole replica is replaced)")
                yield failure
                break  # one failure per replica


def leave_pool(ledger: RoleLedger, failure: policy.Failure, verdict: policy.Verdict, *, replicas: int, names: Names,
               now: str) -> tuple[bool, str]:
    """Record that the failed replica leaves the pool (at `now`, RFC 3339). (True, the message saying which engines
    are left) while another replica serves; (False, the message the run fails with) when it was the last one."""
    replica = failure.rank or 0
    ledger.leave_pool(ROLE_ENGINE, replica, failure=failure.description, now=now)
    left = [r for r in range(replicas) if not ledger.down(ROLE_ENGINE, r)]
    if left:
        return True, (f"{failure.description}; {verdict.why}: engine replica {replica} (pod {failure.name}) leaves "
                      f"the pool; {len(left)} of {replicas} engine(s) left: "
                      + ", ".join(names.engine_pod(r, ledger.generation(ROLE_ENGINE, r)) for r in left))
    why = "; ".join(f"pod {names.engine_pod(r, ledger.generation(ROLE_ENGINE, r))}: "
                    f"{(ledger.entry(ROLE_ENGINE, r) or {}).get('lastFailure') or 'down'}" for r in range(replicas))
    return False, f"no engine of the pool is left ({verdict.why}): {why}"


def out_of_pool(live: Iterable[PodObs], ledger: RoleLedger) -> list[str]:
    """The live engine pods of replicas that left the pool (the other pods of a multi-node replica whose pod failed
    with the engine role's budget spent)."""
    return sorted(p.name for p in live if p.role == ROLE_ENGINE and ledger.down(ROLE_ENGINE, p.rank or 0))


def pool_size(ledger: RoleLedger, replicas: int) -> int:
    """The engine replicas still in the pool (not out of it for a spent budget)."""
    return sum(1 for r in range(replicas) if not ledger.down(ROLE_ENGINE, r))


def engine_not_ready(engines: Engines, ledger: RoleLedger, *, replicas: int, names: Names,
                     nodes: int = 1) -> tuple[str, str] | None:
    """(reason, message) for the first replica in the pool with a pod missing or not ready: RestartingRole while
    its replacement is pending, else WaitingForEngine; None when every replica in the pool is ready."""
    for replica, node in ((r, n) for r in range(replicas) for n in range(nodes)):
        p = engines.get((replica, node))
        if ledger.down(ROLE_ENGINE, replica):
            continue  # out of the pool: the others serve
        if p is None or not p.ready:
            name = names.engine_pod(replica, ledger.generation(ROLE_ENGINE, replica), node)
            why = "" if p is None else f" ({p.waiting or 'phase ' + p.phase + ', not ready'})"
            reason = "RestartingRole" if ledger.replacing(ROLE_ENGINE, replica) else "WaitingForEngine"
            return reason, (f"waiting for the engine: pod {name} is not ready yet{why} (the rollout waits for it; "
                            "hang detection pauses meanwhile)")
    return None


def engine_pods(run, ledger: RoleLedger) -> list[tuple[int, Child]]:
    """(replica, a pod child of its current generation) for every pod of every replica still in the pool (one out
    of it is never replaced again), the leader (node 0) first."""
    return [(replica, engine_child(run, replica, ledger.generation(ROLE_ENGINE, replica), node))
            for replica in range(engine_replicas(run)) if not ledger.down(ROLE_ENGINE, replica)
            for node in range(engine_nodes(run))]


def removed(live: Iterable[PodObs], wanted: int) -> list[str]:
    """The live engine pods of replicas a resize took out of the pool (replica >= `wanted`)."""
    return sorted(p.name for p in live if p.role == ROLE_ENGINE and (p.rank or 0) >= wanted)


def reached_size(engines: Engines, live: Iterable[PodObs], ledger: RoleLedger, *, size: int,
                 wanted: int, nodes: int = 1) -> int:
    """The pool's size as it runs (status.engineReplicas): `wanted` once every replica added since `size` (and still
    in the pool) has all its pods ready and no pod of a removed replica is live; else still `size`."""
    if removed(live, wanted):
        return size
    for replica, node in ((r, n) for r in range(size, wanted) for n in range(nodes)):
        p = engines.get((replica, node))
        if not ledger.down(ROLE_ENGINE, replica) and (p is None or p.deleting or not p.ready):
            return size
    return wanted
