"""What the operator observes about a run, as plain values: its pods (`PodObs`, summarised from Pod objects), the
children that exist, the store's progress (or why it could not be read) and the API server's last refusal to create
a child. `trainingrun.operator.handlers` gathers them (kopf indexes, pod events, the store, its own create calls);
`trainingrun.operator.status.decide` decides from them. Pure: nothing here does I/O.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainingrun import failure_policy as policy
from trainingrun.api.constants import (
    LABEL_ATTEMPT,
    LABEL_ENGINE_NODE,
    LABEL_RANK,
    LABEL_REPLICA,
    LABEL_ROLE,
    LABEL_ROLE_ATTEMPT,
)
from trainingrun.contract.progress import ProgressRecord

# Pod status reasons of a pod ended by the platform, not by its program: the kubelet's node-pressure eviction,
# preemption, a lost node, a node shutting down. (Pod conditions DisruptionTarget / TerminationTarget say the same.)
DISRUPTION_REASONS = frozenset({"Evicted", "Preempting", "NodeLost", "Shutdown", "NodeShutdown"})
DISRUPTION_CONDITIONS = ("DisruptionTarget", "TerminationTarget")
KUEUE_GATE = "kueue.x-k8s.io/admission"


def parse_time(s: str | None) -> dt.datetime | None:
    if not s:
        return None
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00"))


def _unix(s: str | None) -> float | None:
    t = parse_time(s)
    return t.timestamp() if t is not None else None


@dataclass(frozen=True)
class PodObs:
    """What the operator needs to know about one pod of a run."""

    name: str
    role: str
    rank: int | None  # a trainer's rank; an engine's replica index
    attempt: int | None
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    generation: int = 0  # rollout and engine pods: the role's generation (label role-attempt; 0 when absent)
    ready: bool = False  # Running with every container ready (the Ready condition, or the containers' ready flags)
    reasons: frozenset[str] = frozenset()  # Kubernetes reasons of its end (failure_policy.Failure.reasons)
    deleting: bool = False
    deleted_at: float | None = None  # unix time of metadata.deletionTimestamp
    failure: str | None = None  # "pod P container C exited with code N (reason R)" for a Failed pod
    exit_codes: tuple[int, ...] = ()
    finished_at: float | None = None  # unix time the first failing container finished
    waiting: str | None = None  # e.g. "pod P container trainer waiting: ImagePullBackOff (...)"
    waiting_reason: str | None = None  # e.g. ImagePullBackOff, Unschedulable
    disruption: str | None = None  # e.g. "pod P was evicted (DisruptionTarget EvictionByEvictionAPI: ...)"
    gated: tuple[str, ...] = ()  # spec.schedulingGates (Kueue holds the pods of a workload until it is admitted)
    restarts: int = 0  # containers restarted in place by the kubelet (restartPolicy Always: store, engine)
    node: int = 0  # an engine pod's node within its replica (label engine-node; 0: the leader, or absent)

    def as_failure(self) -> policy.Failure:
        """This pod, which failed or was disrupted, as the failure policy sees it."""
        codes = [c for c in self.exit_codes if c != 0]
        code = policy.EXIT_CONFIG_ERROR if policy.EXIT_CONFIG_ERROR in codes else (codes[0] if codes else None)
        description = self.disruption or self.failure or f"pod {self.name} failed"
        return policy.Failure(name=self.name, kind=policy.classify(code, disrupted=self.disruption is not None),
                              description=description, role=self.role, rank=self.rank, code=code,
                              finished_at=self.finished_at, reasons=self.reasons)

    def as_deleted(self, phase: str) -> policy.Failure:
        """This pod, deleted while the run was `phase` (not by the operator), as the failure policy sees it."""
        return policy.Failure(name=self.name, kind=policy.ExitKind.FAILURE, role=self.role, rank=self.rank,
                              description=f"pod {self.name} was deleted while the run was {phase.lower()}",
                              reasons=self.reasons | {policy.DELETED})


def _detail(message: str | None) -> str:
    return f": {message.strip()[:200]}" if message else ""


def observe_pod(pod: Mapping[str, Any]) -> PodObs:
    """Summarise a Pod object (as served by the API) into a PodObs."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    status = pod.get("status") or {}
    spec = pod.get("spec") or {}
    name = meta.get("name", "?")
    rank = labels.get(LABEL_RANK, labels.get(LABEL_REPLICA))
    attempt = labels.get(LABEL_ATTEMPT)
    generation = labels.get(LABEL_ROLE_ATTEMPT)
    node = labels.get(LABEL_ENGINE_NODE)
    phase = status.get("phase") or "Pending"
    codes: list[int] = []
    failure = finished = waiting = waiting_reason = None
    restarts = 0
    reasons: set[str] = set()
    statuses = status.get("containerStatuses") or []
    for cs in statuses:
        restarts += int(cs.get("restartCount") or 0)
        state = cs.get("state") or {}
        term = state.get("terminated") or (cs.get("lastState") or {}).get("terminated")
        if term and term.get("exitCode") is not None:
            code = int(term["exitCode"])
            codes.append(code)
            if code != 0 and term.get("reason"):
                reasons.add(str(term["reason"]))
            if code != 0 and failure is None:
                failure = (f"pod {name} container {cs.get('name', '?')} exited with code {code} "
                           f"(reason {term.get('reason') or 'Error'}{'; ' + term['message'].strip()[:200] if term.get('message') else ''})")
                finished = _unix(term.get("finishedAt"))
        wait = state.get("waiting")
        if wait and wait.get("reason") not in (None, "ContainerCreating", "PodInitializing") and waiting is None:
            waiting = f"pod {name} container {cs.get('name', '?')} waiting: {wait['reason']}{_detail(wait.get('message'))}"
            waiting_reason = wait["reason"]
    conditions = status.get("conditions") or []
    if phase == "Pending" and waiting is None:
        # The scheduler's verdict (e.g. "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.") is the reason a
        # GPU run sits in Pending; without it the status would only say "waiting for N pod(s) to start".
        for cond in conditions:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                waiting_reason = cond.get("reason") or "Unschedulable"
                waiting = f"pod {name} not scheduled ({waiting_reason}){_detail(cond.get('message'))}"
                break
    disruption = None
    for cond in conditions:
        if cond.get("type") in DISRUPTION_CONDITIONS and cond.get("status") == "True":
            disruption = (f"pod {name} was disrupted ({cond['type']} {cond.get('reason') or ''}"
                          f"{_detail(cond.get('message'))})")
            reasons.update(r for r in (cond["type"], cond.get("reason")) if r)
            break
    if status.get("reason"):
        reasons.add(str(status["reason"]))  # Evicted, DeadlineExceeded, NodeLost, ...
    if disruption is None and status.get("reason") in DISRUPTION_REASONS:
        disruption = f"pod {name} was disrupted (reason {status['reason']}{_detail(status.get('message'))})"
    ready_condition = next((c.get("status") == "True" for c in conditions if c.get("type") == "Ready"), None)
    ready = phase == "Running" and (ready_condition if ready_condition is not None else
                                    bool(statuses) and all(cs.get("ready") for cs in statuses))
    if phase == "Failed" and failure is None:
        failure = f"pod {name} failed (reason {status.get('reason') or 'Failed'}{_detail(status.get('message'))})"
    return PodObs(
        name=name,
        role=labels.get(LABEL_ROLE, "?"),
        rank=int(rank) if rank is not None and str(rank).isdigit() else None,
        attempt=int(attempt) if attempt is not None and str(attempt).isdigit() else None,
        node=int(node) if node is not None and str(node).isdigit() else 0,
        phase=phase,
        deleting=bool(meta.get("deletionTimestamp")),
        deleted_at=_unix(meta.get("deletionTimestamp")),
        failure=failure,
        exit_codes=tuple(codes),
        finished_at=finished,
        waiting=waiting,
        waiting_reason=waiting_reason,
        disruption=disruption,
        gated=tuple(g.get("name", "") for g in spec.get("schedulingGates") or []),
        restarts=restarts,
        generation=int(generation) if generation is not None and str(generation).isdigit() else 0,
        ready=ready,
        reasons=frozenset(reasons),
    )


