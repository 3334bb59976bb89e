"""The pure failure policy shared by the operator, the local launcher and the trainer's worker supervisor."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from trainingrun import failure_policy as policy
from trainingrun.contract.errors import EXIT_CONFIG_ERROR
from trainingrun.failure_policy import ExitKind, Failure


def test_classify_exits():
    assert policy.classify(0) is ExitKind.SUCCEEDED
    assert policy.classify(EXIT_CONFIG_ERROR) is ExitKind.CONFIG_ERROR
    assert policy.classify(1) is ExitKind.FAILURE and policy.classify(137) is ExitKind.FAILURE
    assert policy.classify(-9) is ExitKind.FAILURE and policy.classify(None) is ExitKind.FAILURE
    # a disruption wins over whatever code the killed process left
    assert policy.classify(EXIT_CONFIG_ERROR, disrupted=True) is ExitKind.DISRUPTION
    assert policy.classify(0, disrupted=True) is ExitKind.DISRUPTION


def _f(name, code, *, role="trainer", rank=0, at=None, disrupted=False):
    return Failure(name=name, kind=policy.classify(code, disrupted=disrupted), description=name, role=role, rank=rank,
                   code=code, finished_at=at)


def test_root_cause_ranking():
    assert policy.root_cause([]) is None
    assert policy.root_cause([_f("ok", 0)]) is None
    # a config error wins over everything, even when it finished later
    assert policy.root_cause([_f("a", 1, at=1.0), _f("cfg", EXIT_CONFIG_ERROR, at=9.0)]).name == "cfg"
    # killed by a signal (local: negative; container: 128 + N) before an error exit of a peer in the same poll
    assert policy.root_cause([_f("err", 1, rank=0), _f("oom", 137, rank=1)]).name == "oom"
    assert policy.root_cause([_f("err", 1, rank=0), _f("sig", -9, rank=1)]).name == "sig"
    # trainers before the rollout, lower rank first
    assert policy.root_cause([_f("ro", 1, role="rollout", rank=None), _f("t1", 1, rank=1), _f("t0", 1, rank=0)]).name == "t0"
    # the first to finish is the cause when times are known
    assert policy.root_cause([_f("late", -9, rank=0, at=5.0), _f("early", 1, rank=1, at=2.0)]).name == "early"


@given(st.lists(st.tuples(st.sampled_from([1, 2, 3, 137, -9, -15, EXIT_CONFIG_ERROR]), st.integers(0, 7)),
                min_size=1, max_size=8))
def test_root_cause_is_deterministic_and_prefers_config_error(exits):
    failures = [_f(f"p{i}", code, rank=rank) for i, (code, rank) in enumerate(exits)]
    cause = policy.root_cause(failures)
    assert cause is not None and cause == policy.root_cause(list(reversed(failures)))
    if any(code == EXIT_CONFIG_ERROR for code, _ in exits):
        assert cause.kind is ExitKind.CONFIG_ERROR


def _policy(max_restarts=2, backoff=10.0, rules=(), **roles):
    return policy.Policy(group=policy.Budget(max_restarts, backoff),
                         roles={r: roles.get(r, policy.Budget(max_restarts, backoff)) for r in policy.ALONE_ROLES},
                         rules=tuple(rules))


def test_budget_verdicts():
    fail = _f("t", 3)
    v = _policy().decide(fail, policy.Counts(restarts=0))
    assert (v.restart, v.reason, v.counted, v.action) == (True, "PodFailed", True, policy.Action.RESTART_GROUP)
    assert v.why == "restart 1 of failurePolicy.maxRestarts=2"
    v = _policy().decide(fail, policy.Counts(restarts=2))
    assert not v.restart and v.reason == "BackoffLimitExceeded" and "all 2 restart(s)" in v.why
    v = _policy(max_restarts=5).decide(_f("c", EXIT_CONFIG_ERROR))
    assert not v.restart and v.reason == "ConfigError" and "78" in v.why


# The policy before rules existed, for a failure of the group (a trainer, or the rollout): kept as the reference the
# default rules must reproduce for trainers.
def _old_on_failure(f: Failure, restarts: int, max_restarts: int) -> tuple[bool, str, bool]:
    if f.kind is ExitKind.CONFIG_ERROR:
        return False, "ConfigError", False
    if f.kind is ExitKind.DISRUPTION:
        return True, "Disrupted", False
    if restarts >= max_restarts:
        return False, "BackoffLimitExceeded", False
    return True, "PodFailed", True


@given(st.sampled_from([1, 2, 3, 137, -9, -15, EXIT_CONFIG_ERROR, None]), st.booleans(), st.integers(0, 4),
       st.integers(0, 4), st.sampled_from(["trainer", None]))
def test_default_rules_keep_the_old_behaviour_for_trainers(code, disrupted, restarts, max_restarts, role):
    f = Failure(name="p", kind=policy.classify(code, disrupted=disrupted), description="", role=role, code=code)
    v = _policy(max_restarts=max_restarts).decide(f, policy.Counts(restarts=restarts, role_restarts={"rollout": 9}))
    assert (v.restart, v.reason, v.counted) == _old_on_failure(f, restarts, max_restarts)
    assert v.action in (policy.Action.RESTART_GROUP, policy.Action.FAIL_RUN) and not v.alone
    if v.restart:  # the backoff the operator and the launcher waited before rules existed
        assert v.backoff == (policy.backoff_seconds(10.0, restarts + 1) if v.counted else 10.0)


def test_default_rules_restart_the_rollout_and_an_engine_alone_on_their_own_budget():
    p = _policy(max_restarts=1, engine=policy.Budget(2, 4.0))
    rollout = _f("r", 1, role="rollout", rank=None)
    v = p.decide(rollout, policy.Counts(restarts=1, role_restarts={"engine": 2}))  # the group's budget is spent
    assert v.alone and v.counted and v.role == "rollout" and "failurePolicy.roles.rollout.maxRestarts=1" in v.why
    v = p.decide(rollout, policy.Counts(role_restarts={"rollout": 1}))
    assert not v.restart and v.reason == "BackoffLimitExceeded" and "failurePolicy.roles.rollout.maxRestarts" in v.why
    engine = _f("e", -9, role="engine", rank=3)
    v = p.decide(engine, policy.Counts(role_restarts={"engine": 1}))
    assert v.alone and v.rank == 3 and v.backoff == 8.0  # the engine's own base, doubled after its second restart
    # evicted: restarted alone, counted nowhere, the base backoff
    v = p.decide(_f("e", 137, role="engine", rank=0, disrupted=True), policy.Counts(role_restarts={"engine": 2}))
    assert v.alone and not v.counted and v.reason == "Disrupted" and v.backoff == 4.0
    # a configuration error fails the run whatever the role
    assert p.decide(_f("r", EXIT_CONFIG_ERROR, role="rollout", rank=None)).reason == "ConfigError"


def test_rules_match_role_exit_code_and_reason_and_the_first_match_wins():
    oom = policy.Rule(policy.Action.FAIL_RUN, roles=frozenset({"trainer"}), reasons=frozenset({"OOMKilled"}),
                      name="failurePolicy.rules[0] (oom)")
    sigkill = policy.Rule(policy.Action.IGNORE, exit_codes=frozenset({137}), name="failurePolicy.rules[1]")
    rollout_all = policy.Rule(policy.Action.RESTART_GROUP, roles=frozenset({"rollout"}), name="failurePolicy.rules[2]")
    p = _policy(rules=[oom, sigkill, rollout_all])
    t_oom = Failure(name="t", kind=ExitKind.FAILURE, description="", code=137, reasons=frozenset({"OOMKilled"}))
    assert p.rule_for(t_oom) is oom  # matches rule 1 too: the first wins
    v = p.decide(t_oom)
    assert not v.restart and v.reason == "FailurePolicyRule" and "rules[0] (oom)" in v.why
    # a local process killed by SIGKILL (-9) is exit code 137, as in a container; Ignore uses no budget
    v = p.decide(_f("t", -9), policy.Counts(restarts=2))
    assert p.rule_for(_f("t", -9)) is sigkill and v.restart and not v.counted and v.reason == "FailureIgnored"
    # the rollout with another code: rule 3 restarts the whole group (against maxRestarts)
    v = p.decide(_f("r", 1, role="rollout", rank=None))
    assert v.action is policy.Action.RESTART_GROUP and v.counted and v.rule == "failurePolicy.rules[2]"
    # nothing matches an engine's exit 2: the default rule restarts it alone
    assert p.decide(_f("e", 2, role="engine", rank=0)).alone
    # conditions given together must all hold
    both = policy.Rule(policy.Action.FAIL_RUN, roles=frozenset({"engine"}), exit_codes=frozenset({3}))
    assert both.matches(_f("e", 3, role="engine")) and not both.matches(_f("e", 4, role="engine"))
    assert not both.matches(_f("t", 3))
    # the policy's own reasons
    hang = Failure(name="progress deadline", kind=ExitKind.FAILURE, description="", role=None,
                   reasons=frozenset({policy.PROGRESS_DEADLINE}))
    fail_hangs = policy.Rule(policy.Action.FAIL_RUN, reasons=frozenset({policy.PROGRESS_DEADLINE}))
    assert _policy(rules=[fail_hangs]).decide(hang).action is policy.Action.FAIL_RUN
    assert _policy().decide(hang).action is policy.Action.RESTART_GROUP
    assert policy.DISRUPTED in _f("x", 1, disrupted=True).all_reasons and policy.SIGNAL in _f("x", -15).all_reasons


def test_a_trainer_never_restarts_alone():
    """RestartRole (refused by the API for trainers) and Ignore both restart the trainers with the group."""
    alone = policy.Rule(policy.Action.RESTART_ROLE)
    v = _policy(rules=[alone]).decide(_f("t", 1))
    assert v.action is policy.Action.RESTART_GROUP and v.counted
    v = _policy(rules=[policy.Rule(policy.Action.IGNORE)]).decide(_f("t", 1), policy.Counts(restarts=5))
    assert v.action is policy.Action.RESTART_GROUP and not v.counted


def test_policy_from_the_spec():
    from trainingrun.api.spec.cluster import FailurePolicy

    fp = FailurePolicy.model_validate({
        "maxRestarts": 4, "backoffSeconds": 7, "roles": {"engine": {"maxRestarts": 9}},
        "rules": [{"name": "oom", "roles": ["trainer"], "reasons": ["OOMKilled"], "action": "FailRun"},
                  {"exitCodes": [137, 143], "action": "Ignore"}]})
    p = policy.Policy.from_spec(fp)
    assert p.group == policy.Budget(4, 7.0)
    assert p.roles == {"rollout": policy.Budget(4, 7.0), "engine": policy.Budget(9, 7.0)}
    assert [r.name for r in p.rules] == ["failurePolicy.rules[0] (oom)", "failurePolicy.rules[1]"]
    assert p.rules[1].exit_codes == {137, 143} and p.rules[0].action is policy.Action.FAIL_RUN
    # the API's vocabulary is the policy's
    import typing

    from trainingrun.api.spec.cluster import FailureRule

    assert set(typing.get_args(FailureRule.model_fields["action"].annotation)) == {a.value for a in policy.Action}
    assert set(typing.get_args(typing.get_args(FailureRule.model_fields["roles"].annotation)[0])) == set(policy.ROLES)


def test_deadlines():
    assert policy.seconds_left(None, 10, 5.0) is None and policy.seconds_left(1.0, None, 5.0) is None
    assert policy.seconds_left(100.0, 60, 130.0) == 30.0
    assert policy.seconds_left(100.0, 60, 170.0) == -10.0
