"""The lifecycle of a TrainingRun as a pure function: (spec, current status, observations, now) → the next status,
the children to create, update or delete, and the events to post. `trainingrun.operator.handlers` gathers the
observations (`trainingrun.operator.observe`) and performs the actions; nothing here does I/O.

`decide` is a dispatch on the current phase; each phase handler is a short list of one-rule helpers, each of which
either settles the reconcile (returns True) or lets the next one look:

  (any)        terminal phases are sticky: only clean up running pods and honour ttlSecondsAfterFinished
  (non-terminal) invalid_spec → Failed/InvalidSpec;  permanent_refusal (the API server answered 400/422 to a
               create) → Failed/InvalidSpec with the server's message;  suspend → Suspended
  new          → Pending: create the children of attempt 0
  Suspended    → Pending: resume as attempt k+1 (not a restart)
  Pending      active_deadline; engine_budget; resize; group_exit; ensure_children (ConfigMap, Services, gang
               objects, store, engines, then the attempt's pods); pods_ready → Running, else a PodsReady=False
               condition saying why
  Running      active_deadline; engine_budget; resize; group_exit; roles_ready; progress_deadline; ensure_children
               (base children, engines, a rollout restarted alone)
  Restarting   active_deadline; wait for the backoff and for the old attempt's pods to go (a pod still terminating
               after terminatingTimeoutSeconds no longer blocks); then Pending with the next attempt's children

group_exit checks success before failure: every trainer Succeeded → Succeeded, even if the rollout failed in the same
observation. Otherwise the failure to act on is `failure_policy.root_cause` of the attempt's failed, disrupted or
deleted rollout and trainer pods, then each failed engine replica on its own, and the run's failure policy
(`failure_policy.Policy.decide`: the user's rules, then the defaults) says what to do: RestartGroup (the next
attempt, after the backoff; counted in status.restarts, or in status.disruptions when it uses no restart),
RestartRole (only the rollout, or only the failed engine replica, is replaced by a pod of the next generation, after
the role's backoff and once its predecessor is gone; counted in status.roleRestarts: `trainingrun.operator.roles`),
FailRun. An engine replica of a pool (spec.rollout.engine.replicas > 1) whose failure finds the engine role's budget
spent leaves the pool instead (roleRestarts marks it down; never replaced) while another replica serves; only an
empty pool fails the run, naming every engine pod. Changing spec.trainer.replicas restarts the group at the new size
from the last checkpoint (reason Resized; not counted either).

The rules of one room live beside this module, pure and tested on their own, and are applied here: the engine pool's
in `trainingrun.operator.pool` (each replica's current pod, its failure, leaving the pool, readiness, its pod), those
of a role restarted alone in `trainingrun.operator.roles` (the ledger, the restart and its message, the pods it
supersedes, what holds its replacement back). `trainingrun.operator.reconcile` is one reconcile's context
(`Reconcile`: the status being built, conditions, the phase, the attempt's pods) and its `Decision`.

Conditions follow the Kubernetes conventions: one per type with observedGeneration, reason, message (cut to fit the
CRD) and lastTransitionTime (`Reconcile.set_condition`). The lifecycle types (Running, Restarting, Suspended,
Succeeded, Failed) have one True at a time; PodsReady says why a Pending run is not running yet, and why a Running run
is not whole (a role restarting alone, an engine not ready): the progress deadline does not count that time, nor the
time ProgressUnknown is True (the store's progress cannot be read). status.progress: `trainingrun.operator.pace`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from typing import Any

from trainingrun import failure_policy as policy
from trainingrun.api.constants import GROUP_ROLES, ROLE_ENGINE, ROLE_ROLLOUT, ROLE_STORE, ROLE_TRAINER
from trainingrun.api.models import TERMINAL_PHASES, TrainingRun
from trainingrun.operator import pool, roles
from trainingrun.operator.observe import KUEUE_GATE, Observed, PodObs, parse_time
from trainingrun.operator.pace import progress_status
from trainingrun.operator.reconcile import EVENT_MESSAGE_MAX, Decision, Reconcile, bounded
from trainingrun.operator.vocabulary import (
    Child,
    base_children,
    config_hash,
    engine_nodes,
    engine_replicas,
    engine_selector,
)

def expected_group(run: TrainingRun) -> list[tuple[str, int | None]]:
    return [("rollout", None)] + [(ROLE_TRAINER, r) for r in range(run.spec.trainer.replicas)]


_STATUS_KEYS = {
    "phase", "conditions", "restarts", "disruptions", "attempt", "trainerReplicas", "step", "samplesConsumed",
    "lastGlobalBatchSize", "rollout", "startTime", "completionTime", "observedGeneration", "message", "roleRestarts",
    "progress", "engineReplicas", "engineSelector",
}


def decide(run: TrainingRun, status: Mapping[str, Any] | None, obs: Observed, *, now: dt.datetime) -> Decision:
    """One reconcile step. `status` is the TrainingRun's current status (None for a new run)."""
    st: dict[str, Any] = {"phase": None, "conditions": [], "restarts": 0, "disruptions": 0, "attempt": 0,
                          "step": 0, "samplesConsumed": 0, "lastGlobalBatchSize": 0, "rollout": 0}
    st.update({k: v for k, v in dict(status or {}).items() if k in _STATUS_KEYS})
    st["conditions"] = [dict(c) for c in st.get("conditions") or []]
    st["roleRestarts"] = [dict(e) for e in st.get("roleRestarts") or []]
    if obs.generation is not None:
        st["observedGeneration"] = obs.generation
    ctx = Reconcile(run, st, obs, now, Decision(status=st))
    if engine_replicas(run) and st["phase"] not in TERMINAL_PHASES:
        st.setdefault("engineReplicas", engine_replicas(run))  # a new run (or one of an operator before 0.x)
        st["engineSelector"] = ",".join(f"{k}={v}" for k, v in engine_selector(run.metadata.name).items())
    _read_progress(ctx)
    phase = st["phase"]
    if phase in TERMINAL_PHASES:
        _terminal(ctx)
        return ctx.d
    if _invalid_spec(ctx) or _permanent_refusal(ctx) or _suspend(ctx):
        return ctx.d
    handler: Callable[[Reconcile], Any] = {
        None: _start, "Suspended": _resume, "Pending": _pending, "Running": _running, "Restarting": _restarting,
    }[phase]
    handler(ctx)
    return ctx.d


