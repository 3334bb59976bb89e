"""Rollout stages on their own: synthetic source, jsonl validation, filters, advantages, steps, payload cutting."""

from __future__ import annotations

import json
from typing import get_args

import numpy as np
import pytest

from trainingrun.api.spec.trainer import AdvantageEstimator, StdNormalization
from trainingrun.contract.errors import ConfigError
from trainingrun.contract.published import PublishedRollout, build_published
from trainingrun.rollout.groups import SampleGroup
from trainingrun.rollout.jsonl import load_jsonl
from trainingrun.rollout.generate import overlong_penalty
from trainingrun.rollout.pipeline import (
    ESTIMATORS, STD_NORMALIZATIONS, apply_filters, as_samples, compute_advantages, group_advantages,
    normalize_over_steps, split_into_steps,
)
from trainingrun.rollout.synthetic import EOS, SEP, SyntheticConfig, synthetic_rollout, truncated_pareto_lengths

CFG = SyntheticConfig(task="reverse", min_length=4, max_length=24, vocab_size=40, group_size=4,
                      groups_per_rollout=16, seed=7)


def test_synthetic_is_a_pure_function_of_seed_and_index():
    a, b = synthetic_rollout(CFG, 3), synthetic_rollout(CFG, 3)
    assert [g.group_id for g in a] == [g.group_id for g in b]
    for ga, gb in zip(a, b):
        for ta, tb in zip(ga.tokens, gb.tokens):
            np.testing.assert_array_equal(ta, tb)
        np.testing.assert_array_equal(ga.rewards, gb.rewards)
    c = synthetic_rollout(CFG, 4)
    assert not all(np.array_equal(x.tokens[0], y.tokens[0]) for x, y in zip(a, c))
    other_seed = synthetic_rollout(SyntheticConfig(**{**CFG.__dict__, "seed": 8}), 3)
    assert not all(np.array_equal(x.tokens[0], y.tokens[0]) for x, y in zip(a, other_seed))


@pytest.mark.parametrize("task,answer", [("reverse", lambda p: p[::-1]), ("sort", np.sort), ("copy", lambda p: p)])
def test_synthetic_samples_answer_the_task_and_reward_counts_correct_tokens(task, answer):
    cfg = SyntheticConfig(**{**CFG.__dict__, "task": task})
    ids = []
    for g in synthetic_rollout(cfg, 0):
        assert len(g) == cfg.group_size
        for tokens, mask, reward in zip(g.tokens, g.loss_masks, g.rewards):
            plen = (len(tokens) - 2) // 2
            assert cfg.min_length <= plen <= cfg.max_length
            prompt, response = tokens[:plen], tokens[plen + 1 : 2 * plen + 1]
            assert tokens[plen] == SEP and tokens[-1] == EOS
            assert prompt.min() >= 3 and prompt.max() < cfg.vocab_size and response.min() >= 3
            # targets: exactly the response tokens and EOS
            np.testing.assert_array_equal(np.flatnonzero(mask), np.arange(plen + 1, len(tokens)))
            assert reward == pytest.approx(np.mean(response == answer(prompt)))
        ids.extend(g.sample_ids.tolist())
    assert len(set(ids)) == len(ids) == cfg.group_size * cfg.groups_per_rollout


def test_lengths_are_heavy_tailed_within_bounds():
    rng = np.random.default_rng(0)
    x = truncated_pareto_lengths(rng, 20000, 4, 200)
    assert x.min() == 4 and x.max() == 200
    assert np.median(x) < 8  # most are short ...
    assert (x > 100).mean() > 0.002  # ... and a tail of long ones remains
    # density ∝ x^-2.2: P(X >= 8) / P(X >= 16) ≈ 2^1.2
    ratio = (x >= 8).mean() / (x >= 16).mean()
    assert 2.0 < ratio < 2.9


def test_some_groups_are_identical_and_the_filter_drops_them():
    dropped = []
    for i in range(20):
        groups = synthetic_rollout(CFG, i)
        kept, stats = apply_filters(groups, max_length=None, zero_variance=True)
        for g in kept:
            assert np.ptp(g.rewards) > 0
        assert stats.zero_variance == CFG.group_size * (len(groups) - len(kept))
        dropped.append(stats.zero_variance)
    assert len(set(dropped)) > 3  # the sample count per rollout varies


