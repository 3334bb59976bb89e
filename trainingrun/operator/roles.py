"""The ledger of roles restarted alone (failurePolicy RestartRole): `status.roleRestarts` of a TrainingRun, one entry
per (role, replica) that ever restarted alone — the rollout (replica 0) and each engine replica. Pure; `status.decide`
keeps it in the status it writes, so it survives operator restarts and never lives in a child (deleting a pod never
resets a budget).

An entry: {"role", "replica", "restarts" (counted against failurePolicy.roles.<role>), "uncounted" (disruptions,
Ignore rules, an engine replaced with a group restart), "lastFailure", "lastRestartTime", "backoffSeconds",
"replacing" (the replacement pod of the current generation was not seen yet), "down" (an engine replica that
left the pool: it failed with the engine role's budget spent while other replicas served; never replaced again)}. A replica's *generation* is
restarts + uncounted: its current pod carries it (name suffix -r<g>, label trainingrun.dev/role-attempt), so pods of
an older generation are told apart (kept when finished, for their logs; deleted when still live).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from trainingrun import failure_policy as policy
from trainingrun.api.models import MESSAGE_MAX_LENGTH


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