# ------------------------------------------------------------------------------------------------ phase handlers
def _terminal(ctx: Reconcile) -> None:
    """Sticky: delete still-running pods (the store, an engine, a rollout that outlived the trainers) and the gang
    objects; TTL. The status (counters, phase) is the run's own: children deleted meanwhile (by hand, by a TTL) never
    move it."""
    if ctx.st["phase"] == "Succeeded":
        _read_progress(ctx, succeeded=True)
    ctx.d.delete_pods = [p.name for p in ctx.obs.live()]
    _delete_podgroups(ctx, keep=None, engines=True)
    ttl = ctx.spec.ttl_seconds_after_finished
    done = parse_time(ctx.st.get("completionTime"))
    if ttl is None or done is None:
        return
    left = policy.seconds_left(done.timestamp(), ttl, ctx.now.timestamp())
    assert left is not None
    if left <= 0:
        ctx.d.delete_run = True
        ctx.d.events.append(("Normal", "Deleted", f"ttlSecondsAfterFinished={ttl} elapsed; deleting the run"))
    else:
        ctx.d.wake_in(left)


def _start(ctx: Reconcile) -> None:
    _begin_attempt(ctx, "Created", f"creating {ctx.spec.trainer.replicas} trainer pod(s) and the rollout pod")


def _resume(ctx: Reconcile) -> None:
    ctx.st["attempt"] += 1
    _begin_attempt(ctx, "Resumed", f"resumed: attempt {ctx.attempt} starting from the last checkpoint")


def _begin_attempt(ctx: Reconcile, reason: str, message: str) -> None:
    """A new run or a resumed one: Pending, with the attempt's children to create (startTime restarts)."""
    ctx.st["startTime"] = ctx.now_s
    ctx.st["trainerReplicas"] = ctx.spec.trainer.replicas
    ctx.phase_to("Pending", reason, message, event=("Normal", reason))
    _ensure_children(ctx, pods=True)
    ctx.pods_ready(False, "Creating", message)


def _pending(ctx: Reconcile) -> None:
    if _active_deadline(ctx) or _engine_budget(ctx) or _resize(ctx) or _group_exit(ctx):
        return
    _delete_stale(ctx)
    _ensure_children(ctx, pods=True)
    _engine_pool(ctx)
    _pods_ready(ctx)


def _running(ctx: Reconcile) -> None:
    if _active_deadline(ctx) or _engine_budget(ctx) or _resize(ctx) or _group_exit(ctx):
        return
    _roles_ready(ctx)
    if _progress_deadline(ctx):
        return
    _delete_stale(ctx)
    _ensure_children(ctx, pods=False)
    _engine_pool(ctx)


