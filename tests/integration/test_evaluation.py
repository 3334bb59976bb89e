"""Periodic evaluation (`spec.rollout.eval`, trainingrun/rollout/evaluate.py) in the rollout loop, against a real store
(temp directory), with the stand-in engine of test_generate_rollout.py (plain numpy, samples deterministically from
(seed, prompt, weights); the in-process Megatron engine and real vLLM are tested end to end in test_rl_e2e.py and
test_vllm_e2e.py).

Checks: versions 0, N, 2N, ... and the final one are evaluated, each before the rollout generated with it and with
exactly that version loaded; the published rollouts of a run with evaluation equal, array for array, those of the same
run without; the records (store, eval.jsonl) carry the step the weights were trained to; a rollout that crashes before,
during or after an evaluation resumes without repeating or skipping one.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.integration.test_generate_rollout import StandInEngine, doc, loop, publish_versions
from trainingrun.api import parse_trainingrun
from trainingrun.contract.evaluation import EVAL_FILE, read_evals
from trainingrun.contract.published import read
from trainingrun.contract.rollout_state import RolloutStateRecord
from trainingrun.rollout.evaluate import Evaluator
from trainingrun.store import open_store

ROLLOUTS = 6
EVAL = {"intervalRollouts": 2, "numPrompts": 5, "samplesPerPrompt": 3, "passThreshold": 0.5,
        "prompts": {"synthetic": {"task": "reverse", "minLength": 1, "maxLength": 3, "vocabSize": 8}}}


def spec_of(*, eval_: dict | None, lag: int = 0, rollouts: int = ROLLOUTS):
    d = doc(numRollouts=rollouts, maxPolicyLag=lag)
    d["spec"]["metrics"] = {"tensorboard": {"enabled": False}}
    if eval_ is not None:
        d["spec"]["rollout"]["eval"] = eval_
    return parse_trainingrun(d).spec


class Recording(StandInEngine):
    """The stand-in engine, recording each generate call: the version it held and whether it was an evaluation's
    (the evaluation asks for samplesPerPrompt completions of numPrompts prompts)."""

    def __init__(self, store):
        super().__init__(store)
        self.calls: list[tuple[str, int]] = []

    def generate(self, prompts, n, sampling):
        self.calls.append(("eval" if n == EVAL["samplesPerPrompt"] else "train", self.version))
        return super().generate(prompts, n, sampling)


def run(tmp_path, name: str, *, eval_: dict | None, lag: int = 0, engine=None, store=None, **kw):
    store = store or open_store(f"file://{tmp_path}/{name}")
    publish_versions(store, range(ROLLOUTS + 1))
    engine = engine or Recording(store)
    result = loop(spec_of(eval_=eval_, lag=lag), store, engine, out_dir=tmp_path / f"{name}-out", **kw).run()
    return store, engine, result


def published_arrays(store, n: int) -> list:
    return [(read(store, k).global_batch_sizes, [store.read_payload(k, r) for r in range(2)]) for k in range(n)]


def same_training(a, b, n: int = ROLLOUTS) -> None:
    for k, ((ga, pa), (gb, pb)) in enumerate(zip(published_arrays(a, n), published_arrays(b, n), strict=True)):
        assert ga == gb, k
        for x, y in zip(pa, pb):
            assert set(x) == set(y) and all(np.array_equal(x[f], y[f]) for f in x), k


@pytest.mark.parametrize("lag", [0, 1])
def test_versions_0_n_2n_and_the_final_one_are_evaluated_and_training_is_unchanged(tmp_path, lag):
    plain, plain_engine, _ = run(tmp_path, "plain", eval_=None, lag=lag)
    store, engine, result = run(tmp_path, "eval", eval_=EVAL, lag=lag)
    assert result.rollouts == ROLLOUTS
    same_training(plain, store)
    assert [c for c in engine.calls if c[0] == "train"] == plain_engine.calls  # the same training calls, same versions
    # the evaluation loaded no version the training would not have, but the final one, after the last rollout
    assert engine.loads == [*plain_engine.loads, ROLLOUTS]
    records = read_evals(store)
    assert [r.weight_version for r in records] == [0, 2, 4, 6]  # 6: the final weights (all rollouts trained)
    # each evaluated right before the first rollout generated with it (rollout v + lag; version 0: rollout 0), with
    # exactly that version loaded
    evals = [i for i, c in enumerate(engine.calls) if c[0] == "eval"]
    assert [engine.calls[i][1] for i in evals] == [0, 2, 4, 6]
    for i, v in zip(evals[:-1], (0, 2, 4)):
        assert engine.calls[i + 1] == ("train", v)
    assert [r.rollout for r in records] == [0, 2 + lag, 4 + lag, ROLLOUTS]  # version 0: before rollout 0
    # the step trained into the weights: the step offset of rollout v (the final: every step published)
    steps = [read(store, v).step_offset for v in (0, 2, 4)] + [read(store, ROLLOUTS - 1).step_offset +
                                                                read(store, ROLLOUTS - 1).num_steps]
    assert [r.step for r in records] == steps
    for r in records:
        assert (r.k, r.prompts, r.samples) == (3, 5, 15) and 0 <= r.pass_at_1 <= r.pass_at_k <= 1
        assert 0 <= r.reward_mean <= 1 and r.response_length_mean > 0 and r.rewards_failed == 0
    lines = [json.loads(x) for x in (tmp_path / "eval-out" / EVAL_FILE).read_text().splitlines()]
    assert lines == [r.to_json() for r in records]
    assert RolloutStateRecord.read(store).eval_last == ROLLOUTS


def test_the_evaluation_scores_what_the_engine_generated(tmp_path):
    """reward_mean and pass@k from the completions themselves: the same prompts, seeds and scoring by hand."""
    store, engine, _ = run(tmp_path, "eval", eval_=EVAL)
    spec = spec_of(eval_=EVAL)
    lp = loop(spec, store, engine, out_dir=tmp_path / "again")
    ev: Evaluator = lp.evaluator
    rec = ev.evaluate(4, step=0, rollout=0)
    (stored,) = [r for r in read_evals(store) if r.weight_version == 4]
    assert (rec.reward_mean, rec.pass_at_1, rec.pass_at_k) == (stored.reward_mean, stored.pass_at_1, stored.pass_at_k)
    prompts = ev.prompts.draw(0, 5)
    from trainingrun.contract.engine import Sampling
    from trainingrun.rollout.evaluate import eval_seed, pass_at_k
    from trainingrun.rollout.rewards import token_match

    comps = engine.generate([p.tokens.tolist() for p in prompts], 3, Sampling(
        max_new_tokens=4, stop_token_ids=ev.stop_ids, seed=eval_seed(spec.seed, 4)))
    rewards = [[token_match(c.tokens.tolist(), p.reference) for c in cs] for p, cs in zip(prompts, comps)]
    assert rec.reward_mean == pytest.approx(np.mean(rewards))
    passed = [sum(r >= 0.5 for r in rs) for rs in rewards]
    assert rec.pass_at_1 == pytest.approx(np.mean([c / 3 for c in passed]))
    assert rec.pass_at_k == pytest.approx(np.mean([pass_at_k(3, c, 3) for c in passed]))
    # held out: not the training's prompts of source rollout 0 (synthetic prompts of the evaluation's own seed)
    train = lp.source.prompts.draw(0, 5)
    assert [p.tokens.tolist() for p in prompts] != [p.tokens.tolist() for p in train]


class Crash(Exception):
    pass


@pytest.mark.parametrize("when", ["during", "after-record", "after-state"])
def test_a_crashed_rollout_neither_repeats_nor_skips_an_evaluation(tmp_path, monkeypatch, when):
    """The rollout dies while evaluating version 2 (nothing stored), right after its record was stored (before the
    state said so), or right after (generating rollout 2); a restarted loop on the same store goes on: versions
    0, 2, 4, 6 evaluated, each stored once, none evaluated twice once stored, training as without evaluation."""
    plain, _, _ = run(tmp_path, "plain", eval_=None)
    store = open_store(f"file://{tmp_path}/crashed")
    ran: list[int] = []
    orig_evaluate, orig_report, orig_generate = Evaluator.evaluate, Evaluator.report, Recording.generate
    crashed = []

    def evaluate(self, version, **kw):
        if when == "during" and version == 2 and not crashed:
            crashed.append(version)
            raise Crash()
        ran.append(version)
        return orig_evaluate(self, version, **kw)

    def report(self, rec):
        if when == "after-record" and rec.weight_version == 2 and not crashed:
            crashed.append(rec.weight_version)
            raise Crash()
        return orig_report(self, rec)

    def generate(self, prompts, n, sampling):
        if when == "after-state" and n != EVAL["samplesPerPrompt"] and self.version == 2 and not crashed:
            crashed.append(2)
            raise Crash()
        return orig_generate(self, prompts, n, sampling)

    monkeypatch.setattr(Evaluator, "evaluate", evaluate)
    monkeypatch.setattr(Evaluator, "report", report)
    monkeypatch.setattr(Recording, "generate", generate)
    with pytest.raises(Crash):
        run(tmp_path, "crashed", eval_=EVAL, store=store)
    assert crashed == [2]
    said = []
    _, _, result = run(tmp_path, "crashed", eval_=EVAL, store=store, progress=said.append)
    assert result.rollouts == ROLLOUTS
    assert [r.weight_version for r in read_evals(store)] == [0, 2, 4, 6]
    assert sorted(ran) == [0, 2, 4, 6]  # each evaluated once: never again once its record was stored
    if when == "after-record":  # the record was stored, the state did not say so yet: found, not run again
        assert any("evaluation of weight version 2 found in the store" in m for m in said), said
    lines = [json.loads(x) for x in (tmp_path / "crashed-out" / EVAL_FILE).read_text().splitlines()]
    assert [x["weight_version"] for x in lines] == [0, 2, 4, 6]
    same_training(plain, store)
