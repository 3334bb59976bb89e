"""Roles restarted alone (failurePolicy RestartRole): the ledger `status.roleRestarts` and the rules of a replacement.
Pure; `status.decide` keeps the ledger in the status it writes, so it survives operator restarts and never lives in a
child (deleting a pod never resets a budget), and applies the rules:

  restart_alone      record that the failed role (the rollout, or one engine replica) restarts alone, as a pod of its
                     next generation; the message saying so (which restart of which budget, or why it is not counted)
  superseded         live pods of an older generation of such a role: deleted without ending their group
  replacement_hold   what keeps the replacement from being created yet: the role's backoff, or its predecessor still
                     running or terminating (for up to terminatingTimeoutSeconds from its deletion)
  rollout_not_running  a running run is not whole while its rollout, restarted alone, is not running yet

The ledger holds one entry per (role, replica) that ever restarted alone — the rollout (replica 0) and each engine
replica.

An entry: {"role", "replica", "restarts" (counted against failurePolicy.roles.<role>), "uncounted" (disruptions,
Ignore rules, an engine replaced with a group restart), "lastFailure", "lastRestartTime", "backoffSeconds",
"replacing" (the replacement pod of the current generation was not seen yet), "down" (an engine replica that
left the pool: it failed with the engine role's budget spent while other replicas served; never replaced again)}. A replica's *generation* is
restarts + uncounted: its current pod carries it (name suffix -r<g>, label trainingrun.dev/role-attempt), so pods of
an older generation are told apart (kept when finished, for their logs; deleted when still live).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from trainingrun import failure_policy as policy
from trainingrun.api.constants import ROLE_ENGINE, ROLE_ROLLOUT
from trainingrun.api.models import MESSAGE_MAX_LENGTH
from trainingrun.operator.observe import PodObs, parse_time
from trainingrun.operator.vocabulary import Names


class RoleLedger:
    """`status.roleRestarts` (the list, edited in place) with the questions `status.decide` asks of it."""

    def __init__(self, entries: list[dict[str, Any]]):
        self.entries = entries

    def entry(self, role: str, replica: int = 0) -> dict[str, Any] | None:
        return next((e for e in self.entries if e.get("role") == role and int(e.get("replica", 0)) == replica), None)

    def _entry_or_new(self, role: str, replica: int) -> dict[str, Any]:
        e = self.entry(role, replica)
        if e is None:
            e = {"role": role, "replica": replica, "restarts": 0, "uncounted": 0}
            self.entries.append(e)
            self.entries.sort(key=lambda x: (x["role"], int(x.get("replica", 0))))
        return e

    def generation(self, role: str, replica: int = 0) -> int:
        """The replica's current generation: 0 until it restarts alone, one more per restart."""
        e = self.entry(role, replica)
        return 0 if e is None else int(e.get("restarts", 0)) + int(e.get("uncounted", 0))

    def replacing(self, role: str, replica: int = 0) -> bool:
        e = self.entry(role, replica)
        return bool(e and e.get("replacing"))

    def counts(self, group_restarts: int) -> policy.Counts:
        """The budgets used so far, for `failure_policy.Policy.decide`."""
        used: dict[str, int] = {}
        for e in self.entries:
            used[e["role"]] = used.get(e["role"], 0) + int(e.get("restarts", 0))
        return policy.Counts(restarts=group_restarts, role_restarts=used)

    def restart(self, role: str, replica: int, *, counted: bool, failure: str, now: str, backoff: float) -> int:
        """Record a restart of `replica` alone (decided at `now`, RFC 3339, waiting `backoff` seconds); the new
        generation."""
        e = self._entry_or_new(role, replica)
        e["restarts" if counted else "uncounted"] = int(e.get("restarts" if counted else "uncounted", 0)) + 1
        e.update(lastFailure=failure[:MESSAGE_MAX_LENGTH], lastRestartTime=now,
                 backoffSeconds=int(math.ceil(max(backoff, 0.0))), replacing=True)
        return self.generation(role, replica)

    def down(self, role: str, replica: int = 0) -> bool:
        """The replica left the pool (an engine that failed with its role's budget spent)."""
        e = self.entry(role, replica)
        return bool(e and e.get("down"))

    def leave_pool(self, role: str, replica: int, *, failure: str, now: str) -> None:
        """Record that `replica` left the pool for good (not replaced again)."""
        e = self._entry_or_new(role, replica)
        e.update(lastFailure=failure[:MESSAGE_MAX_LENGTH], lastRestartTime=now, replacing=False, down=True)

    def seen(self, role: str, replica: int = 0) -> None:
        """The replacement pod of the current generation exists."""
        e = self.entry(role, replica)
        if e is not None and e.get("replacing"):
            e["replacing"] = False

    def restart_due(self, role: str, replica: int, parse_time) -> float | None:
        """Unix time the replacement may be created (the last restart plus its backoff); None: no restart pending."""
        e = self.entry(role, replica)
        if e is None or not e.get("replacing"):
            return None
        since = parse_time(e.get("lastRestartTime"))
        return None if since is None else since.timestamp() + float(e.get("backoffSeconds", 0))

    def total(self, role: str) -> Mapping[str, int]:
        """All replicas of `role` together: {"restarts": counted, "uncounted": ...}."""
        out = {"restarts": 0, "uncounted": 0}
        for e in self.entries:
            if e["role"] == role:
                out["restarts"] += int(e.get("restarts", 0))
                out["uncounted"] += int(e.get("uncounted", 0))
        return out


