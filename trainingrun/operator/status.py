"""The lifecycle of a TrainingRun as a pure function: (spec, current status, observed pods, store progress, now) →
the next status, the actions to take and the events to post. `trainingrun.operator.handlers` feeds it observations
(kopf's pod index, the store) and performs the actions; nothing here does I/O, so every rule is unit-tested.

Phases: Pending (pods of the attempt created, not all running) → Running (every pod of the attempt running or the
rollout already done) → Succeeded (all trainers Succeeded) | Failed. Restarting: a pod of the attempt failed or was
deleted, or no progress for `progressDeadlineSeconds`; all its pods are deleted and, after `backoffSeconds` (counted
from the Restarting condition's transition time) and once they are gone, the next attempt starts. Suspended: every
rollout/trainer pod deleted; `suspend: false` starts a new attempt (trainers resume from the last checkpoint).
Terminal phases are sticky: nothing observed afterwards moves a run out of Succeeded or Failed.

Failure policy:
  (the rules themselves: `trainingrun.failure_policy`)
  - a failed container with exit code `EXIT_CONFIG_ERROR` (78) fails the run at once (ConfigError);
  - otherwise a whole-group restart while `restarts < maxRestarts`, else Failed (BackoffLimitExceeded) with the failing
    pod, container, exit code and reason in the message;
  - `activeDeadlineSeconds` counted from startTime (reset on resume) → Failed (DeadlineExceeded);
  - a schema-valid spec that cannot run in a cluster (`render.cluster_errors`) → Failed (InvalidSpec) at once.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainingrun.api.constants import GROUP_ROLES, LABEL_ATTEMPT, LABEL_RANK, LABEL_ROLE
from trainingrun.api.models import TERMINAL_PHASES, TrainingRun
from trainingrun.operator import render
from trainingrun import failure_policy as policy

CONDITION_TYPES = ("Running", "Restarting", "Suspended", "Succeeded", "Failed")


def now_utc() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def fmt_time(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(s: str | None) -> dt.datetime | None:
    if not s:
        return None
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00"))


@dataclass(frozen=True)
class PodObs:
    """What the operator needs to know about one pod of a run."""

    name: str
    role: str
    rank: int | None
    attempt: int | None
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    deleting: bool = False
    failure: str | None = None  # "pod P container C exited with code N (reason R)" for a Failed pod
    exit_codes: tuple[int, ...] = ()
    waiting: str | None = None  # e.g. "container trainer waiting: ImagePullBackOff (...)"

    def as_failure(self) -> policy.Failure:
        """This (Failed) pod as the failure policy sees it."""
        codes = [c for c in self.exit_codes if c != 0]
        code = policy.EXIT_CONFIG_ERROR if policy.EXIT_CONFIG_ERROR in codes else (codes[0] if codes else None)
        return policy.Failure(name=self.name, kind=policy.classify(code), description=self.failure or
                              f"pod {self.name} failed", role=self.role, rank=self.rank, code=code)


def observe_pod(pod: Mapping[str, Any]) -> PodObs:
    """Summarise a Pod object (as served by the API) into a PodObs."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    status = pod.get("status") or {}
    name = meta.get("name", "?")
    rank = labels.get(LABEL_RANK)
    attempt = labels.get(LABEL_ATTEMPT)
    phase = status.get("phase") or "Pending"
    codes: list[int] = []
    failure = None
    waiting = None
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        term = state.get("terminated") or (cs.get("lastState") or {}).get("terminated")
        if term and term.get("exitCode") is not None:
            code = int(term["exitCode"])
            codes.append(code)
            if code != 0 and failure is None:
                reason = term.get("reason") or "Error"
                msg = f"; {term['message'].strip()[:200]}" if term.get("message") else ""
                failure = f"pod {name} container {cs.get('name', '?')} exited with code {code} (reason {reason}{msg})"
        wait = state.get("waiting")
        if wait and wait.get("reason") not in (None, "ContainerCreating", "PodInitializing") and waiting is None:
            detail = f": {wait['message'][:200]}" if wait.get("message") else ""
            waiting = f"pod {name} container {cs.get('name', '?')} waiting: {wait['reason']}{detail}"
    if phase == "Pending" and waiting is None:
        # The scheduler's verdict (e.g. "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.") is the reason a
        # GPU run sits in Pending; without it the status would only say "waiting for N pod(s) to start".
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                detail = f": {cond['message'][:200]}" if cond.get("message") else ""
                waiting = f"pod {name} not scheduled ({cond.get('reason') or 'Unschedulable'}){detail}"
                break
    if phase == "Failed" and failure is None:
        reason = status.get("reason") or "Failed"
        msg = f": {status['message'][:200]}" if status.get("message") else ""
        failure = f"pod {name} failed (reason {reason}{msg})"
    return PodObs(
        name=name,
        role=labels.get(LABEL_ROLE, "?"),
        rank=int(rank) if rank is not None and str(rank).isdigit() else None,
        attempt=int(attempt) if attempt is not None and str(attempt).isdigit() else None,
        phase=phase,
        deleting=bool(meta.get("deletionTimestamp")),
        failure=failure,
        exit_codes=tuple(codes),
        waiting=waiting,
    )


