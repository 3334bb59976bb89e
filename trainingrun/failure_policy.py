"""The failure policy of a TrainingRun, written once and used by the operator (`trainingrun.operator.status`), the
local launcher (`trainingrun.local`) and a trainer pod's worker supervisor (`trainingrun.trainer.workers`).

Pure: no I/O, no clock (callers pass `now`), no Kubernetes. Each caller turns what it observes (a pod's container
statuses, a child process's return code) into `Failure`s; this module says what they mean and what to do.

Exits (`classify`):
  0                               SUCCEEDED
  78 (`EXIT_CONFIG_ERROR`)        CONFIG_ERROR  a bad spec or unrecoverable input; no restart can fix it: the run
                                                fails at once
  a disruption (the caller says:  DISRUPTION    an evicted/preempted pod or a lost node; not the run's fault
   evicted, preempted, node lost)
  anything else                   FAILURE       an application failure: the whole group restarts while restarts
                                                are left

Which failure to report when several processes died in one observation (`root_cause`): a configuration error
first (it decides that the run fails); then the one that finished first, when finish times are known; then a
disruption (peers of an evicted process die because their collectives break); then a process killed by a signal
(exit code < 0 locally, > 128 in a container: the OOM killer, a SIGKILL) before one that exited with an error (its
peers' broken collectives); then trainers before the rollout, lower rank first.

Budget (`on_failure`): CONFIG_ERROR → fail (reason ConfigError); DISRUPTION → restart, never counted (the
operator counts it in status.disruptions); FAILURE → restart while `restarts < maxRestarts` (counted), else fail
(reason BackoffLimitExceeded).

Backoff (`backoff_seconds`): a restart waits `backoffSeconds` after a disruption; after the n-th counted restart
`backoffSeconds × 2^(n-1)`, capped at `max(backoffSeconds, MAX_BACKOFF_SECONDS)` (360 s, as Kubernetes Jobs), so a
crash-looping run does not hammer the scheduler while a single failure restarts quickly.

Deadlines: `seconds_left(since, limit, now)` for `activeDeadlineSeconds` (from the start of the run),
`progressDeadlineSeconds` (from the last progress) and `terminatingTimeoutSeconds` (from a pod's deletion).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

# The exit code of a configuration or unrecoverable data error (EX_CONFIG): the run fails at once, not restarted.
from trainingrun.contract.errors import EXIT_CONFIG_ERROR

MAX_BACKOFF_SECONDS = 360.0


class ExitKind(enum.Enum):
    SUCCEEDED = "Succeeded"
    CONFIG_ERROR = "ConfigError"
    DISRUPTION = "Disruption"
    FAILURE = "Failure"


def classify(code: int | None, *, disrupted: bool = False) -> ExitKind:
    """What an exit means. `code` None (no exit code known, e.g. a pod that failed before its container started)
    counts as a failure; `disrupted` (the platform ended the process) wins over any code."""
    if disrupted:
        return ExitKind.DISRUPTION
    if code == 0:
        return ExitKind.SUCCEEDED
    if code == EXIT_CONFIG_ERROR:
        return ExitKind.CONFIG_ERROR
    return ExitKind.FAILURE


def killed_by_signal(code: int | None) -> bool:
    """A process killed by a signal: a negative return code (subprocess) or 128 + N (a shell, a container)."""
    return code is not None and (code < 0 or code > 128)


@dataclass(frozen=True)
class Failure:
    """One process (pod) of the group that did not succeed."""

    name: str  # pod or process name
    kind: ExitKind
    description: str  # e.g. "pod r-trainer-1-a0 container trainer exited with code 3 (reason Error)"
    role: str = "trainer"
    rank: int | None = None
    code: int | None = None
    finished_at: float | None = None  # unix time (pods: the container's finishedAt), when known


_KIND_ORDER = {ExitKind.CONFIG_ERROR: 0, ExitKind.DISRUPTION: 1, ExitKind.FAILURE: 2, ExitKind.SUCCEEDED: 3}


def _rank_key(f: Failure) -> tuple:
    return (
        f.kind is not ExitKind.CONFIG_ERROR,
        f.finished_at if f.finished_at is not None else math.inf,
        _KIND_ORDER[f.kind],
        not killed_by_signal(f.code),
        f.role != "trainer",
        f.rank if f.rank is not None else -1,
        f.name,
    )


def root_cause(failures: Iterable[Failure]) -> Failure | None:
    """The failure to report (and to act on) among several seen at once; None when there is none."""
    candidates = [f for f in failures if f.kind is not ExitKind.SUCCEEDED]
    return min(candidates, key=_rank_key) if candidates else None


@dataclass(frozen=True)
class Verdict:
    """What to do about the group's failure."""

    restart: bool  # True: restart the whole group; False: the run fails
    reason: str  # condition/event reason: ConfigError, BackoffLimitExceeded, PodFailed, Disrupted
    why: str  # the policy's half of the message, e.g. "all 3 restart(s) of failurePolicy.maxRestarts used"
    counted: bool = False  # the restart uses one of maxRestarts


def on_failure(failure: Failure, *, restarts: int, max_restarts: int) -> Verdict:
    """Restart or fail, given the failure and the restarts used so far."""
    if failure.kind is ExitKind.CONFIG_ERROR:
        return Verdict(False, "ConfigError", f"exit code {EXIT_CONFIG_ERROR} is a configuration error; not restarting "
                       "(fix the spec and create a new run)")
    if failure.kind is ExitKind.DISRUPTION:
        return Verdict(True, "Disrupted", "a disruption, not the run's fault: not counted against "
                       "failurePolicy.maxRestarts")
    if restarts >= max_restarts:
        return Verdict(False, "BackoffLimitExceeded", f"all {max_restarts} restart(s) of failurePolicy.maxRestarts used")
    return Verdict(True, "PodFailed", f"restart {restarts + 1} of {max_restarts}", counted=True)


def backoff_seconds(base: float, restarts: int, *, counted: bool = True) -> float:
    """Seconds to wait before the group restarts: `base` after a disruption (`counted` False) or before the first
    restart; `base × 2^(restarts-1)` after the `restarts`-th counted restart, at most max(base, MAX_BACKOFF_SECONDS)."""
    if not counted or restarts <= 1 or base <= 0:
        return float(base)
    cap = max(float(base), MAX_BACKOFF_SECONDS)
    return min(float(base) * 2.0 ** min(restarts - 1, 32), cap)


def seconds_left(since: float | None, limit: float | None, now: float) -> float | None:
    """Seconds until a deadline of `limit` seconds counted from `since` (negative: passed); None when either is
    unset."""
    if since is None or limit is None:
        return None
    return since + limit - now