# ------------------------------------------------------------------------------------------------------ the rules
def restart_alone(ledger: RoleLedger, cause: policy.Failure, verdict: policy.Verdict, rules: policy.Policy, *,
                  group_restarts: int, now: str) -> str:
    """Record that `cause`'s role (the rollout, or one engine replica) restarts alone as a pod of its next generation,
    decided at `now` (RFC 3339) by `verdict`; the message that says so."""
    role, replica = cause.role, cause.rank or 0
    assert role is not None
    generation = ledger.restart(role, replica, counted=verdict.counted, failure=cause.description, now=now,
                                backoff=verdict.backoff)
    what = (f"{role} replica {replica}" if role == ROLE_ENGINE else role)
    if verdict.counted:
        budget = rules.roles[role].max_restarts
        used = ledger.counts(group_restarts).role_restarts.get(role, 0)
        how = f"restart {used} of failurePolicy.roles.{role}.maxRestarts={budget}"
    else:
        how = verdict.why
    return (f"{cause.description}; restarting the {what} alone as generation {generation} ({how}) in "
            f"{verdict.backoff:g}s; the other pods keep running")


def superseded(live: Iterable[PodObs], ledger: RoleLedger, attempt: int) -> list[str]:
    """The live pods of an older generation of a role restarted alone: a rollout of attempt `attempt`, an engine
    replica (of any attempt: engines outlive attempts)."""
    return [p.name for p in live if
            (p.role == ROLE_ROLLOUT and p.attempt == attempt and p.generation != ledger.generation(ROLE_ROLLOUT)) or
            (p.role == ROLE_ENGINE and p.generation != ledger.generation(ROLE_ENGINE, p.rank or 0))]


@dataclass(frozen=True)
class Hold:
    """Why a replacement is not created yet: `wait` seconds until the next look; `message` names the predecessor
    that still runs or terminates (None: the role's backoff has not passed)."""

    wait: float
    message: str | None = None


def replacement_hold(ledger: RoleLedger, pods: Iterable[PodObs], role: str, replica: int, name: str, *, attempt: int,
                     timeout: float, now: float) -> Hold | None:
    """What keeps pod `name`, the replacement of `role` replica `replica`, from being created at `now` (unix time):
    the role's backoff after the last restart, or a pod of an older generation of the same role replica that still
    runs or terminates — two rollout writers at once; under Kueue a pod group with one pod too many, whose newest pod
    Kueue would delete as excess — for up to `timeout` (terminatingTimeoutSeconds) from its deletion. None: create
    it."""
    due = ledger.restart_due(role, replica, parse_time)
    if due is not None and due > now:
        return Hold(wait=due - now)
    for p in pods:
        if p.role != role or p.phase in ("Succeeded", "Failed") or p.name == name:
            continue
        if (role == ROLE_ROLLOUT and p.attempt != attempt) or (role == ROLE_ENGINE and (p.rank or 0) != replica):
            continue
        if role == ROLE_ENGINE and p.generation == ledger.generation(role, replica):
            continue  # a pod of the replacement itself (another node of a multi-node replica)
        left = policy.seconds_left(p.deleted_at, timeout, now)
        if left is not None and left <= 0:
            continue  # on a lost node: fenced by its older generation (the store's writer claim)
        return Hold(wait=1.0 if left is None else min(left, 1.0), message=(
            f"waiting for pod {p.name} to terminate before its replacement {name} starts (it stops blocking "
            f"terminatingTimeoutSeconds={timeout}s after its deletion)"))
    return None


def rollout_not_running(rollout: PodObs | None, ledger: RoleLedger, *, names: Names, attempt: int) -> str | None:
    """Why a running run is not whole for its rollout: it restarts alone and the pod of its current generation is not
    running yet (None: it runs, or it is not restarting alone and was never seen)."""
    if rollout is None or rollout.phase not in ("Running", "Succeeded") or rollout.deleting:
        if ledger.replacing(ROLE_ROLLOUT) or rollout is not None:
            name = names.pod(ROLE_ROLLOUT, None, attempt, ledger.generation(ROLE_ROLLOUT))
            return f"the rollout restarts alone: pod {name} is not running yet"
    return None