def _restarting(ctx: Reconcile) -> None:
    if _active_deadline(ctx):
        return
    _delete_stale(ctx)
    _ensure_children(ctx, pods=False)
    _engine_pool(ctx)
    if _wait_backoff(ctx) or _wait_terminating(ctx):
        return
    restarts = ctx.st["restarts"]
    message = f"attempt {ctx.attempt} starting (restart {restarts} of maxRestarts={ctx.fp.max_restarts}"
    message += f", disruptions {ctx.st['disruptions']})" if ctx.st["disruptions"] else ")"
    ctx.st["trainerReplicas"] = ctx.spec.trainer.replicas
    ctx.st["phase"] = "Pending"
    ctx.st["message"] = message
    ctx.set_condition("Restarting", "False", "Restarted", message)
    ctx.d.events.append(("Normal", "Restarted", message))
    _ensure_children(ctx, pods=True)
    ctx.pods_ready(False, "Creating", message)


# --------------------------------------------------------------------------------------------- one-rule helpers
def _invalid_spec(ctx: Reconcile) -> bool:
    """A schema-valid spec that cannot run in a cluster (`checks.cluster_errors`) fails at once; a new run (no phase
    yet: nothing created) also when its memory plan does not fit its GPUs (`checks.memory_errors`)."""
    errors = ctx.obs.spec_errors + (ctx.obs.memory_errors if ctx.st["phase"] is None else ())
    if not errors:
        return False
    return ctx.fail("InvalidSpec", "the spec cannot run in a cluster: " + "; ".join(errors))


def _engine_budget(ctx: Reconcile) -> bool:
    """An engine pod restarted in place more often than the engine role's budget fails the run, naming the pod and
    its last failure, instead of crash-looping for ever (`pool.over_budget`)."""
    message = pool.over_budget(ctx.obs.live(), ctx.policy.roles[ROLE_ENGINE].max_restarts)
    return message is not None and ctx.fail("BackoffLimitExceeded", message)


def _permanent_refusal(ctx: Reconcile) -> bool:
    """The API server refused a child as invalid (400/422, e.g. a validating webhook): retrying cannot help."""
    refusal = ctx.obs.refusal
    if refusal is None or not refusal.permanent:
        return False
    return ctx.fail("InvalidSpec", f"{refusal.describe()} (the API server refused it as invalid; fix the spec and "
                    "create a new run)")


def _suspend(ctx: Reconcile) -> bool:
    if not ctx.spec.suspend:
        return False
    group_live = [p for p in ctx.obs.live() if p.role in GROUP_ROLES]
    ctx.d.delete_pods = [p.name for p in group_live]
    _delete_podgroups(ctx, keep=None)
    if ctx.st["phase"] != "Suspended":
        ctx.phase_to("Suspended", "Suspended", "suspended: pods deleted; set suspend: false to resume from the last "
                     "checkpoint", condition="Suspended")
        ctx.d.events.append(("Normal", "Suspended", f"deleting {len(ctx.d.delete_pods)} pod(s)"))
        ctx.pods_ready(False, "Suspended", "suspended")
    return True


def _active_deadline(ctx: Reconcile) -> bool:
    start = parse_time(ctx.st.get("startTime"))
    left = policy.seconds_left(start.timestamp() if start else None, ctx.spec.active_deadline_seconds,
                               ctx.now.timestamp())
    if left is None:
        return False
    if left <= 0:
        return ctx.fail("DeadlineExceeded", f"the run was active longer than activeDeadlineSeconds="
                        f"{ctx.spec.active_deadline_seconds}")
    ctx.d.wake_in(left)
    return False


def _resize(ctx: Reconcile) -> bool:
    """spec.trainer.replicas changed: restart the group at the new size from the last checkpoint (not a failure)."""
    size = ctx.st.get("trainerReplicas")
    wanted = ctx.spec.trainer.replicas
    if size is None:
        ctx.st["trainerReplicas"] = wanted
        return False
    if size == wanted:
        return False
    message = (f"spec.trainer.replicas changed from {size} to {wanted}: restarting the group at the new size as "
               f"attempt {ctx.attempt + 1} from the last checkpoint (not counted as a restart)")
    _begin_restart(ctx, "Resized", message, event=("Normal", "Resized"), wait=0.0)
    return True