@dataclass(frozen=True)
class ProgressObs:
    """The trainers' progress record of a run (None: nothing written yet), or the error that kept the operator from
    reading it (then `value` is the last record read, if any). A stored JSON object given as `value` is read as the
    store's is, through `ProgressRecord.from_json` (CorruptPayload naming the field when malformed)."""

    value: ProgressRecord | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.value, Mapping):
            object.__setattr__(self, "value", ProgressRecord.from_json(dict(self.value)))


@dataclass(frozen=True)
class Refusal:
    """The API server's last refusal to create one of the run's children."""

    kind: str
    name: str
    code: int  # HTTP status; 0 for a transport error (timeout, connection refused)
    message: str
    permanent: bool  # 400/422: the object itself is invalid, retrying cannot help

    def describe(self) -> str:
        return f"cannot create {self.kind} {self.name}: {self.message}"


def is_permanent(code: int) -> bool:
    """A create refused with 400 (BadRequest) or 422 (Invalid) fails the same way every time; everything else
    (403 quota, 404 namespace or API not there yet, 409, 429, 5xx, timeouts) may pass later."""
    return code in (400, 422)


@dataclass(frozen=True)
class Observed:
    """Everything `status.decide` looks at, besides the run's spec and status."""

    pods: tuple[PodObs, ...] = ()  # every pod labelled with the run
    gone: tuple[PodObs, ...] = ()  # the last state of the run's pods that were seen deleted
    # "Kind/name" of the existing ConfigMap, Services and PodGroups, and of children just created and not yet seen
    children: frozenset[str] = field(default_factory=frozenset)
    config_hash: str | None = None  # the run's ConfigMap's spec-hash annotation, when it exists
    progress: ProgressObs | None = None
    refusal: Refusal | None = None
    spec_errors: tuple[str, ...] = ()  # checks.cluster_errors
    memory_errors: tuple[str, ...] = ()  # checks.memory_errors: refuse a new run only (status._invalid_spec)
    generation: int | None = None

    def live(self) -> list[PodObs]:
        """The pods that run or wait to run (not finished, not being deleted)."""
        return [p for p in self.pods if p.phase not in ("Succeeded", "Failed") and not p.deleting]

    def pick(self, keep: Callable[[PodObs], bool], key: Callable[[PodObs], Any]) -> dict[Any, PodObs]:
        """The pod to judge per `key` among those `keep` accepts: the live one, else one being deleted, else the last
        state of one seen deleted."""
        out: dict[Any, PodObs] = {}
        for source in (self.gone, [p for p in self.pods if p.deleting], [p for p in self.pods if not p.deleting]):
            for p in source:
                if keep(p):
                    out[key(p)] = p
        return out

    def failure_of(self, p: PodObs, phase: str) -> policy.Failure | None:
        """Pod `p` as a failure when it failed, was disrupted or was deleted while the run was `phase` (not by the
        operator: a pod it deletes is of an older attempt or generation, or goes with the attempt); None while it runs
        or after it succeeded."""
        if p.phase == "Failed" or p.disruption is not None:
            return p.as_failure()
        if (p.deleting or p.name in {g.name for g in self.gone}) and p.phase != "Succeeded":
            return p.as_deleted(phase)
        return None
