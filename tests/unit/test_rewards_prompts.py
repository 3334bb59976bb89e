"""Rewards (registry, failures that never stop the rollout) and the prompts of generated rollouts."""

from __future__ import annotations

import json
import time
from typing import get_args

import numpy as np
import pytest

from trainingrun.api import parse_trainingrun
from trainingrun.api.spec.rollout import RewardType
from trainingrun.contract.engine import Completion
from trainingrun.rollout.generate import GenerateSource
from trainingrun.rollout.prompts import ByteTokenizer, Prompt, load_prompt_lines, make_prompts, synthetic_answer
from trainingrun.rollout.rewards import (
    REWARD_KINDS, Failed, RewardConfig, RewardKind, RewardSample, RewardScorer, exact_match, math_verify,
    token_match,
)
from trainingrun.contract.errors import ConfigError
from trainingrun.rollout.synthetic import EOS, SEP


def test_token_and_exact_match():
    assert exact_match([3, 4, 2], [3, 4, 2]) == 1.0 and exact_match([3, 4], [3, 4, 2]) == 0.0
    assert exact_match(" 18 \n", "18") == 1.0
    assert token_match([3, 4, 2], [3, 4, 2]) == 1.0
    assert token_match([3, 5, 2], [3, 4, 2]) == pytest.approx(2 / 3)
    assert token_match([3, 2], [3, 4, 2]) == pytest.approx(1 / 3)  # stopped early: the missing positions count
    assert token_match([3, 4, 2, 5, 6, 7], [3, 4, 2]) == pytest.approx(3 / 6)  # too long: the extra ones too


def test_math_verify_reward():
    assert math_verify("The answer is \\boxed{18}", "18") == 1.0
    assert math_verify("\\frac{36}{2}", "18") == 1.0
    assert math_verify("17", "18") == 0.0


def _samples(pairs, **fields) -> list[RewardSample]:
    """(response, reference) pairs as the reward's samples (no prompt)."""
    return [RewardSample(prompt=None, prompt_tokens=[], response=r, response_tokens=[], reference=ref, **fields)
            for r, ref in pairs]


def test_function_reward_failures_are_counted_and_never_stop_scoring():
    """raise, hang (killed after the timeout), NaN and None are failed rewards with failedReward; the items after
    them are scored normally by fresh workers."""
    scorer = RewardScorer(RewardConfig(type="function", function="tests.rewards_fixture:flaky"), timeout=1.0,
                          failed_reward=-1.0, workers=2)
    try:
        items = [("a", "a"), ("raise", "a"), ("hang", "a"), ("nan", "a"), ("b", "a"), ("none", "a"), ("c", "c")]
        t0 = time.monotonic()
        scored = scorer.score(_samples(items))
        took = time.monotonic() - t0
        assert scored.rewards == [1.0, -1.0, -1.0, -1.0, 0.0, -1.0, 1.0]
        assert scored.failed == [None, "error", "timeout", "nan", None, "nan", None]
        assert scored.counts() == {"error": 1, "timeout": 1, "nan": 2}
        assert any("the reward exploded" in m for m in scored.messages)
        assert took < 20, took  # the hang cost one timeout, not an hour
        again = scorer.score(_samples([("x", "x"), ("hang", "x"), ("y", "y")]))  # the pool keeps working after a kill
        assert again.rewards == [1.0, -1.0, 1.0] and again.failed == [None, "timeout", None]
    finally:
        scorer.close()


def test_function_that_cannot_be_loaded_fails_every_item_with_its_reason():
    scorer = RewardScorer(RewardConfig(type="function", function="tests.rewards_fixture:nope"), timeout=5.0,
                          failed_reward=0.0)
    try:
        scored = scorer.score(_samples([("a", "a")]))
        assert scored.failed == ["error"] and "cannot load 'tests.rewards_fixture:nope'" in scored.messages[0]
    finally:
        scorer.close()


def test_reasoning_gym_reward_scores_by_dataset_index():
    import reasoning_gym

    params = {"name": "basic_arithmetic", "config": {}, "seed": 3, "size": 5}
    ds = reasoning_gym.create_dataset("basic_arithmetic", seed=3, size=5)
    scorer = RewardScorer(RewardConfig(type="reasoning_gym", dataset=params), timeout=30.0, failed_reward=0.0)
    try:
        scored = scorer.score([*_samples([(ds[2]["answer"], None), ("nonsense", None)], index=2),
                               *_samples([(ds[4]["answer"], None)], index=4)])
        assert scored.rewards == [1.0, 0.0, 1.0] and scored.failed == [None, None, None]
    finally:
        scorer.close()