def test_max_length_filter_drops_whole_groups():
    groups = synthetic_rollout(CFG, 1)
    limit = int(np.median([max(g.lengths) for g in groups]))
    kept, stats = apply_filters(groups, max_length=limit, zero_variance=False)
    assert all(max(g.lengths) <= limit for g in kept)
    assert stats.max_length == sum(len(g) for g in groups if max(g.lengths) > limit) > 0
    assert len(kept) + stats.max_length // CFG.group_size == len(groups)


def test_advantages_group_normalised_or_one_for_sft():
    groups, _ = apply_filters(synthetic_rollout(CFG, 2), max_length=None, zero_variance=True)
    compute_advantages(groups, "policy_gradient")
    for g in groups:
        assert abs(g.advantages.mean()) < 1e-5
        assert g.advantages.std() == pytest.approx(1.0, abs=1e-3)
        assert np.array_equal(np.argsort(g.advantages, kind="stable"), np.argsort(g.rewards, kind="stable"))
    compute_advantages(groups, "sft")
    assert all((g.advantages == 1).all() for g in groups)


def _reference_advantages(r: list[float], estimator: str, std: str) -> list[float]:
    """The estimators written out element by element (docs/rl.md), in plain Python floats."""
    n = len(r)
    mean = sum(r) / n
    if estimator == "grpo":
        var = sum((x - mean) ** 2 for x in r) / (n - 1 if std == "unbiased" and n > 1 else n)
        return [(x - mean) / (var ** 0.5 + 1e-6) for x in r]
    if estimator == "rloo":  # each sample's baseline: the mean of the others' rewards
        return [x - (sum(r) - x) / (n - 1) for x in r] if n > 1 else [0.0] * n
    return [x - mean for x in r]  # dr_grpo; reinforce_pp before the step normalisation


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
@pytest.mark.parametrize("std", ["population", "unbiased"])
def test_advantage_estimators_match_their_formulas(estimator, std):
    rng = np.random.default_rng(1)
    for n in (1, 2, 5, 8):
        r = rng.integers(0, 3, n).astype(np.float64) / 2
        got = group_advantages(r.astype(np.float32), estimator, std)
        assert np.allclose(got, _reference_advantages(r.tolist(), estimator, std), rtol=1e-9, atol=1e-9), (n, r)
    with pytest.raises(ValueError, match="estimator"):
        group_advantages(np.ones(2), "ppo")


def test_reinforce_pp_normalises_over_each_step():
    groups = _groups([3, 2, 4, 3])
    rng = np.random.default_rng(2)
    for g in groups:
        g.rewards = rng.random(len(g)).astype(np.float32)
        g.advantages = None
    compute_advantages(groups, "ppo", "reinforce_pp")
    flat = as_samples(groups).advantages
    for per_step, cuts in ((2, [0, 5, 12]), (None, [0, 12])):  # fixed steps of 2 groups; one dynamic step
        out = normalize_over_steps(flat, groups, per_step, "unbiased")
        for a, b in zip(cuts[:-1], cuts[1:]):
            x = flat[a:b].astype(np.float64)
            assert np.allclose(out[a:b], (x - x.mean()) / (x.std(ddof=1) + 1e-6), atol=1e-6)
        assert np.allclose([out[a:b].mean() for a, b in zip(cuts[:-1], cuts[1:])], 0, atol=1e-6)


