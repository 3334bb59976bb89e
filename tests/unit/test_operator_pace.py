"""status.progress from the trainers' progress records (`trainingrun.operator.pace`): the percentage, and an ETA
measured only within one attempt (time the run was down never counts)."""

from __future__ import annotations

from trainingrun.contract.progress import ProgressRecord
from trainingrun.operator.pace import progress_status

T0 = 1_800_000_000.0


def rec(rollout: int | None, seconds: float, attempt: int = 0) -> ProgressRecord:
    return ProgressRecord(step=10, time=T0 + seconds, rollout=rollout, attempt=attempt)


def test_percentage_and_eta_from_the_pace_of_the_current_attempt():
    assert progress_status(None, None, 10) is None  # nothing written yet: no status.progress
    p = progress_status(None, rec(1, 0), 10)
    assert (p["rolloutsDone"], p["rolloutsTotal"], p["percentage"]) == (2, 10, 20)
    assert "estimatedRemainingSeconds" not in p  # one record: no pace yet
    p = progress_status(p, rec(3, 60), 10)  # 2 rollouts in 60 s, 6 left
    assert p["percentage"] == 40 and p["estimatedRemainingSeconds"] == 180
    # a restart (attempt 1) an hour later: the pace starts again, the hour down does not count
    p = progress_status(p, rec(3, 3660, attempt=1), 10)
    assert p["paceFrom"]["attempt"] == 1 and "estimatedRemainingSeconds" not in p
    p = progress_status(p, rec(4, 3690, attempt=1), 10)  # 1 rollout in 30 s, 5 left
    assert p["estimatedRemainingSeconds"] == 150
    # a record going back (steps re-trained from a checkpoint) re-anchors too
    p = progress_status(p, rec(2, 3700, attempt=1), 10)
    assert p["rolloutsDone"] == 3 and p["paceFrom"]["rolloutsDone"] == 3 and "estimatedRemainingSeconds" not in p
    # no new record: the last values are kept; success: 100 %, nothing left
    assert progress_status(p, None, 10)["rolloutsDone"] == 3
    done = progress_status(p, None, 10, succeeded=True)
    assert (done["percentage"], done["rolloutsDone"], done["estimatedRemainingSeconds"]) == (100, 10, 0)