def test_reward_kinds_are_the_spec_reward_types():
    """A Literal value without a table entry, or an entry without a Literal value, fails."""
    assert set(REWARD_KINDS) == set(get_args(RewardType))
    assert all(kind.doc for kind in REWARD_KINDS.values())


def _batch_kind(monkeypatch, fn) -> RewardScorer:
    """A scorer of an in-process reward type whose batch function is `fn` (in place of token_match)."""
    monkeypatch.setitem(REWARD_KINDS, "token_match", RewardKind("test", lambda config: fn, isolated=False))
    return RewardScorer(RewardConfig(type="token_match"), timeout=1.0, failed_reward=-1.0)


def test_an_in_process_reward_type_scores_the_whole_batch_and_fails_it_whole(monkeypatch):
    calls = []

    def good(samples):
        calls.append(len(samples))
        return [Failed("no answer"), 0.5, float("nan"), 2]

    scored = _batch_kind(monkeypatch, good).score(_samples([("a", "a")] * 4))
    assert calls == [4]  # one call for the batch
    assert scored.rewards == [-1.0, 0.5, -1.0, 2.0] and scored.failed == ["error", None, "nan", None]
    assert scored.messages[0] == "error: no answer"
    raised = _batch_kind(monkeypatch, lambda samples: 1 / 0).score(_samples([("a", "a")] * 3))
    assert raised.failed == ["error"] * 3 and "ZeroDivisionError" in raised.messages[0]
    short = _batch_kind(monkeypatch, lambda samples: [1.0]).score(_samples([("a", "a")] * 2))
    assert short.failed == ["error"] * 2 and "returned 1 rewards for 2 samples" in short.messages[0]


def test_reward_sample_of_a_text_prompt_round_trips_as_json():
    prompt = Prompt(tokens=np.array([5, 6, 7], np.int32), reference="18", index=3, text="2*9=", meta={"id": "q3"})
    sample = RewardSample.of(prompt, "18", np.array([8, 9, 2], np.int32))
    assert (sample.prompt, sample.prompt_tokens, sample.response, sample.response_tokens) == (
        "2*9=", [5, 6, 7], "18", [8, 9, 2])
    assert (sample.reference, sample.meta, sample.index) == ("18", {"id": "q3"}, 3)
    assert RewardSample.from_json(json.loads(json.dumps(sample.to_json()))) == sample


class _Engine:
    """Completions of 1..3 tokens from a seeded generator (the Engine protocol, weights never change)."""

    name = "test"
    weight_version = 0

    def generate(self, prompts, n, sampling):
        rng = np.random.default_rng(sampling.seed)
        lengths = rng.integers(1, 4, size=(len(prompts), n))
        return [[Completion(tokens=rng.integers(3, 8, size=m).astype(np.int32), logprobs=np.zeros(m, np.float32),
                            finish_reason="length") for m in row] for row in lengths]

    def close(self) -> None:
        pass


def test_the_rollout_scores_each_batch_with_its_prompts(monkeypatch):
    """The generated source hands the reward type one batch per score call: each sample with its prompt's tokens,
    its completion's tokens, the prompt's reference and index."""
    calls = []

    def record(samples):
        calls.append(list(samples))
        return [float(len(s.response_tokens)) for s in samples]

    monkeypatch.setitem(REWARD_KINDS, "token_match", RewardKind("test", lambda config: record, isolated=False))
    run = spec({"synthetic": {"task": "copy", "minLength": 1, "maxLength": 3, "vocabSize": 8}}, vocabSize=8)
    run.rollout.source.generate.reward.type = "token_match"
    source = GenerateSource(run, None, arch=run.model.resolved(), engine=_Engine(), say=lambda _m: None)
    prompts = source.draw(0)
    groups = source.generate(prompts, 0)
    source.score(groups)
    assert len(calls) == 1 and len(calls[0]) == 16
    for j, (p, g) in enumerate(zip(prompts, groups)):
        for i in range(4):
            sample, completion = calls[0][4 * j + i], g.tokens[i][len(p.tokens):]
            assert sample.prompt_tokens == p.tokens.tolist() and sample.response_tokens == completion.tolist()
            assert sample.reference == p.reference and sample.index == p.index and sample.prompt is None
            assert g.rewards[i] == len(completion)