def _group_exit(ctx: Reconcile) -> bool:
    """Success of every trainer first; then the attempt's failed, disrupted or deleted rollout and trainer pods (the
    one to act on: `failure_policy.root_cause`); then each engine replica on its own (`_engines_exit`)."""
    current = ctx.current()
    trainers = [current.get((ROLE_TRAINER, r)) for r in range(ctx.spec.trainer.replicas)]
    if all(t is not None and t.phase == "Succeeded" for t in trainers):
        ctx.st["completionTime"] = ctx.now_s
        ctx.phase_to("Succeeded", "Completed", f"all {len(trainers)} trainer(s) succeeded", condition="Succeeded",
                     event=("Normal", "Succeeded"))
        ctx.pods_ready(False, "Completed", "the run succeeded")
        ctx.d.delete_pods = [p.name for p in ctx.obs.live()]
        _read_progress(ctx, succeeded=True)
        return True
    failures = [f for f in (ctx.obs.failure_of(p, str(ctx.st["phase"])) for p in current.values()) if f is not None]
    if ctx.st["phase"] == "Running":
        for role, rank in expected_group(ctx.run):
            if (role, rank) in current or (role == ROLE_ROLLOUT and ctx.ledger.replacing(ROLE_ROLLOUT)):
                continue  # (a rollout restarted alone: its replacement is not created yet)
            name = ctx.names.pod(role, rank, ctx.attempt, ctx.ledger.generation(role) if rank is None else 0)
            failures.append(policy.Failure(name=name, kind=policy.ExitKind.FAILURE, role=role, rank=rank,
                                           reasons=frozenset({policy.DELETED}),
                                           description=f"pod {name} was deleted while the run was running"))
    cause = policy.root_cause(failures)
    if cause is not None:
        return _act_on(ctx, cause, ctx.policy.decide(cause, ctx.ledger.counts(ctx.st["restarts"])))
    return _engines_exit(ctx)


def _engines_exit(ctx: Reconcile) -> bool:
    """Each engine replica on its own (`pool.engine_failures`): the failure policy's verdict for a failed one; with
    more than one replica a spent budget makes it leave the pool (`_leave_pool`) instead of failing the run."""
    ledger, replicas = ctx.ledger, engine_replicas(ctx.run)
    for failure in pool.engine_failures(ctx.obs, ctx.engines(), ledger, replicas=replicas,
                                        phase=str(ctx.st["phase"]), names=ctx.names,
                                        size=ctx.st.get("engineReplicas"), nodes=engine_nodes(ctx.run)):
        verdict = ctx.policy.decide(failure, ledger.counts(ctx.st["restarts"]))
        if verdict.reason == "BackoffLimitExceeded" and replicas > 1:
            if _leave_pool(ctx, failure, verdict):
                continue
            return True  # no engine left: the run failed
        if _act_on(ctx, failure, verdict):
            return True
    return False


def _leave_pool(ctx: Reconcile, failure: policy.Failure, verdict: policy.Verdict) -> bool:
    """The failed engine replica leaves the pool (`pool.leave_pool`) while another serves: the rollout sends its
    prompts to the others. False when it was the last one: the run failed."""
    served, message = pool.leave_pool(ctx.ledger, failure, verdict, replicas=engine_replicas(ctx.run),
                                      names=ctx.names, now=ctx.now_s)
    if not served:
        ctx.fail("BackoffLimitExceeded", message)
        return False
    ctx.st["message"] = bounded(message)
    ctx.d.events.append(("Warning", "EngineDown", bounded(message, EVENT_MESSAGE_MAX)))
    return True


def _act_on(ctx: Reconcile, cause: policy.Failure, verdict: policy.Verdict) -> bool:
    """Apply a verdict: fail the run, restart the group (True: the reconcile is settled), or restart the failed role
    alone (False: the phase goes on)."""
    if not verdict.restart:
        sep = ": " if verdict.reason == "ConfigError" else "; "
        return ctx.fail(verdict.reason, f"{cause.description}{sep}{verdict.why}")
    if verdict.alone:
        _restart_role(ctx, cause, verdict)
        return False
    if cause.role == ROLE_ENGINE:  # the group restarts; the failed engine replica is replaced with it
        ctx.ledger.restart(ROLE_ENGINE, cause.rank or 0, counted=False, failure=cause.description, now=ctx.now_s,
                           backoff=verdict.backoff)
    _restart_after(ctx, cause, verdict)
    return True


def _restart_role(ctx: Reconcile, cause: policy.Failure, verdict: policy.Verdict) -> None:
    """Replace only the failed role (the rollout, or one engine replica) by a pod of its next generation, after the
    role's backoff and once its predecessor is gone (`_ensure_children`); the counters go to status.roleRestarts
    (`roles.restart_alone`)."""
    message = roles.restart_alone(ctx.ledger, cause, verdict, ctx.policy, group_restarts=ctx.st["restarts"],
                                  now=ctx.now_s)
    ctx.st["message"] = bounded(message)
    ctx.d.events.append(("Warning", "RestartingRole", bounded(message, EVENT_MESSAGE_MAX)))
    if ctx.st["phase"] == "Running":
        ctx.pods_ready(False, "RestartingRole", message)
    ctx.d.wake_in(verdict.backoff)


