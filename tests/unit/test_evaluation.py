"""The pure parts of the evaluation (`rollout.eval`): the pass@k estimator, the evaluation record and the rollout
state's evaluation schedule, through a real file store."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainingrun.contract.errors import CorruptPayload
from trainingrun.contract.evaluation import EVAL_KEY, EvalRecord, read_evals, write_evals
from trainingrun.contract.rollout_state import ROLLOUT_STATE_KEY, RolloutStateRecord
from trainingrun.rollout.evaluate import pass_at_k
from trainingrun.store import open_store


@given(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_the_chance_that_k_of_the_n_completions_hold_one_that_passes(nck):
    """The estimator against its definition: over every way to draw k of the n completions, the fraction that holds
    at least one of the c passing ones."""
    n, c, k = nck
    draws = list(itertools.combinations(range(n), k))
    exact = sum(any(i < c for i in d) for d in draws) / len(draws)
    assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_pass_at_k_refuses_what_it_cannot_estimate():
    for n, c, k in ((3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)):
        with pytest.raises(ValueError, match="pass_at_k"):
            pass_at_k(n, c, k)
    assert pass_at_k(1000, 1, 1000) == 1.0 and math.isclose(pass_at_k(1000, 1, 10), 0.01)


REC = EvalRecord(step=12, weight_version=12, rollout=12, reward_mean=0.5, pass_at_1=0.25, pass_at_k=0.75, k=4,
                 prompts=16, response_length_mean=3.5, samples=64, rewards_failed=2, seconds=0.4, time=1.0)


def test_evaluations_round_trip_through_the_store_one_per_version(tmp_path):
    store = open_store(f"file://{tmp_path}/s")
    assert read_evals(store) == []
    first = EvalRecord(**{**REC.to_json(), "weight_version": 4, "step": 4})
    write_evals(store, [REC, first])
    assert read_evals(open_store(f"file://{tmp_path}/s")) == [first, REC]  # by weight version
    again = EvalRecord(**{**REC.to_json(), "reward_mean": 0.9})
    write_evals(store, [first, REC, again])  # a later record of a version replaces the earlier
    assert read_evals(store) == [first, again]


@pytest.mark.parametrize("change, field", [
    ({"k": -1}, "k must be"), ({"pass_at_k": "high"}, "pass_at_k must be"), ({"reward_mean": None}, "reward_mean"),
    ({"step": 1.5}, "step must be"),
])
def test_a_malformed_evaluation_is_refused_naming_the_field(tmp_path, change, field):
    url = f"file://{tmp_path}/s"
    open_store(url).put_json(EVAL_KEY, {"version": 1, "records": [{**REC.to_json(), **change}]})
    with pytest.raises(CorruptPayload, match=rf"store {url}: key eval: records\[0\]: {field}"):
        read_evals(open_store(url))
    rec = REC.to_json()
    del rec["pass_at_1"]
    with pytest.raises(CorruptPayload, match="pass_at_1 is missing"):
        EvalRecord.from_json(rec)


def test_the_evaluation_schedule_is_part_of_the_rollout_state(tmp_path):
    from trainingrun.rollout.loop import RolloutState

    store = open_store(f"file://{tmp_path}/s")
    state = RolloutState(fingerprint="f", next_rollout=9, step_offset=14, eval_last=8, step_offsets=[11, 14])
    state.save(store)
    back = RolloutState.from_record(RolloutStateRecord.read(store))
    assert (back.eval_last, back.step_offsets) == (8, [11, 14])
    assert back.step_at(9) == 14 and back.step_at(8) == 11  # the weights of rollouts < 8: 11 steps
    fresh = RolloutState(fingerprint="f")
    fresh.save(store)
    assert RolloutStateRecord.read(store).eval_last is None and RolloutState.from_record(
        RolloutStateRecord.read(store)).eval_last == -1
    # a state written before evaluations existed (no eval_last, no step_offsets) reads as "none evaluated"
    old = RolloutStateRecord(fingerprint="f", next_rollout=3, step_offset=5).to_json()
    del old["eval_last"], old["step_offsets"]
    state = RolloutState.from_record(RolloutStateRecord.from_json(old))
    assert state.eval_last == -1 and state.step_offsets == [5]
    store.put_json(ROLLOUT_STATE_KEY, {**old, "step_offsets": [1, "2"]})
    with pytest.raises(CorruptPayload, match=r"step_offsets\[1\]"):
        RolloutStateRecord.read(store)
