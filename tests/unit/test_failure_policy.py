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


def test_budget_verdicts():
    fail = _f("t", 3)
    assert policy.on_failure(fail, restarts=0, max_restarts=2) == policy.Verdict(
        True, "PodFailed", "restart 1 of 2", counted=True)
    v = policy.on_failure(fail, restarts=2, max_restarts=2)
    assert not v.restart and v.reason == "BackoffLimitExceeded" and "all 2 restart(s)" in v.why
    v = policy.on_failure(_f("c", EXIT_CONFIG_ERROR), restarts=0, max_restarts=5)
    assert not v.restart and v.reason == "ConfigError" and "78" in v.why


def test_deadlines():
    assert policy.seconds_left(None, 10, 5.0) is None and policy.seconds_left(1.0, None, 5.0) is None
    assert policy.seconds_left(100.0, 60, 130.0) == 30.0
    assert policy.seconds_left(100.0, 60, 170.0) == -10.0
