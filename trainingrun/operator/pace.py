"""`status.progress` of a TrainingRun, from the trainers' progress record (`trainingrun.contract.progress`). Pure.

  percentage                 rollouts done in percent of rollout.numRollouts (100 once the run succeeded)
  rolloutsDone, rolloutsTotal  `contract.progress.rollouts_done` of the record's rollout, and numRollouts
  updatedAt                  when the trainers wrote the record
  estimatedRemainingSeconds  (rolloutsTotal - rolloutsDone) at the pace since `paceFrom`; unset until the pace is
                             known (two records of one attempt with rollouts between them); 0 once succeeded
  paceFrom                   the first record of the current attempt the operator saw ({attempt, rolloutsDone,
                             time}): a new attempt (a restart, a resume) or a record going back (re-trained steps
                             after a restart from a checkpoint) starts the pace again, so the estimate never counts
                             the time the run was down or suspended

The anchor lives in the status itself, so an operator restart keeps measuring from the same point.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from trainingrun.contract.progress import ProgressRecord, rollouts_done


def _rfc3339(unix: float) -> str:
    return dt.datetime.fromtimestamp(unix, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _unix(s: str) -> float:
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def progress_status(previous: Mapping[str, Any] | None, record: ProgressRecord | None, total: int, *,
                    succeeded: bool = False) -> dict[str, Any] | None:
    """The next status.progress from the previous one and the newest record (None: none written yet)."""
    if record is None and previous is None and not succeeded:
        return None
    out: dict[str, Any] = {"rolloutsTotal": int(total)}
    prev = dict(previous or {})
    if record is None:
        done = int(prev.get("rolloutsDone", 0))
        for key in ("updatedAt", "paceFrom", "estimatedRemainingSeconds"):
            if key in prev:
                out[key] = prev[key]
    else:
        done = rollouts_done(record.rollout, total)
        out["updatedAt"] = _rfc3339(record.time)
        anchor = prev.get("paceFrom")
        attempt = record.attempt or 0
        if anchor is None or int(anchor.get("attempt", 0)) != attempt or done < int(anchor.get("rolloutsDone", 0)):
            anchor = {"attempt": attempt, "rolloutsDone": done, "time": out["updatedAt"]}
        out["paceFrom"] = dict(anchor)
        gained, seconds = done - int(anchor["rolloutsDone"]), record.time - _unix(anchor["time"])
        if gained > 0 and seconds > 0:
            out["estimatedRemainingSeconds"] = int(round(max(total - done, 0) * seconds / gained))
    if succeeded:
        done = int(total)
        out["estimatedRemainingSeconds"] = 0
    out["rolloutsDone"] = done
    out["percentage"] = 100 if total <= 0 else min(100, int(100 * done // total))
    return out