def test_overlong_penalty_is_dapos_linear_ramp():
    # maxNewTokens 16, buffer 4: free up to 12 tokens, then −penalty · (L − 12) / 4
    assert [overlong_penalty(n, 16, 4, 1.0) for n in (1, 12, 13, 14, 16)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(16, 16, 16, 0.5) == -0.5 and overlong_penalty(0, 16, 16, 0.5) == 0.0


def _groups(sizes):
    out = []
    for gid, n in enumerate(sizes):
        toks = [np.arange(3, 3 + 5 + gid, dtype=np.int32) for _ in range(n)]
        masks = [np.r_[np.zeros(2, np.uint8), np.ones(3 + gid, np.uint8)] for _ in range(n)]
        out.append(SampleGroup(gid, toks, masks, np.linspace(0, 1, n).astype(np.float32),
                               np.arange(gid * 10, gid * 10 + n), np.ones(n, np.float32)))
    return out


def test_split_into_steps_fixed_and_dynamic():
    groups = _groups([4] * 7)
    steps, carry = split_into_steps(groups, policy="fixed", groups_per_step=3, dp_size=2)
    assert [g.group_id for g in steps] == list(range(6)) and [g.group_id for g in carry] == [6]
    steps, carry = split_into_steps(groups[:2], policy="fixed", groups_per_step=3, dp_size=2)
    assert steps == [] and len(carry) == 2
    steps, carry = split_into_steps(groups, policy="dynamic", groups_per_step=None, dp_size=8)
    assert len(steps) == 7 and carry == []
    steps, carry = split_into_steps(groups[:1], policy="dynamic", groups_per_step=None, dp_size=8)
    assert steps == [] and len(carry) == 1  # 4 samples cannot feed 8 ranks: carried
    with pytest.raises(ConfigError, match="globalBatchSize"):
        split_into_steps(_groups([1, 1, 1, 1]), policy="fixed", groups_per_step=2, dp_size=3)


@pytest.mark.parametrize("batching", [dict(max_tokens_per_gpu=24, micro_batch_size=None),
                                      dict(max_tokens_per_gpu=None, micro_batch_size=2)])
def test_published_rollout_payloads_match_the_schedule(batching):
    groups = _groups([4, 3, 4, 2, 4, 4])
    published, payloads, leftover = build_published(5, as_samples(groups), dp_size=3, groups_per_step=2,
                                                    microbatch_multiple=1, step_offset=10, samples_offset=100,
                                                    **batching)
    assert leftover == []
    assert published.rollout == 5 and published.step_offset == 10 and published.samples_offset == 100
    assert published.global_batch_sizes == [7, 6, 8] and published.num_samples == 21
    by_id = {int(i): (t, m) for g in groups for i, t, m in zip(g.sample_ids, g.tokens, g.loss_masks)}
    seen = []
    step_of = {}
    for s, gs in enumerate([groups[0:2], groups[2:4], groups[4:6]]):
        for g in gs:
            step_of.update({int(i): s for i in g.sample_ids})
    loss_tokens = [0, 0, 0]
    for r, p in payloads.items():
        part = published.schedule.partitions[r]
        assert len(p["sample_ids"]) == len(part)
        for j, sid in enumerate(p["sample_ids"]):
            tokens, mask = by_id[int(sid)]
            a, b = p["offsets"][j], p["offsets"][j + 1]
            np.testing.assert_array_equal(p["tokens"][a:b], tokens)
            np.testing.assert_array_equal(p["loss_mask"][a:b], mask)
            loss_tokens[step_of[int(sid)]] += int(mask.sum())
            seen.append(int(sid))
    assert sorted(seen) == sorted(by_id)
    assert list(published.loss_tokens) == loss_tokens
    assert list(published.step_tokens) == [sum(len(by_id[i][0]) for i in by_id if step_of[i] == s) for s in range(3)]
    assert all(x >= 1.0 for x in published.imbalance)
    # each step's micro-batches, as the trainer reads them, hold exactly that step's samples
    for step in published.steps():
        ids = [int(payloads[r]["sample_ids"][pos]) for r in range(3)
               for mb in published.microbatch_positions(r, step) for pos in mb]
        assert len(ids) == step.global_batch_size and {step_of[i] for i in ids} == {step.index}
        assert step.global_step == 10 + step.index
        assert step.samples_before == 100 + sum(published.global_batch_sizes[: step.index])


def test_published_rollout_json_round_trip_and_malformed_documents():
    published, _, _ = build_published(2, as_samples(_groups([4, 3, 4])), dp_size=2, groups_per_step=None,
                                      max_tokens_per_gpu=32, micro_batch_size=None, step_offset=3, samples_offset=7)
    doc = json.loads(json.dumps(published.to_json()))
    assert PublishedRollout.from_json(doc) == published
    for change, field in [(lambda d: d.pop("loss_tokens"), "loss_tokens"),
                          (lambda d: d.update(loss_tokens=[1, 2, 3]), "schedule.loss_tokens"),
                          (lambda d: d.update(dp_size=3), "schedule.dp_size"),
                          (lambda d: d.update(global_batch_sizes=[1]), "schedule.global_batch_sizes"),
                          (lambda d: d["schedule"]["partitions"][0].append(99), "schedule")]:
        bad = json.loads(json.dumps(doc))
        change(bad)
        with pytest.raises(ValueError, match=field):
            PublishedRollout.from_json(bad)


def test_group_json_round_trip():
    g = synthetic_rollout(CFG, 0)[0]
    g.advantages = np.array([0.5, -0.25, 1e-7, 3.0], np.float32)
    back = SampleGroup.from_json(json.loads(json.dumps(g.to_json())))
    assert back.group_id == g.group_id and back.has_reward
    for a, b in zip(g.tokens + g.loss_masks, back.tokens + back.loss_masks):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    for name in ("rewards", "sample_ids", "advantages"):
        np.testing.assert_array_equal(getattr(g, name), getattr(back, name))


# ------------------------------------------------------------------------------------------------------ jsonl
def _write(tmp_path, lines):
    path = tmp_path / "rollouts.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_jsonl_valid_file(tmp_path):
    path = _write(tmp_path, [
        {"group": "a", "tokens": [5, 6, 7, 8], "prompt_length": 2, "reward": 1.0},
        {"group": "a", "tokens": [5, 6, 9], "loss_mask": [0, 0, 1], "reward": 0.0, "meta": {"x": 1}},
        "",
        {"group": 7, "tokens": [1, 2], "prompt_length": 1, "advantage": -0.5},
        {"group": 7, "tokens": [1, 3], "prompt_length": 1, "advantage": 0.5, "reward": 2},
    ])
    data = load_jsonl(path, vocab_size=10)
    assert [len(g) for g in data.groups] == [2, 2]
    a, b = data.groups
    np.testing.assert_array_equal(a.loss_masks[0], [0, 0, 1, 1])
    assert a.advantages is None and a.has_reward and a.rewards.tolist() == [1.0, 0.0]
    assert b.advantages.tolist() == [-0.5, 0.5] and not b.has_reward
    assert a.sample_ids.tolist() == [0, 1] and b.sample_ids.tolist() == [3, 4]  # line numbers - 1


def test_jsonl_errors_name_file_line_and_field(tmp_path):
    path = _write(tmp_path, [
        {"group": 1, "tokens": [1, 2, 3], "prompt_length": 1, "reward": 1},  # fine
        "{not json",
        {"group": 1, "tokens": [1, 2, 99], "prompt_length": 1, "reward": 1},
        {"group": 1, "tokens": [1, 2, 3], "loss_mask": [1, 1, 1], "reward": 1},
        {"group": 1, "tokens": [1, 2, 3], "prompt_length": 3, "reward": 1},
        {"group": 1, "tokens": [1, 2, 3], "prompt_length": 1},
        {"group": 1, "tokens": [1, 2, 3], "prompt_length": 1, "reward": float("nan")},
        {"group": 1, "tokens": [1, 2, 3], "prompt_length": 1, "loss_mask": [0, 1, 1], "reward": 1},
        {"group": 2, "tokens": [1, 2], "prompt_length": 1, "reward": 1, "rewards": 3},
        {"group": 2, "tokens": [1, 2], "prompt_length": 1, "reward": 0},
        {"group": 1, "tokens": [1, 2], "prompt_length": 1, "reward": 0},
        {"tokens": "abc", "prompt_length": 1, "reward": 0},
    ])
    with pytest.raises(ConfigError) as info:
        load_jsonl(path, vocab_size=10)
    msg = str(info.value)
    for line, field in [(2, "not valid JSON"), (3, "tokens: ids must be in [0, 10)"), (4, "loss_mask: loss_mask[0]"),
                        (5, "prompt_length: must be in [1, 3)"), (6, "reward: give reward or advantage"),
                        (7, "reward: must be a finite number"), (8, "loss_mask: give exactly one"),
                        (9, "rewards: unknown field"), (11, "group: 1 appeared before (line 1)"),
                        (12, "group: missing"), (12, "tokens: must be a list of ints")]:
        assert f"{path}:{line}: {field}" in msg, (line, field, msg)
    assert f"{path}:1:" not in msg and f"{path}:10:" not in msg


def test_jsonl_missing_file_and_partial_advantages(tmp_path):
    with pytest.raises(ConfigError, match="rollout.source.jsonl.path: cannot open"):
        load_jsonl(tmp_path / "nope.jsonl", vocab_size=10)
    path = _write(tmp_path, [
        {"group": 1, "tokens": [1, 2], "prompt_length": 1, "advantage": 1.0},
        {"group": 1, "tokens": [1, 2], "prompt_length": 1, "reward": 1.0},
    ])
    with pytest.raises(ConfigError, match=r":1: advantage: .* on some lines only"):
        load_jsonl(path, vocab_size=10)


def test_estimators_are_the_spec_advantage_estimators():
    """A Literal value without a table entry, or an entry without a Literal value, fails."""
    assert set(ESTIMATORS) == set(get_args(AdvantageEstimator))
    assert all(e.doc for e in ESTIMATORS.values())
    assert STD_NORMALIZATIONS == get_args(StdNormalization)
    assert [name for name, e in ESTIMATORS.items() if e.over_steps] == ["reinforce_pp"]