def _roles_ready(ctx: Reconcile) -> None:
    """A Running run is whole when every pod of the attempt runs and every engine is ready: PodsReady says so, or
    why not (a role restarting alone, an engine not ready yet); the progress deadline does not count while it is
    False."""
    reason, message = _not_whole(ctx)
    if reason is None:
        if (ctx.condition("PodsReady") or {}).get("status") != "True":
            engines = pool.pool_size(ctx.ledger, engine_replicas(ctx.run))
            message = f"attempt {ctx.attempt}: rollout, {ctx.spec.trainer.replicas} trainer(s)" + (
                f" and {engines} engine(s)" if engines else "") + " running again"
            ctx.pods_ready(True, "PodsRunning", message)
            ctx.st["message"] = message
        return
    ctx.pods_ready(False, reason, message)


def _not_whole(ctx: Reconcile) -> tuple[str | None, str]:
    """(reason, message) of what keeps the attempt from being whole — its rollout restarting alone
    (`roles.rollout_not_running`), an engine of the pool not ready (`pool.engine_not_ready`); (None, "") when it is."""
    ledger = ctx.ledger
    rollout = roles.rollout_not_running(ctx.current().get((ROLE_ROLLOUT, None)), ledger, names=ctx.names,
                                        attempt=ctx.attempt)
    if rollout is not None:
        return "RestartingRole", rollout
    wanted = engine_replicas(ctx.run)  # a replica joining the pool in a resize is not waited for
    engine = pool.engine_not_ready(ctx.engines(), ledger, replicas=min(wanted, ctx.st.get("engineReplicas", wanted)),
                                   names=ctx.names, nodes=engine_nodes(ctx.run))
    return engine if engine is not None else (None, "")


def _progress_deadline(ctx: Reconcile) -> bool:
    """No new step for progressDeadlineSeconds while progress could be read and every pod was up → a failure."""
    limit = ctx.fp.progress_deadline_seconds
    if not limit:
        return False
    if ctx.obs.progress is not None and ctx.obs.progress.error is not None:
        ctx.d.wake_in(float(limit))
        return False  # unknown is not idle: the deadline does not count while progress cannot be read
    ready = ctx.condition("PodsReady") or {}
    if ready.get("status") == "False":
        ctx.d.wake_in(float(limit))
        return False  # a role restarting alone, an engine not ready: the trainers wait for it, not hang
    candidates = [parse_time((ctx.condition("Running") or {}).get("lastTransitionTime")),
                  parse_time(ready.get("lastTransitionTime"))]  # whole again since then
    unknown = ctx.condition("ProgressUnknown")
    if unknown is not None and unknown.get("status") == "False":
        candidates.append(parse_time(unknown.get("lastTransitionTime")))  # readable again since then
    record = ctx.obs.progress.value if ctx.obs.progress is not None else None
    if record is not None:
        candidates.append(dt.datetime.fromtimestamp(record.time, dt.timezone.utc))
    last = max((c for c in candidates if c is not None), default=ctx.now)
    left = policy.seconds_left(last.timestamp(), limit, ctx.now.timestamp())
    assert left is not None
    if left >= 0:
        ctx.d.wake_in(left)
        return False
    idle = int((ctx.now - last).total_seconds())
    cause = policy.Failure(name="progress deadline", kind=policy.ExitKind.FAILURE, role=None,
                           reasons=frozenset({policy.PROGRESS_DEADLINE}), description=(
                               f"no progress for {idle}s (progressDeadlineSeconds={limit}, last step {ctx.st['step']})"))
    return _act_on(ctx, cause, ctx.policy.decide(cause, ctx.ledger.counts(ctx.st["restarts"])))


def _restart_after(ctx: Reconcile, cause: policy.Failure, verdict: policy.Verdict) -> None:
    if verdict.counted:
        ctx.st["restarts"] += 1
        ctx.d.restarted = True
        what = f"restart {ctx.st['restarts']} of {ctx.fp.max_restarts}"
        event = ("Warning", "Restarting")
    else:
        ctx.st["disruptions"] += 1
        what = (f"disruption {ctx.st['disruptions']}, not counted against maxRestarts={ctx.fp.max_restarts}"
                if verdict.reason == "Disrupted" else f"{verdict.why}; uncounted restart {ctx.st['disruptions']}")
        event = ("Warning", "Disrupted" if verdict.reason == "Disrupted" else "Restarting")
    message = (f"{cause.description}; restarting the whole group as attempt {ctx.attempt + 1} ({what}) "
               f"in {verdict.backoff:g}s")
    _begin_restart(ctx, verdict.reason, message, event=event, wait=verdict.backoff)


def _begin_restart(ctx: Reconcile, reason: str, message: str, *, event: tuple[str, str], wait: float) -> None:
    """Delete the attempt's pods and go to Restarting with the next attempt number."""
    group_live = [p for p in ctx.obs.live() if p.role in GROUP_ROLES]
    ctx.st["attempt"] += 1
    ctx.phase_to("Restarting", reason, message, condition="Restarting", event=event)
    ctx.pods_ready(False, reason, message)
    ctx.d.delete_pods = sorted({p.name for p in group_live})
    ctx.d.wake_in(max(wait, 0.05))


