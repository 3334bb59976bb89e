"""The rules of a role restarted alone (`trainingrun.operator.roles`), on their own: the ledger, the restart and its
message, the pods a new generation supersedes, what holds a replacement back, and a rollout that is not running yet.
(How `status.decide` applies them: tests/unit/test_operator_status.py; against the emulator:
tests/integration/test_operator_roles.py.)"""

from __future__ import annotations

import datetime as dt

from trainingrun import failure_policy as policy
from trainingrun.api.models import MESSAGE_MAX_LENGTH
from trainingrun.operator.observe import PodObs, parse_time
from trainingrun.operator.roles import (
    Hold, RoleLedger, replacement_hold, restart_alone, rollout_not_running, superseded,
)
from trainingrun.operator.vocabulary import Names

NOW = "2025-01-01T00:00:00Z"
T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc).timestamp()
RULES = policy.Policy(group=policy.Budget(5, 10.0), roles={"rollout": policy.Budget(2, 4.0),
                                                            "engine": policy.Budget(3, 8.0)})


def _failure(role: str, rank: int | None = None, name: str = "p") -> policy.Failure:
    return policy.Failure(name=name, kind=policy.ExitKind.FAILURE, description=f"pod {name} exited with code 1",
                          role=role, rank=rank)


def _verdict(counted: bool, backoff: float = 4.0, why: str = "restart 1 of ...") -> policy.Verdict:
    return policy.Verdict(policy.Action.RESTART_ROLE, "PodFailed" if counted else "Disrupted", why, "rule",
                          counted=counted, backoff=backoff)


def _pod(name: str, role: str, *, rank: int | None = None, attempt: int = 0, generation: int = 0,
         phase: str = "Running", deleted_at: float | None = None) -> PodObs:
    return PodObs(name=name, role=role, rank=rank, attempt=attempt, phase=phase, generation=generation,
                  deleting=deleted_at is not None, deleted_at=deleted_at)


def test_the_ledger_counts_generations_and_budgets_per_role_and_replica():
    entries: list = []
    ledger = RoleLedger(entries)
    assert ledger.generation("rollout") == 0 and ledger.counts(3) == policy.Counts(restarts=3, role_restarts={})
    assert ledger.restart("engine", 1, counted=True, failure="x" * 5000, now=NOW, backoff=2.2) == 1
    assert len(ledger.entry("engine", 1)["lastFailure"]) == MESSAGE_MAX_LENGTH  # cut to fit the CRD
    assert ledger.entry("engine", 1)["backoffSeconds"] == 3  # whole seconds, rounded up
    assert ledger.restart("engine", 1, counted=False, failure="evicted", now=NOW, backoff=0.0) == 2
    assert ledger.restart("rollout", 0, counted=True, failure="oom", now=NOW, backoff=1.0) == 1
    assert [(e["role"], e["replica"]) for e in entries] == [("engine", 1), ("rollout", 0)]  # kept sorted
    assert ledger.generation("engine", 1) == 2 and ledger.generation("engine", 0) == 0
    assert ledger.counts(0).role_restarts == {"engine": 1, "rollout": 1}  # uncounted restarts use no budget
    assert dict(ledger.total("engine")) == {"restarts": 1, "uncounted": 1}
    assert ledger.replacing("engine", 1)
    ledger.seen("engine", 1)
    assert not ledger.replacing("engine", 1) and ledger.restart_due("engine", 1, parse_time) is None


def test_restart_alone_records_the_next_generation_and_says_which_budget_it_uses():
    ledger = RoleLedger([])
    message = restart_alone(ledger, _failure("rollout", name="r-rollout-a0"), _verdict(True, 4.0), RULES,
                            group_restarts=0, now=NOW)
    assert ledger.generation("rollout") == 1 and ledger.replacing("rollout")
    assert ledger.entry("rollout")["backoffSeconds"] == 4 and ledger.entry("rollout")["lastRestartTime"] == NOW
    assert message == ("pod r-rollout-a0 exited with code 1; restarting the rollout alone as generation 1 (restart 1 "
                       "of failurePolicy.roles.rollout.maxRestarts=2) in 4s; the other pods keep running")
    message = restart_alone(ledger, _failure("engine", 2, "r-engine-2"), _verdict(False, 0.5, why="a disruption"),
                            RULES, group_restarts=0, now=NOW)
    assert ledger.generation("engine", 2) == 1 and ledger.counts(0).role_restarts == {"engine": 0, "rollout": 1}
    assert "the engine replica 2 alone as generation 1 (a disruption) in 0.5s" in message


