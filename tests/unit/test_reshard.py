"""Re-scheduling a published rollout for another data-parallel size (trainingrun/trainer/reshard.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainingrun.schedule import DPSchedule, build_dp_schedule
from trainingrun.trainer.reshard import acked_ranks, reschedule


def _rollout(n_groups: int, group_size: int, dp: int, seed: int, *, groups_per_step: int | None,
             cap: int | None = 40, mbs: int | None = None, multiple: int = 1):
    rng = np.random.default_rng(seed)
    n = n_groups * group_size
    lengths = rng.integers(2, 20, n)
    groups = [i // group_size for i in range(n)]
    sched = build_dp_schedule(lengths, dp_size=dp, global_batch_size=groups_per_step, group_ids=groups,
                              max_tokens_per_gpu=cap, micro_batch_size=mbs, microbatch_multiple=multiple)
    tokens = [rng.integers(0, 100, int(x)).astype(np.int32) for x in lengths]
    masks = [(rng.random(int(x)) < 0.6).astype(np.uint8) for x in lengths]
    ids = np.arange(1000, 1000 + n, dtype=np.int64)
    rewards = rng.random(n).astype(np.float32)
    payloads = {}
    for r, part in enumerate(sched.partitions):
        payloads[r] = {
            "tokens": np.concatenate([tokens[i] for i in part]), "loss_mask": np.concatenate([masks[i] for i in part]),
            "offsets": np.concatenate([[0], np.cumsum([lengths[i] for i in part])]).astype(np.int64),
            "advantages": rewards[part] - 0.5, "rewards": rewards[part], "sample_ids": ids[part],
        }
    return sched, payloads, tokens, masks, ids


def _samples_by_step(sched: DPSchedule, payloads) -> list[dict[int, tuple]]:
    """Per step: {sample id: (tokens, loss mask, reward)} over all ranks, from the payloads."""
    out = []
    for s in range(sched.num_steps):
        seen = {}
        for r in range(sched.dp_size):
            pos = {i: p for p, i in enumerate(sched.partitions[r])}
            pay = payloads[r]
            for mb in sched.step_microbatches(r, s):
                for i in mb:
                    p = pos[i]
                    a, b = pay["offsets"][p], pay["offsets"][p + 1]
                    seen[int(pay["sample_ids"][p])] = (pay["tokens"][a:b].tolist(), pay["loss_mask"][a:b].tolist(),
                                                       float(pay["rewards"][p]), float(pay["advantages"][p]))
        out.append(seen)
    return out


@settings(max_examples=60, deadline=None)
@given(old_dp=st.integers(1, 4), new_dp=st.integers(1, 5), n_groups=st.integers(6, 14), group_size=st.integers(1, 4),
       seed=st.integers(0, 10_000), fixed=st.booleans(), static=st.booleans())
def test_reschedule_keeps_every_step_and_sample(old_dp, new_dp, n_groups, group_size, seed, fixed, static):
    gps = 3 if fixed else None
    kw = {"cap": None, "mbs": 2} if static else {"cap": 40}
    n = n_groups * group_size
    if (gps or n_groups) * group_size < max(old_dp, new_dp) * (2 if static else 1):
        return  # steps too small for the ranks: covered by the ValueError test
    sched, payloads, *_ = _rollout(n_groups, group_size, old_dp, seed, groups_per_step=gps, **kw)
    if sched.leftover:  # keep whole steps only, as the rollout publishes them
        return
    try:
        new, new_payloads = reschedule(sched, payloads, new_dp)
    except ValueError as exc:  # static micro-batches that cannot align for the new size: said so, nothing else
        assert static and "micro_batch_size" in str(exc)
        return
    assert new.dp_size == new_dp and sorted(new_payloads) == list(range(new_dp))
    DPSchedule.from_dict(new.to_dict()).validate()
    assert new.global_batch_sizes == sched.global_batch_sizes
    assert _samples_by_step(new, new_payloads) == _samples_by_step(sched, payloads)  # same samples, same steps
    for r, pay in new_payloads.items():
        assert len(pay["sample_ids"]) == len(new.partitions[r]) and pay["offsets"][-1] == len(pay["tokens"])
        assert {k: v.dtype for k, v in pay.items()} == {k: v.dtype for k, v in payloads[0].items()}
    assert sum(len(p["sample_ids"]) for p in new_payloads.values()) == n


def test_same_size_is_a_valid_plan_too():
    sched, payloads, *_ = _rollout(8, 4, 2, 1, groups_per_step=2)
    new, pays = reschedule(sched, payloads, 2)
    assert _samples_by_step(new, pays) == _samples_by_step(sched, payloads)


def test_step_smaller_than_the_new_size_is_refused():
    sched, payloads, *_ = _rollout(6, 1, 2, 3, groups_per_step=2)  # steps of 2 samples
    with pytest.raises(ValueError, match="step 0 has 2 samples, fewer than the new data-parallel size 3"):
        reschedule(sched, payloads, 3)


def test_missing_old_payload_is_refused():
    sched, payloads, *_ = _rollout(8, 2, 2, 3, groups_per_step=None)
    del payloads[1]
    with pytest.raises(ValueError, match=r"payloads: need every old rank 0..1"):
        reschedule(sched, payloads, 3)


@pytest.mark.parametrize("old_dp, new_dp", [(2, 3), (3, 2), (4, 1), (1, 4), (3, 3), (5, 2)])
def test_acks_cover_every_old_rank_once(old_dp, new_dp):
    acked = [j for r in range(new_dp) for j in acked_ranks(old_dp, new_dp, r)]
    assert sorted(acked) == list(range(old_dp))


def test_generated_rollouts_keep_their_logprobs_and_versions():
    """Payloads of generated rollouts carry per-token generator logprobs and per-sample weight versions; a
    re-schedule moves them with their samples (else a resized run would train ppo against the wrong old policy)."""
    sched, payloads, *_ = _rollout(8, 4, 3, 5, groups_per_step=2)
    for r, pay in payloads.items():
        pay["logprobs"] = -(pay["tokens"].astype(np.float32) / 100.0)  # a function of the token: checkable after
        pay["versions"] = (pay["sample_ids"] % 3).astype(np.int64)
    new, pays = reschedule(sched, payloads, 2)
    for pay in pays.values():
        np.testing.assert_array_equal(pay["logprobs"], -(pay["tokens"].astype(np.float32) / 100.0))
        np.testing.assert_array_equal(pay["versions"], pay["sample_ids"] % 3)
        assert pay["logprobs"].dtype == np.float32 and pay["versions"].dtype == np.int64