def _wait_backoff(ctx: Reconcile) -> bool:
    cond = ctx.condition("Restarting") or {}
    since = parse_time(cond.get("lastTransitionTime")) or ctx.now
    reason = cond.get("reason")
    if reason == "Resized":
        wait = 0.0
    else:
        wait = policy.backoff_seconds(ctx.fp.backoff_seconds, ctx.st["restarts"], counted=reason == "PodFailed")
    left = policy.seconds_left(since.timestamp(), wait, ctx.now.timestamp())
    assert left is not None
    if left > 0:
        ctx.d.wake_in(left)
        return True
    return False


def _wait_terminating(ctx: Reconcile) -> bool:
    """Pods of older attempts still running or terminating block the next attempt, except those terminating for
    longer than terminatingTimeoutSeconds (a lost node may never confirm their end: they are fenced instead)."""
    timeout = ctx.fp.terminating_timeout_seconds
    blocking, zombies = [], []
    for p in ctx.obs.pods:
        if p.role not in GROUP_ROLES or p.attempt == ctx.attempt or p.phase in ("Succeeded", "Failed"):
            continue
        left = policy.seconds_left(p.deleted_at, timeout, ctx.now.timestamp())
        if left is not None and left <= 0:
            zombies.append(p.name)
        else:
            blocking.append(p)
            if left is not None:
                ctx.d.wake_in(left)
    if blocking:
        names = ", ".join(sorted(p.name for p in blocking))
        message = (f"waiting for {len(blocking)} pod(s) of an earlier attempt to terminate before attempt "
                   f"{ctx.attempt} starts: {names} (they stop blocking terminatingTimeoutSeconds={timeout}s after "
                   "their deletion)")
        ctx.st["message"] = bounded(message)
        ctx.pods_ready(False, "TerminatingPods", message)
        ctx.d.wake_in(1.0)
        return True
    if zombies:
        ctx.d.events.append(("Warning", "TerminatingTimeout", bounded(
            f"pod(s) {', '.join(sorted(zombies))} still terminating after terminatingTimeoutSeconds={timeout}s "
            f"(a lost node?): starting attempt {ctx.attempt} without waiting; they are fenced off by their older "
            "attempt number and per-attempt hostnames", EVENT_MESSAGE_MAX)))
    return False


def _delete_stale(ctx: Reconcile) -> None:
    """Rollout/trainer pods and gang objects of other attempts are deleted; so are live pods of an older generation
    of a role restarted alone (a rollout of this attempt, an engine replica), without ending their group."""
    stale = [p.name for p in ctx.obs.live() if p.role in GROUP_ROLES and p.attempt != ctx.attempt]
    ctx.d.delete_pods = sorted(set(ctx.d.delete_pods) | set(stale))
    replaced = [n for n in roles.superseded(ctx.obs.live(), ctx.ledger, ctx.attempt) if n not in ctx.d.delete_pods]
    ctx.d.replace_pods = sorted(set(ctx.d.replace_pods) | set(replaced))
    _delete_podgroups(ctx, keep=ctx.names.podgroup(ctx.attempt))


def _delete_podgroups(ctx: Reconcile, keep: str | None, *, engines: bool = False) -> None:
    """Delete the gang objects of other attempts than `keep` (None: every attempt's); the engines' serving group
    (R-engine) too only with `engines` (the run ended: the engines outlive attempts and a suspension)."""
    for key in sorted(ctx.obs.children):
        kind, _, name = key.partition("/")
        if ctx.names.is_engine_group(name) and not engines:
            continue
        if kind in ("PodGroup", "Workload") and name != keep:
            ctx.d.delete.append(Child(kind, name))


def _ensure_children(ctx: Reconcile, *, pods: bool) -> None:
    """Create whatever child of the run is missing: the ConfigMap, the Services, the attempt's gang objects and the
    managed store first, then the engine pods, then the attempt's pods (`pods`; a running attempt gets only the
    replacement of a rollout restarted alone). Handlers stop at the first refused create, so a pod never exists
    before what it mounts or resolves. A ConfigMap whose content is out of date (after a resize) is updated before
    the pods that read it. A replacement waits for its role's backoff and for its predecessor to be gone."""
    run, names, obs = ctx.run, ctx.names, ctx.obs
    base = base_children(run, ctx.attempt)
    ctx.d.create = [c for c in base if c.key not in obs.children and not _store_pod_exists(c, obs)]
    config = next(c for c in base if c.kind == "ConfigMap")
    if config.key in obs.children and obs.config_hash != config_hash(run):
        ctx.d.update.append(config)  # a resize: the attempt's next pods read it, the rollout its engines
    ledger = ctx.ledger
    engines = ctx.engines()
    for replica, child in pool.engine_pods(run, ledger):  # one out of the pool is never replaced again
        _ensure_pod(ctx, child, engines.get((replica, child.node)), ROLE_ENGINE, replica)
    current = ctx.current()
    for role, rank in expected_group(run):
        if not pods and not (role == ROLE_ROLLOUT and ledger.replacing(ROLE_ROLLOUT)):
            continue
        generation = ledger.generation(role) if role == ROLE_ROLLOUT else 0
        child = Child("Pod", names.pod(role, rank, ctx.attempt, generation), role=role, rank=rank,
                      generation=generation)
        _ensure_pod(ctx, child, current.get((role, rank)), role, rank or 0)


