"""One reconcile of a TrainingRun, as `trainingrun.operator.status.decide` builds it: the run, the status being written,
the observations, the time, and the `Decision` (the next status and what to do). `Reconcile` holds what every rule
asks of them — the conditions (one per type, Kubernetes conventions: observedGeneration, reason, message cut to fit
the CRD, lastTransitionTime), the phase and its lifecycle condition, failing the run, the attempt's current pods and
the engine pool's (`pool.current_engines`) — so the rules of `status`, `pool` and `roles` stay short. Pure: no I/O.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from typing import Any

from trainingrun import failure_policy as policy
from trainingrun.api.constants import GROUP_ROLES, ROLE_ROLLOUT
from trainingrun.api.models import MESSAGE_MAX_LENGTH, TrainingRun
from trainingrun.operator import pool
from trainingrun.operator.observe import Observed, PodObs
from trainingrun.operator.roles import RoleLedger
from trainingrun.operator.vocabulary import Child, Names

LIFECYCLE_CONDITIONS = ("Running", "Restarting", "Suspended", "Succeeded", "Failed")
EVENT_MESSAGE_MAX = 1024
_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")


def now_utc() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def fmt_time(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def bounded(message: str, limit: int = MESSAGE_MAX_LENGTH) -> str:
    """`message` cut to at most `limit` characters, saying how much was cut."""
    if len(message) <= limit:
        return message
    cut = len(message) - limit
    tail = f"... ({cut + 40} more characters)"
    return message[: limit - len(tail)] + tail


@dataclass
class Decision:
    """The next status (full, camelCase) and what to do."""

    status: dict[str, Any]
    create: list[Child] = field(default_factory=list)  # in order: base children, then the attempt's pods
    update: list[Child] = field(default_factory=list)  # children to bring up to date (the ConfigMap)
    delete: list[Child] = field(default_factory=list)  # children other than pods to delete
    delete_pods: list[str] = field(default_factory=list)  # pods whose group ends (Kueue: not retriable in group)
    replace_pods: list[str] = field(default_factory=list)  # live pods of an older generation of their role: their
    #                                                         replacement joins the same group
    delete_run: bool = False
    resize_engine_gang: bool = False  # the engine pool is resized: bring its serving gang object to the new size
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    restarted: bool = False  # a counted restart (the operator's restart counter)
    requeue_after: float | None = None  # wake-up hint for backoff/ttl/deadlines

    def wake_in(self, seconds: float) -> None:
        seconds = max(seconds, 0.05)
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)


@dataclass
class Reconcile:
    """One reconcile: the run, the status being built, the observations, the decision."""

    run: TrainingRun
    st: dict[str, Any]
    obs: Observed
    now: dt.datetime
    d: Decision

    @property
    def spec(self):
        return self.run.spec

    @property
    def fp(self):
        return self.run.spec.failure_policy

    @property
    def policy(self) -> policy.Policy:
        return policy.Policy.from_spec(self.run.spec.failure_policy)

    @property
    def ledger(self) -> RoleLedger:
        return RoleLedger(self.st["roleRestarts"])

    @property
    def now_s(self) -> str:
        return fmt_time(self.now)

    @property
    def attempt(self) -> int:
        return int(self.st["attempt"])

    @property
    def names(self) -> Names:
        return Names(self.run.metadata.name)

    # -- conditions
    def condition(self, type_: str) -> dict | None:
        return next((c for c in self.st["conditions"] if c.get("type") == type_), None)

    def set_condition(self, type_: str, status: str, reason: str, message: str) -> None:
        reason = reason if _REASON.match(reason or "") else "Unknown"
        message = bounded(message)
        for c in self.st["conditions"]:
            if c["type"] == type_:
                if c.get("status") != status:
                    c["lastTransitionTime"] = self.now_s
                c.update(status=status, reason=reason, message=message)
                if self.obs.generation is not None:
                    c["observedGeneration"] = self.obs.generation
                return
        cond = {"type": type_, "status": status, "reason": reason, "message": message,
                "lastTransitionTime": self.now_s}
        if self.obs.generation is not None:
            cond["observedGeneration"] = self.obs.generation
        self.st["conditions"].append(cond)

    def phase_to(self, phase: str, reason: str, message: str, *, condition: str | None = None,
                 event: tuple[str, str] | None = None) -> None:
        """Set phase and message; mark lifecycle condition `condition` True and the others False; post an event."""
        self.st["phase"] = phase
        self.st["message"] = bounded(message)
        for t in LIFECYCLE_CONDITIONS:
            if t == condition:
                self.set_condition(t, "True", reason, message)
            elif self.condition(t) is not None:
                self.set_condition(t, "False", reason, message)
        if event is not None:
            self.d.events.append((event[0], event[1], bounded(message, EVENT_MESSAGE_MAX)))

    def pods_ready(self, ready: bool, reason: str, message: str) -> None:
        self.set_condition("PodsReady", "True" if ready else "False", reason, message)

    def fail(self, reason: str, message: str) -> bool:
        self.st["completionTime"] = self.now_s
        self.phase_to("Failed", reason, message, condition="Failed", event=("Warning", reason))
        self.pods_ready(False, reason, "the run failed")
        self.d.create, self.d.update = [], []
        self.d.delete_pods = sorted({p.name for p in self.obs.live()})
        return True

    # -- the attempt's pods
    def current(self) -> dict[tuple[str, int | None], PodObs]:
        """The attempt's rollout (of its current generation) and trainer pods by (role, rank): the live pod, else one
        being deleted, else the last state of one seen deleted."""
        rollout = self.ledger.generation(ROLE_ROLLOUT)
        return self.obs.pick(lambda p: p.role in GROUP_ROLES and p.attempt == self.attempt and
                             (p.role != ROLE_ROLLOUT or p.generation == rollout), lambda p: (p.role, p.rank))

    def engines(self) -> pool.Engines:
        """Each engine replica's pods of its current generation, by (replica, node) (`pool.current_engines`)."""
        return pool.current_engines(self.obs, self.ledger)