@dataclass
class Decision:
    """The next status (full, camelCase) and what to do."""

    status: dict[str, Any]
    create_base: bool = False  # config map, services, store, podgroup (idempotent)
    create_pods: list[tuple[str, int | None]] = field(default_factory=list)  # (role, rank) of `status.attempt`
    create_store_pod: bool = False
    delete_pods: list[str] = field(default_factory=list)
    delete_run: bool = False
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    restarted: bool = False
    requeue_after: float | None = None  # wake-up hint for backoff/ttl/deadlines


def _set_condition(conds: list[dict], type_: str, status: str, reason: str, message: str, now: str) -> None:
    for c in conds:
        if c["type"] == type_:
            if c.get("status") != status:
                c["lastTransitionTime"] = now
            c.update(status=status, reason=reason, message=message)
            return
    conds.append({"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": now})


def _condition(conds: list[dict], type_: str) -> dict | None:
    return next((c for c in conds if c.get("type") == type_), None)


def _only(conds: list[dict], type_: str | None, reason: str, message: str, now: str) -> None:
    """Mark `type_` True and every other lifecycle condition False."""
    for t in CONDITION_TYPES:
        if t == type_:
            _set_condition(conds, t, "True", reason, message, now)
        elif _condition(conds, t) is not None:
            _set_condition(conds, t, "False", reason, message, now)


def expected_group(run: TrainingRun) -> list[tuple[str, int | None]]:
    return [("rollout", None)] + [("trainer", r) for r in range(run.spec.trainer.replicas)]