def _engine_pool(ctx: Reconcile) -> None:
    """The engine pool resized (spec.rollout.engine.replicas changed; `pool`'s module docstring): an added replica's
    pod is created by `_ensure_children`; a removed one's is deleted once the run's ConfigMap holds the new list of
    URLs (the rollout stops sending to it first); status.engineReplicas follows the pool (`pool.reached_size`), and
    the condition EnginePoolResizing is True while it differs from the spec. When it starts and when it ends, the
    engines' serving gang object (gang scheduling) is brought to the new size (`Decision.resize_engine_gang`). The
    live pods of a replica out of the pool (a multi-node replica's other pods) are deleted (`pool.out_of_pool`)."""
    wanted = engine_replicas(ctx.run)
    if not wanted:
        return
    size = int(ctx.st.get("engineReplicas", wanted))
    live = ctx.obs.live()
    leaving = pool.removed(live, wanted)
    if leaving and ctx.obs.config_hash == config_hash(ctx.run):
        ctx.d.replace_pods = sorted(set(ctx.d.replace_pods) | set(leaving))
    ctx.d.replace_pods = sorted(set(ctx.d.replace_pods) | set(pool.out_of_pool(live, ctx.ledger)))
    reached = pool.reached_size(ctx.engines(), live, ctx.ledger, size=size, wanted=wanted, nodes=engine_nodes(ctx.run))
    ctx.st["engineReplicas"] = reached
    resizing = ctx.condition("EnginePoolResizing") or {}
    if reached != wanted:
        message = (f"resizing the engine pool from {size} to {wanted} replica(s): "
                   + (f"draining {', '.join(leaving)}" if leaving else f"waiting for replica(s) "
                      f"{', '.join(str(r) for r in range(size, wanted))} to be ready"))
        if resizing.get("status") != "True":
            ctx.d.events.append(("Normal", "ResizingEnginePool", bounded(message, EVENT_MESSAGE_MAX)))
            ctx.d.resize_engine_gang = True
        ctx.set_condition("EnginePoolResizing", "True", "Resizing", message)
        ctx.d.wake_in(1.0)
    elif resizing.get("status") == "True":
        message = f"the engine pool runs {wanted} replica(s)"
        ctx.set_condition("EnginePoolResizing", "False", "Resized", message)
        ctx.d.events.append(("Normal", "EnginePoolResized", message))
        ctx.d.resize_engine_gang = True  # again: the size may have changed once more meanwhile


def _ensure_pod(ctx: Reconcile, child: Child, seen: PodObs | None, role: str, replica: int) -> None:
    """Create `child` unless it exists (or was just created); a replacement of a role restarted alone only once
    nothing holds it (`roles.replacement_hold`: the backoff, a predecessor still there; clearing `replacing` once the
    replacement is seen)."""
    ledger = ctx.ledger
    if seen is not None or child.key in ctx.obs.children:
        if role in policy.ALONE_ROLES:
            ledger.seen(role, replica)
        return
    if role in policy.ALONE_ROLES and ledger.replacing(role, replica):
        hold = roles.replacement_hold(ledger, ctx.obs.pods, role, replica, child.name, attempt=ctx.attempt,
                                      timeout=ctx.fp.terminating_timeout_seconds, now=ctx.now.timestamp())
        if hold is not None:
            if hold.message is not None:
                ctx.st["message"] = bounded(hold.message)
                ctx.pods_ready(False, "TerminatingPods", hold.message)
            ctx.d.wake_in(hold.wait)
            return
        ctx.d.events.append(("Normal", "RoleRestarted", f"creating pod {child.name} (the {role}"
                             + (f" replica {replica}" if role == ROLE_ENGINE else "") + f" alone, generation "
                             f"{child.generation})"))
    ctx.d.create.append(child)


def _store_pod_exists(child: Child, obs: Observed) -> bool:
    return child.kind == "Pod" and any(p.role == ROLE_STORE and p.name == child.name and not p.deleting
                                       for p in obs.pods)