# ------------------------------------------------------------------------------------------------------ prompts
def spec(prompts: dict, **model):
    return parse_trainingrun({
        "apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "p"},
        "spec": {"seed": 5, "model": {"preset": "tiny", **model},
                 "trainer": {"maxTokensPerGPU": 64, "lossType": "ppo"},
                 "rollout": {"samplesPerRollout": 16, "groupSize": 4,
                             "source": {"type": "generate", "generate": {"prompts": prompts}}}},
    }).spec


def prompt_source(run_spec):
    """The run's prompt source for its (once resolved) model."""
    return make_prompts(run_spec, run_spec.model.resolved())


@pytest.mark.parametrize("task,fn", [("copy", lambda c: c), ("reverse", lambda c: c[::-1]), ("sort", sorted),
                                     ("successor", lambda c: [(x - 3 + 1) % 5 + 3 for x in c])])
def test_synthetic_prompts_are_a_pure_function_of_seed_and_index(task, fn):
    src = prompt_source(spec({"synthetic": {"task": task, "minLength": 1, "maxLength": 4, "vocabSize": 8}}))
    a, b, c = src.draw(3, 4), src.draw(3, 4), src.draw(4, 4)
    assert [p.tokens.tolist() for p in a] == [p.tokens.tolist() for p in b] != [p.tokens.tolist() for p in c]
    assert [p.index for p in a] == [12, 13, 14, 15]
    for p in a:
        content = p.tokens[:-1].tolist()
        assert p.tokens[-1] == SEP and 1 <= len(content) <= 4 and all(3 <= x < 8 for x in content)
        assert p.reference == [*fn(content), EOS]
    assert synthetic_answer("successor", np.array([7]), 8).tolist() == [3]  # cyclic


def test_text_prompts_need_a_vocabulary_for_the_byte_tokenizer():
    with pytest.raises(ConfigError, match="model.vocabSize: 256 is too small"):
        prompt_source(spec({"type": "reasoningGym", "reasoningGym": {"name": "basic_arithmetic", "size": 4}}))
    src = prompt_source(spec({"type": "reasoningGym", "reasoningGym": {"name": "basic_arithmetic", "size": 4},
                             "template": "Q: {prompt}\nA:"}, vocabSize=300))
    prompts = src.draw(1, 3)  # indices 3, 4 -> 0 (the dataset is drawn again from the start), 1
    assert [p.index for p in prompts] == [3, 0, 1]
    tok = ByteTokenizer()
    assert tok.decode(prompts[0].tokens).startswith("Q: ") and tok.decode(prompts[0].tokens).endswith("\nA:")
    assert isinstance(prompts[0].reference, str)
    with pytest.raises(ConfigError, match="reasoningGym: cannot create 'no_such_task'"):
        prompt_source(spec({"type": "reasoningGym", "reasoningGym": {"name": "no_such_task"}}, vocabSize=300))


def test_prompt_jsonl_validation_names_file_line_and_field(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "2+2=", "answer": "4"}),
        json.dumps({"prompt_tokens": [5, 6], "answer": [7, 2]}),
        "{bad",
        json.dumps({"prompt": "x", "prompt_tokens": [1]}),
        json.dumps({"prompt_tokens": [1, 999]}),
        json.dumps({"prompt": "x", "extra": 1}),
        json.dumps({"prompt": ""}),
    ]) + "\n")
    with pytest.raises(ConfigError) as info:
        load_prompt_lines(path, vocab_size=300)
    msg = str(info.value)
    for line, field in [(3, "not valid JSON"), (4, "prompt: give exactly one"), (5, "prompt_tokens: ids must be in"),
                        (6, "extra: unknown field"), (7, "prompt: must be a non-empty string")]:
        assert f"{path}:{line}: {field}" in msg, (line, msg)
    path.write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n" + json.dumps({"prompt_tokens": [5, 6]}) + "\n")
    src = prompt_source(spec({"type": "jsonl", "jsonl": {"path": str(path)}}, vocabSize=300))
    first = src.draw(0, 4)
    assert [p.index for p in first] == [0, 1] and first[1].tokens.tolist() == [5, 6] and first[0].reference == "4"
    assert src.draw(1, 4) is None  # the file ended