def decide(
    run: TrainingRun,
    status: Mapping[str, Any] | None,
    pods: list[PodObs],
    *,
    now: dt.datetime,
    generation: int | None = None,
    progress: Mapping[str, Any] | None = None,
    spec_errors: list[str] | None = None,
) -> Decision:
    """One reconcile step. `status` is the TrainingRun's current status (or None for a new run); `pods` every pod
    labelled with the run; `progress` the store's "progress" value (or None)."""
    st: dict[str, Any] = {
        "phase": None, "conditions": [], "restarts": 0, "attempt": 0,
        "step": 0, "samplesConsumed": 0, "lastGlobalBatchSize": 0, "rollout": 0,
    }
    st.update({k: v for k, v in dict(status or {}).items() if k in _STATUS_KEYS})
    st["conditions"] = [dict(c) for c in st.get("conditions") or []]
    conds = st["conditions"]
    now_s = fmt_time(now)
    d = Decision(status=st)
    spec = run.spec
    fp = spec.failure_policy
    phase = st["phase"]
    if generation is not None:
        st["observedGeneration"] = generation
    if progress:
        for key, src in (("step", "step"), ("samplesConsumed", "samples_consumed"),
                         ("lastGlobalBatchSize", "last_global_batch_size"), ("rollout", "rollout")):
            value = progress.get(src, progress.get(key))
            if isinstance(value, int) and value >= 0:
                st[key] = value

    group = [p for p in pods if p.role in GROUP_ROLES]
    live = [p for p in pods if p.phase not in ("Succeeded", "Failed") and not p.deleting]

    def fail(reason: str, message: str) -> Decision:
        st["phase"] = "Failed"
        st["message"] = message
        st["completionTime"] = now_s
        _only(conds, "Failed", reason, message, now_s)
        d.events.append(("Warning", reason, message))
        d.delete_pods = [p.name for p in live]
        d.create_base = d.create_store_pod = False
        d.create_pods = []
        return d

    # --- terminal: sticky; only clean up running pods and honour ttlSecondsAfterFinished.
    if phase in TERMINAL_PHASES:
        d.delete_pods = [p.name for p in live]
        ttl = spec.ttl_seconds_after_finished
        done = parse_time(st.get("completionTime"))
        if ttl is not None and done is not None:
            left = (done + dt.timedelta(seconds=ttl) - now).total_seconds()
            if left <= 0:
                d.delete_run = True
                d.events.append(("Normal", "Deleted", f"ttlSecondsAfterFinished={ttl} elapsed; deleting the run"))
            else:
                d.requeue_after = left
        return d

    if spec_errors:
        return fail("InvalidSpec", "the spec cannot run in a cluster: " + "; ".join(spec_errors))

    group_live = [p for p in group if p.phase not in ("Succeeded", "Failed") and not p.deleting]

    # --- suspend / resume
    if spec.suspend:
        d.delete_pods = [p.name for p in group_live]
        if phase != "Suspended":
            st["phase"] = "Suspended"
            st["message"] = "suspended: pods deleted; set suspend: false to resume from the last checkpoint"
            _only(conds, "Suspended", "Suspended", st["message"], now_s)
            d.events.append(("Normal", "Suspended", f"deleting {len(d.delete_pods)} pod(s)"))
        return d
    if phase == "Suspended":
        st["attempt"] += 1
        phase = st["phase"] = "Pending"
        st["startTime"] = now_s
        st["message"] = f"resumed: attempt {st['attempt']} starting from the last checkpoint"
        _only(conds, None, "Resumed", st["message"], now_s)
        d.events.append(("Normal", "Resumed", st["message"]))
        d.create_base = True
        d.create_pods = expected_group(run)
        d.create_store_pod = render.store_is_managed(run)
        return d
    if phase is None:
        st["phase"] = "Pending"
        st["startTime"] = now_s
        st["message"] = f"creating {spec.trainer.replicas} trainer pod(s) and the rollout pod"
        d.events.append(("Normal", "Created", st["message"]))
        d.create_base = True
        d.create_pods = expected_group(run)
        d.create_store_pod = render.store_is_managed(run)
        return d

    # --- activeDeadlineSeconds
    start = parse_time(st.get("startTime"))
    if spec.active_deadline_seconds is not None and start is not None:
        left = (start + dt.timedelta(seconds=spec.active_deadline_seconds) - now).total_seconds()
        if left <= 0:
            return fail("DeadlineExceeded", f"the run was active longer than activeDeadlineSeconds="
                        f"{spec.active_deadline_seconds}")
        d.requeue_after = left

    attempt = st["attempt"]
    current = [p for p in group if p.attempt == attempt]
    stale = [p for p in group_live if p.attempt != attempt]
    d.delete_pods = [p.name for p in stale]

    if render.store_is_managed(run) and not any(p.role == "store" and not p.deleting for p in pods):
        d.create_store_pod = True

    # --- Restarting: wait for backoff and for the previous attempt's pods to be gone.
    if phase == "Restarting":
        since = parse_time((_condition(conds, "Restarting") or {}).get("lastTransitionTime")) or now
        wait = (since + dt.timedelta(seconds=fp.backoff_seconds) - now).total_seconds()
        leftovers = [p for p in group if p.attempt != attempt and p.phase not in ("Succeeded", "Failed")]
        if wait > 0 or leftovers:
            d.requeue_after = max(wait, 1.0)
            return d
        st["phase"] = "Pending"
        st["message"] = f"attempt {attempt} starting (restart {st['restarts']} of maxRestarts={fp.max_restarts})"
        _set_condition(conds, "Restarting", "False", "Restarted", st["message"], now_s)
        d.events.append(("Normal", "Restarted", st["message"]))
        d.create_base = True
        d.create_pods = expected_group(run)
        return d

    by_key = {(p.role, p.rank): p for p in current if not p.deleting}
    expected = expected_group(run)
    cause = policy.root_cause(p.as_failure() for p in current if p.phase == "Failed")
    failure = cause.description if cause is not None else None
    if failure is None and phase == "Running":
        for role, rank in expected:
            p = by_key.get((role, rank))
            if p is None:
                gone = next((q for q in current if (q.role, q.rank) == (role, rank)), None)
                name = gone.name if gone else render.Names(run.metadata.name).pod(role, rank, attempt)
                failure = f"pod {name} was deleted while the run was running"
                cause = policy.Failure(name=name, kind=policy.ExitKind.FAILURE, description=failure, role=role,
                                       rank=rank)
                break
    if failure is None and phase == "Running" and fp.progress_deadline_seconds:
        running_since = parse_time((_condition(conds, "Running") or {}).get("lastTransitionTime")) or now
        last = running_since
        ptime = progress.get("time") if progress else None
        if isinstance(ptime, (int, float)):
            last = max(last, dt.datetime.fromtimestamp(ptime, dt.timezone.utc))
        left = policy.seconds_left(last.timestamp(), fp.progress_deadline_seconds, now.timestamp())
        assert left is not None
        if left < 0:
            idle = (now - last).total_seconds()
            failure = (f"no progress for {int(idle)}s (progressDeadlineSeconds={fp.progress_deadline_seconds}, "
                       f"last step {st['step']})")
            cause = policy.Failure(name="progress deadline", kind=policy.ExitKind.FAILURE, description=failure)
        else:
            d.requeue_after = left if d.requeue_after is None else min(d.requeue_after, left)

    if cause is not None and failure is not None:
        verdict = policy.on_failure(cause, restarts=st["restarts"], max_restarts=fp.max_restarts)
        if not verdict.restart:
            sep = ": " if cause.kind is policy.ExitKind.CONFIG_ERROR else "; "
            return fail(verdict.reason, f"{failure}{sep}{verdict.why}")
        st["restarts"] += 1
        st["attempt"] = attempt + 1
        st["phase"] = "Restarting"
        st["message"] = (f"{failure}; restarting the whole group as attempt {attempt + 1} "
                         f"(restart {st['restarts']} of {fp.max_restarts}) in {fp.backoff_seconds}s")
        _only(conds, "Restarting", verdict.reason, st["message"], now_s)
        d.events.append(("Warning", "Restarting", st["message"]))
        d.delete_pods = sorted({p.name for p in group_live})
        d.restarted = True
        d.requeue_after = max(float(fp.backoff_seconds), 1.0)
        return d

    trainers = [by_key.get(("trainer", r)) for r in range(spec.trainer.replicas)]
    if all(t is not None and t.phase == "Succeeded" for t in trainers):
        st["phase"] = "Succeeded"
        st["completionTime"] = now_s
        st["message"] = f"all {len(trainers)} trainer(s) succeeded"
        _only(conds, "Succeeded", "Completed", st["message"], now_s)
        d.events.append(("Normal", "Succeeded", st["message"]))
        d.delete_pods = [p.name for p in live]
        return d

    if phase == "Pending":
        missing = [(role, rank) for role, rank in expected if (role, rank) not in by_key]
        if missing:
            d.create_pods = missing  # idempotent: a 409 means it exists already
            return d
        started = all(
            p.phase == "Running" or (p.phase == "Succeeded") for p in by_key.values()
        )
        if started:
            st["phase"] = "Running"
            st["message"] = f"attempt {attempt}: rollout and {len(trainers)} trainer(s) running"
            _only(conds, "Running", "PodsRunning", st["message"], now_s)
            d.events.append(("Normal", "Running", st["message"]))
        else:
            waiting = next((p.waiting for p in by_key.values() if p.waiting), None)
            not_running = sum(1 for p in by_key.values() if p.phase == "Pending")
            st["message"] = waiting or f"attempt {attempt}: waiting for {not_running} pod(s) to start"
    return d