def _pods_ready(ctx: Reconcile) -> None:
    """Pending → Running once every pod of the attempt runs (or already finished) and every engine is ready; else say
    why not."""
    gone = {p.name for p in ctx.obs.gone}
    current = {k: p for k, p in ctx.current().items() if not p.deleting and p.name not in gone}
    expected = expected_group(ctx.run)
    group_up = len(current) == len(expected) and all(p.phase in ("Running", "Succeeded") for p in current.values())
    engine_reason, engine_message = _not_whole(ctx) if group_up else (None, "")
    if group_up and engine_reason is None:
        engines = pool.pool_size(ctx.ledger, engine_replicas(ctx.run))
        message = (f"attempt {ctx.attempt}: rollout and {ctx.spec.trainer.replicas} trainer(s) running"
                   + (f", {engines} engine(s) ready" if engines else ""))
        ctx.phase_to("Running", "PodsRunning", message, condition="Running", event=("Normal", "Running"))
        ctx.pods_ready(True, "PodsRunning", message)
        return
    refusal = ctx.obs.refusal
    gated = [p for p in current.values() if KUEUE_GATE in p.gated]
    waiting = next((p for p in sorted(current.values(), key=lambda p: p.name) if p.waiting), None)
    not_running = sum(1 for p in current.values() if p.phase == "Pending") + len(expected) - len(current)
    if refusal is not None:
        reason, message = "FailedCreate", refusal.describe()
    elif gated:
        reason = "WaitingForAdmission"
        message = (f"attempt {ctx.attempt}: {len(gated)} pod(s) wait for Kueue to admit the workload "
                   f"(LocalQueue {ctx.spec.queue_name or '?'})")
    elif waiting is not None:
        reason, message = waiting.waiting_reason or "ContainersWaiting", waiting.waiting or ""
    elif engine_reason is not None:
        reason, message = engine_reason, f"attempt {ctx.attempt}: {engine_message}"
    else:
        reason, message = "WaitingForPods", f"attempt {ctx.attempt}: waiting for {not_running} pod(s) to start"
    ctx.st["message"] = bounded(message)
    ctx.pods_ready(False, reason, message)


def _read_progress(ctx: Reconcile, *, succeeded: bool = False) -> None:
    """Copy the store's progress into the status (and status.progress: `pace.progress_status`); ProgressUnknown says
    whether it could be read."""
    obs = ctx.obs.progress
    record = obs.value if obs is not None else None
    if record is not None:
        for key, value in (("step", record.step), ("samplesConsumed", record.samples_consumed),
                           ("lastGlobalBatchSize", record.last_global_batch_size), ("rollout", record.rollout)):
            if value is not None:
                ctx.st[key] = value
    if ctx.run is not None:
        progress = progress_status(ctx.st.get("progress"), record, ctx.spec.rollout.num_rollouts,
                                   succeeded=succeeded)
        if progress is not None:
            ctx.st["progress"] = progress
    if obs is None or ctx.st.get("phase") in TERMINAL_PHASES:
        return
    if obs.error is not None:
        ctx.set_condition("ProgressUnknown", "True", "StoreUnreadable", f"cannot read progress from the store: "
                          f"{obs.error} (hang detection pauses while it cannot be read)")
    elif ctx.condition("ProgressUnknown") is not None:
        ctx.set_condition("ProgressUnknown", "False", "ProgressRead", "progress read from the store")


def status_changes(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of `new` that differ from `old` (a merge patch of the status); an empty list or None is not written
    where there was nothing."""
    old = dict(old or {})
    return {k: v for k, v in new.items()
            if k in _STATUS_KEYS and old.get(k) != v and not (v in (None, []) and k not in old)}


def invalid_spec(status: Mapping[str, Any] | None, message: str, *, now: dt.datetime,
                 generation: int | None = None) -> Decision:
    """A run whose spec cannot even be parsed: Failed (InvalidSpec) at once, unless already terminal (sticky)."""
    st: dict[str, Any] = {k: v for k, v in dict(status or {}).items() if k in _STATUS_KEYS}
    st["conditions"] = [dict(c) for c in st.get("conditions") or []]
    if generation is not None:
        st["observedGeneration"] = generation
    ctx = Reconcile(None, st, Observed(generation=generation), now, Decision(status=st))  # type: ignore[arg-type]
    if st.get("phase") in TERMINAL_PHASES:
        return ctx.d
    st.setdefault("restarts", 0)
    st.setdefault("attempt", 0)
    st["completionTime"] = ctx.now_s
    ctx.phase_to("Failed", "InvalidSpec", message, condition="Failed", event=("Warning", "InvalidSpec"))
    return ctx.d