def test_superseded_pods_are_live_pods_of_an_older_generation():
    ledger = RoleLedger([])
    ledger.restart("rollout", 0, counted=True, failure="f", now=NOW, backoff=0)
    ledger.restart("engine", 1, counted=True, failure="f", now=NOW, backoff=0)
    live = [_pod("rollout-a1", "rollout", attempt=1), _pod("rollout-a1-r1", "rollout", attempt=1, generation=1),
            _pod("rollout-a0", "rollout", attempt=0),  # another attempt's: the group's business, not this rule's
            _pod("engine-0", "engine", rank=0), _pod("engine-1", "engine", rank=1),
            _pod("engine-1-r1", "engine", rank=1, generation=1), _pod("trainer-0-a1", "trainer", rank=0, attempt=1)]
    assert superseded(live, ledger, attempt=1) == ["rollout-a1", "engine-1"]


def test_a_replacement_waits_for_its_backoff_then_for_its_predecessor_up_to_the_timeout():
    ledger = RoleLedger([])
    ledger.restart("rollout", 0, counted=True, failure="f", now=NOW, backoff=6.0)
    new = "r-rollout-a0-r1"
    assert replacement_hold(ledger, [], "rollout", 0, new, attempt=0, timeout=30, now=T0 + 2) == Hold(wait=4.0)
    old = _pod("r-rollout-a0", "rollout", attempt=0, deleted_at=T0 + 5)
    hold = replacement_hold(ledger, [old], "rollout", 0, new, attempt=0, timeout=30, now=T0 + 10)
    assert hold.wait == 1.0
    assert f"waiting for pod r-rollout-a0 to terminate before its replacement {new}" in hold.message
    assert replacement_hold(ledger, [old], "rollout", 0, new, attempt=0, timeout=30, now=T0 + 34.5).wait == 0.5
    assert replacement_hold(ledger, [old], "rollout", 0, new, attempt=0, timeout=30, now=T0 + 36) is None  # fenced
    gone = [_pod("r-rollout-a0", "rollout", attempt=0, phase="Failed"),  # finished: no second writer
            _pod("r-rollout-a1", "rollout", attempt=1),  # another attempt's rollout
            _pod(new, "rollout", attempt=0, generation=1)]  # the replacement itself
    assert replacement_hold(ledger, gone, "rollout", 0, new, attempt=0, timeout=30, now=T0 + 7) is None


def test_an_engine_replacement_waits_only_for_its_own_replicas_predecessor():
    ledger = RoleLedger([])
    ledger.restart("engine", 1, counted=True, failure="f", now=NOW, backoff=0.0)
    others = [_pod("r-engine-0", "engine", rank=0), _pod("r-engine-2", "engine", rank=2)]
    assert replacement_hold(ledger, others, "engine", 1, "r-engine-1-r1", attempt=3, timeout=30, now=T0) is None
    hold = replacement_hold(ledger, [*others, _pod("r-engine-1", "engine", rank=1)], "engine", 1, "r-engine-1-r1",
                            attempt=3, timeout=30, now=T0)
    assert hold is not None and "pod r-engine-1 to terminate" in hold.message  # a live one blocks (no deletion yet)


def test_a_rollout_restarting_alone_keeps_the_run_from_being_whole_until_it_runs():
    names, ledger = Names("r"), RoleLedger([])
    assert rollout_not_running(None, ledger, names=names, attempt=2) is None  # never restarted, never seen: not this
    assert rollout_not_running(_pod("r-rollout-a2", "rollout", attempt=2), ledger, names=names, attempt=2) is None
    ledger.restart("rollout", 0, counted=True, failure="f", now=NOW, backoff=0)
    assert rollout_not_running(None, ledger, names=names, attempt=2) == (
        f"the rollout restarts alone: pod {names.pod('rollout', None, 2, 1)} is not running yet")
    pending = _pod("r-rollout-a2-r1", "rollout", attempt=2, generation=1, phase="Pending")
    ledger.seen("rollout")
    assert "is not running yet" in rollout_not_running(pending, ledger, names=names, attempt=2)