_STATUS_KEYS = {
    "phase", "conditions", "restarts", "attempt", "step", "samplesConsumed", "lastGlobalBatchSize", "rollout",
    "startTime", "completionTime", "observedGeneration", "message",
}


def status_changes(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of `new` that differ from `old` (a merge patch of the status)."""
    old = dict(old or {})
    return {k: v for k, v in new.items() if k in _STATUS_KEYS and old.get(k) != v and not (v is None and k not in old)}


def invalid_spec(status: Mapping[str, Any] | None, message: str, *, now: dt.datetime,
                 generation: int | None = None) -> Decision:
    """A run whose spec cannot even be parsed: Failed (InvalidSpec) at once, unless already terminal (sticky)."""
    st: dict[str, Any] = {k: v for k, v in dict(status or {}).items() if k in _STATUS_KEYS}
    st["conditions"] = [dict(c) for c in st.get("conditions") or []]
    if generation is not None:
        st["observedGeneration"] = generation
    d = Decision(status=st)
    if st.get("phase") in TERMINAL_PHASES:
        return d
    now_s = fmt_time(now)
    st.update(phase="Failed", message=message, completionTime=now_s)
    st.setdefault("restarts", 0)
    st.setdefault("attempt", 0)
    _only(st["conditions"], "Failed", "InvalidSpec", message, now_s)
    d.events.append(("Warning", "InvalidSpec", message))
    return d
