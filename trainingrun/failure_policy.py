"""The failure policy of a TrainingRun, written once and used by the operator (`trainingrun.operator.status`), the
local launcher (`trainingrun.local`) and a trainer pod's worker supervisor (`trainingrun.trainer.workers`).

Pure: no I/O, no clock (callers pass `now`), no Kubernetes. Each caller turns what it observes (a pod's container
statuses, a child process's return code) into `Failure`s; this module says what they mean and what to do.

Exits (`classify`):
  0                               SUCCEEDED
  78 (`EXIT_CONFIG_ERROR`)        CONFIG_ERROR  a bad spec or unrecoverable input; no restart can fix it
  a disruption (the caller says:  DISRUPTION    an evicted/preempted pod or a lost node; not the run's fault
   evicted, preempted, node lost)
  anything else                   FAILURE       an application failure

Which failure to report when several processes of the group died in one observation (`root_cause`): a
configuration error first (it decides that the run fails); then the one that finished first, when finish times are
known; then a disruption (peers of an evicted process die because their collectives break); then a process killed
by a signal (exit code < 0 locally, > 128 in a container: the OOM killer, a SIGKILL) before one that exited with an
error (its peers' broken collectives); then trainers before the rollout, lower rank first.

Rules (`Policy`, from `spec.failurePolicy`): what to do about one failure is the action of the first rule that
matches it — the user's `failurePolicy.rules` in order, then `DEFAULT_RULES`. A rule matches on the failing role
(`rollout`, `trainer`, `engine`), the exit code and the reasons the failure carries (all given conditions must hold;
a condition left out matches anything):

  RestartGroup  the rollout and every trainer restart together as the next attempt (the trainers resume from their
                checkpoint, the rollout from its state in the store); counted against failurePolicy.maxRestarts
  RestartRole   only the failed role restarts: the rollout process/pod alone (it resumes from the store; the trainers
                keep waiting for its next rollout), or the one engine replica that failed (the rollout waits for it
                and loads its weight version again); counted against the role's own budget
                (failurePolicy.roles.<role>.maxRestarts). The trainers are one torch.distributed group fenced by the
                attempt number, so they never restart alone: the API refuses RestartRole for the trainer role.
  FailRun       the run fails at once
  Ignore        the failure uses no budget: the failed part restarts the way its role does by default (trainers:
                with the group; rollout and engine: alone), counted nowhere but status.disruptions (group) or the
                role's `uncounted` (role)

The default rules keep the behaviour of the operator before rules existed for trainers and restart the rollout and
an engine alone:

  1. a disruption (reason Disrupted: evicted, preempted, lost node)  → Ignore (a restart that uses no budget)
  2. exit code 78 (a configuration error, any role)                  → FailRun (reason ConfigError)
  3. role rollout or engine                                          → RestartRole
  4. anything else (trainers, the progress deadline)                 → RestartGroup

Reasons a failure carries (`Failure.reasons`), matched by `reasons:` of a rule: the container's termination reason
(`OOMKilled`, `Error`, `ContainerCannotRun`, ...), the pod's status reason (`Evicted`, `DeadlineExceeded`,
`Preempting`, `NodeLost`, `Shutdown`, ...), a disruption condition's type and reason (`DisruptionTarget`,
`EvictionByEvictionAPI`, `PreemptionByScheduler`, `DeletionByTaintManager`, `TerminationTarget`, `StoppedByKueue`,
...), and the policy's own: `Disrupted` (any disruption), `Deleted` (a pod deleted while the run ran),
`ProgressDeadlineExceeded` (no new step for progressDeadlineSeconds), `Signal` (a local process killed by a signal).
Exit codes are matched as a container reports them: a local process killed by signal N matches 128 + N (SIGKILL:
137), as it would in a pod.

Budget (`Policy.decide`): a counted RestartGroup while `restarts < maxRestarts`, a counted RestartRole while the
role's counted restarts (all its replicas together) are below its `maxRestarts`; when the budget is spent the run
fails (BackoffLimitExceeded, naming the budget). The counters live with the caller's durable record of the run — the
TrainingRun's status in a cluster (never in a child object: deleting a child never resets a budget), the launcher's
run locally.

Backoff (`backoff_seconds`): a restart waits `backoffSeconds` (the group's, or the role's) after an uncounted
restart; after the n-th counted restart `backoffSeconds × 2^(n-1)`, capped at `max(backoffSeconds,
MAX_BACKOFF_SECONDS)` (360 s, as Kubernetes Jobs), so a crash-looping run does not hammer the scheduler while a single
failure restarts quickly.

Deadlines: `seconds_left(since, limit, now)` for `activeDeadlineSeconds` (from the start of the run),
`progressDeadlineSeconds` (from the last progress) and `terminatingTimeoutSeconds` (from a pod's deletion).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainingrun.api.constants import ROLE_ENGINE, ROLE_ROLLOUT, ROLE_TRAINER

# The exit code of a configuration or unrecoverable data error (EX_CONFIG): the run fails at once, not restarted.
from trainingrun.contract.errors import EXIT_CONFIG_ERROR

MAX_BACKOFF_SECONDS = 360.0

ROLES = (ROLE_ROLLOUT, ROLE_TRAINER, ROLE_ENGINE)  # the roles a rule can name
ALONE_ROLES = (ROLE_ROLLOUT, ROLE_ENGINE)  # the roles that can restart alone (RestartRole), each with its own budget

# The policy's own reasons (besides the Kubernetes reasons a pod reports)
DISRUPTED = "Disrupted"
DELETED = "Deleted"
PROGRESS_DEADLINE = "ProgressDeadlineExceeded"
SIGNAL = "Signal"


class ExitKind(enum.Enum):
    SUCCEEDED = "Succeeded"
    CONFIG_ERROR = "ConfigError"
    DISRUPTION = "Disruption"
    FAILURE = "Failure"


class Action(str, enum.Enum):
    """What a rule does about a failure (the values are the API's `failurePolicy.rules[].action`)."""

    RESTART_GROUP = "RestartGroup"
    RESTART_ROLE = "RestartRole"
    FAIL_RUN = "FailRun"
    IGNORE = "Ignore"


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
    """One process (pod) that did not succeed."""

    name: str  # pod or process name
    kind: ExitKind
    description: str  # e.g. "pod r-trainer-1-a0 container trainer exited with code 3 (reason Error)"
    role: str | None = ROLE_TRAINER  # rollout, trainer, engine; None: not one process (the progress deadline)
    rank: int | None = None  # a trainer's rank, an engine's replica index
    code: int | None = None
    finished_at: float | None = None  # unix time (pods: the container's finishedAt), when known
    reasons: frozenset[str] = frozenset()  # Kubernetes reasons and the policy's own (module docstring)

    @property
    def exit_code(self) -> int | None:
        """The code as a container reports it: a process killed by signal N (return code -N) is 128 + N."""
        if self.code is None:
            return None
        return 128 - self.code if self.code < 0 else self.code

    @property
    def all_reasons(self) -> frozenset[str]:
        """`reasons`, with Disrupted for a disruption and Signal for a process killed by a signal."""
        extra = {DISRUPTED} if self.kind is ExitKind.DISRUPTION else set()
        if self.code is not None and self.code < 0:
            extra.add(SIGNAL)
        return self.reasons | extra


_KIND_ORDER = {ExitKind.CONFIG_ERROR: 0, ExitKind.DISRUPTION: 1, ExitKind.FAILURE: 2, ExitKind.SUCCEEDED: 3}


def _rank_key(f: Failure) -> tuple:
    return (
        f.kind is not ExitKind.CONFIG_ERROR,
        f.finished_at if f.finished_at is not None else math.inf,
        _KIND_ORDER[f.kind],
        not killed_by_signal(f.code),
        f.role != ROLE_TRAINER,
        f.rank if f.rank is not None else -1,
        f.name,
    )


def root_cause(failures: Iterable[Failure]) -> Failure | None:
    """The failure to report (and to act on) among several seen at once; None when there is none."""
    candidates = [f for f in failures if f.kind is not ExitKind.SUCCEEDED]
    return min(candidates, key=_rank_key) if candidates else None


# ------------------------------------------------------------------------------------------------------ rules
@dataclass(frozen=True)
class Rule:
    """One rule: `action` for a failure of one of `roles` with one of `exit_codes` and one of `reasons` (an empty
    set matches anything). `name` is how messages cite it."""

    action: Action
    roles: frozenset[str] = frozenset()
    exit_codes: frozenset[int] = frozenset()
    reasons: frozenset[str] = frozenset()
    name: str = ""

    def matches(self, failure: Failure) -> bool:
        if self.roles and failure.role not in self.roles:
            return False
        if self.exit_codes and failure.exit_code not in self.exit_codes:
            return False
        return not self.reasons or bool(self.reasons & failure.all_reasons)


DEFAULT_RULES: tuple[Rule, ...] = (
    Rule(Action.IGNORE, reasons=frozenset({DISRUPTED}), name="default rule 1 (a disruption uses no restart)"),
    Rule(Action.FAIL_RUN, exit_codes=frozenset({EXIT_CONFIG_ERROR}),
         name=f"default rule 2 (exit code {EXIT_CONFIG_ERROR} is a configuration error)"),
    Rule(Action.RESTART_ROLE, roles=frozenset(ALONE_ROLES), name="default rule 3 (the rollout or an engine restarts "
         "alone)"),
    Rule(Action.RESTART_GROUP, name="default rule 4 (the group restarts)"),
)


@dataclass(frozen=True)
class Budget:
    """Restarts allowed (counted ones) and the backoff base, in seconds."""

    max_restarts: int
    backoff_seconds: float


@dataclass(frozen=True)
class Counts:
    """The restarts used so far, from the run's durable record: counted group restarts (status.restarts) and
    counted restarts of each role alone, all its replicas together (status.roleRestarts)."""

    restarts: int = 0
    role_restarts: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    """What to do about one failure (`Policy.decide`)."""

    action: Action  # RESTART_GROUP, RESTART_ROLE or FAIL_RUN (an Ignore rule gives an uncounted restart)
    reason: str  # condition/event reason: ConfigError, FailurePolicyRule, BackoffLimitExceeded, PodFailed,
    #              Disrupted, FailureIgnored
    why: str  # the policy's half of the message, e.g. "restart 2 of failurePolicy.roles.rollout.maxRestarts=3"
    rule: str  # the rule that decided, e.g. "failurePolicy.rules[0] (oom)"
    counted: bool = False  # the restart uses one of its budget's restarts
    backoff: float = 0.0  # seconds to wait before the restart (counted from the decision)
    role: str | None = None  # the failed role (the one RestartRole restarts)
    rank: int | None = None  # its replica (an engine) or rank (a trainer)

    @property
    def restart(self) -> bool:
        return self.action is not Action.FAIL_RUN

    @property
    def alone(self) -> bool:
        """Only the failed role restarts (the rollout, or one engine replica)."""
        return self.action is Action.RESTART_ROLE


@dataclass(frozen=True)
class Policy:
    """A run's failure policy: the user's rules (DEFAULT_RULES follow them), the group's budget and each role's."""

    group: Budget
    roles: Mapping[str, Budget]  # ALONE_ROLES -> budget of restarting that role alone
    rules: tuple[Rule, ...] = ()

    @classmethod
    def from_spec(cls, fp: Any) -> Policy:
        """The policy of `spec.failurePolicy` (`trainingrun.api.spec.cluster.FailurePolicy`): a role's budget defaults to
        the group's maxRestarts and backoffSeconds."""
        group = Budget(fp.max_restarts, float(fp.backoff_seconds))
        roles = {}
        for role in ALONE_ROLES:
            own = getattr(fp.roles, role)
            roles[role] = Budget(group.max_restarts if own.max_restarts is None else own.max_restarts,
                                 group.backoff_seconds if own.backoff_seconds is None else float(own.backoff_seconds))
        rules = tuple(
            Rule(Action(r.action), roles=frozenset(r.roles), exit_codes=frozenset(r.exit_codes),
                 reasons=frozenset(r.reasons), name=f"failurePolicy.rules[{i}]" + (f" ({r.name})" if r.name else ""))
            for i, r in enumerate(fp.rules))
        return cls(group=group, roles=roles, rules=rules)

    def rule_for(self, failure: Failure) -> Rule:
        """The first rule that matches (DEFAULT_RULES end with one that matches everything)."""
        return next(r for r in (*self.rules, *DEFAULT_RULES) if r.matches(failure))

    def decide(self, failure: Failure, counts: Counts = Counts()) -> Verdict:
        """What to do about `failure`, given the restarts used so far (see the module docstring)."""
        rule = self.rule_for(failure)
        role, rank = failure.role, failure.rank
        action = rule.action
        counted = True
        if action is Action.IGNORE:
            action = Action.RESTART_ROLE if role in ALONE_ROLES else Action.RESTART_GROUP
            counted = False
        if action is Action.RESTART_ROLE and role not in ALONE_ROLES:
            action = Action.RESTART_GROUP  # a trainer (or no role) never restarts alone (the API refuses the rule)
        if action is Action.FAIL_RUN:
            if rule in DEFAULT_RULES:
                return Verdict(action, "ConfigError", f"exit code {EXIT_CONFIG_ERROR} is a configuration error; "
                               "not restarting (fix the spec and create a new run)", rule.name, role=role, rank=rank)
            return Verdict(action, "FailurePolicyRule", f"{rule.name} says FailRun", rule.name, role=role, rank=rank)
        if action is Action.RESTART_ROLE:
            assert role is not None
            budget, used, field_name = self.roles[role], counts.role_restarts.get(role, 0), \
                f"failurePolicy.roles.{role}.maxRestarts"
        else:
            budget, used, field_name = self.group, counts.restarts, "failurePolicy.maxRestarts"
        if not counted:
            why = ("a disruption, not the run's fault" if DISRUPTED in failure.all_reasons
                   else f"{rule.name} says Ignore") + f": not counted against {field_name}"
            reason = "Disrupted" if DISRUPTED in failure.all_reasons else "FailureIgnored"
            return Verdict(action, reason, why, rule.name, backoff=backoff_seconds(budget.backoff_seconds, used,
                           counted=False), role=role, rank=rank)
        if used >= budget.max_restarts:
            return Verdict(Action.FAIL_RUN, "BackoffLimitExceeded", f"all {budget.max_restarts} restart(s) of "
                           f"{field_name} used", rule.name, role=role, rank=rank)
        return Verdict(action, "PodFailed", f"restart {used + 1} of {field_name}={budget.max_restarts}", rule.name,
                       counted=True, backoff=backoff_seconds(budget.backoff_seconds, used + 1), role=role, rank=rank)


def backoff_seconds(base: float, restarts: int, *, counted: bool = True) -> float:
    """Seconds to wait before a restart: `base` after an uncounted one (a disruption) or before the first restart;
    `base × 2^(restarts-1)` after the `restarts`-th counted restart, at most max(base, MAX_BACKOFF_SECONDS)."""
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
