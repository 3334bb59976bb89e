"""Tests of trainingrun.schedule: every contract invariant (property tests) and the documented edge cases."""

from __future__ import annotations

import json
import math
from collections import Counter
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.schedule_reference import ReferenceRefiner
from tests.schedule_reference import pack_lpt as reference_pack_lpt
from trainingrun.schedule import DPSchedule, build_dp_schedule, lower_bound_microbatches, packing, schedule_stats

# ------------------------------------------------------------------------------------------------ independent oracle


def expected_steps(n, group_ids, gbs):
    """Steps (lists of groups, each a list of sample indices) and leftover groups, computed the obvious way."""
    groups: dict = {}
    for i in range(n):
        groups.setdefault(i if group_ids is None else group_ids[i], []).append(i)
    ordered = list(groups.values())
    per = len(ordered) if gbs is None else gbs
    if not ordered:
        return [], []
    n_steps = len(ordered) // per
    return [ordered[s * per:(s + 1) * per] for s in range(n_steps)], ordered[n_steps * per:]


def check_invariants(sched, lengths, *, dp, group_ids=None, gbs=None, cap=None, mbs=None, mult=1):
    """Assert every invariant of the Schedule API contract on ``sched``."""
    n = len(lengths)
    steps, left_groups = expected_steps(n, group_ids, gbs)
    assert sched.dp_size == dp and len(sched.micro_batch_indices) == dp
    assert sched.num_steps == len(steps) == len(sched.global_batch_sizes)
    # 1. every non-leftover sample placed exactly once; leftover = the trailing groups
    placed = [i for p in sched.partitions for i in p]
    assert len(placed) == len(set(placed))
    assert sorted(placed + sched.leftover) == list(range(n))
    assert sorted(sched.leftover) == sorted(i for g in left_groups for i in g)
    # 6. sizes
    assert sum(sched.global_batch_sizes) + len(sched.leftover) == n
    assert sum(sched.global_batch_sizes) == n - len(sched.leftover)
    for r in range(dp):
        # 3. same micro-batch count on every rank; 4. positions flatten to range
        assert len(sched.micro_batch_indices[r]) == sum(sched.num_microbatches)
        flat = [p for mb in sched.micro_batch_indices[r] for p in mb]
        assert flat == list(range(len(sched.partitions[r])))
    for s, groups in enumerate(steps):
        m = sched.num_microbatches[s]
        assert m >= mult and m % mult == 0
        step = [sched.step_microbatches(r, s) for r in range(dp)]
        ids = [i for rank in step for mb in rank for i in mb]
        # 2. the step holds exactly its whole groups (a group never split across steps)
        assert sorted(ids) == sorted(i for g in groups for i in g)
        assert sorted(ids) == sorted(sched.step_samples(s))
        assert sched.global_batch_sizes[s] == len(ids)
        for rank in step:
            assert len(rank) == m
            assert sum(map(len, rank)) >= 1  # 7. every rank has a sample
            for mb in rank:
                if cap is not None:  # 5. cap unless a single oversized sample
                    assert len(mb) == 1 or sum(lengths[i] for i in mb) <= cap
                if mbs is not None:
                    assert 1 <= len(mb) <= mbs
        empties = sum(1 for rank in step for mb in rank if not mb)
        if empties:  # only when unavoidable: more aligned micro-batches than samples
            assert cap is not None and m * dp > len(ids)
        lower = lower_bound_microbatches(np.asarray([lengths[i] for i in ids]), dp_size=dp, multiple=mult,
                                         token_cap=cap, count_cap=mbs)
        assert m * dp >= lower
        if mbs is not None:
            assert m * dp == lower
    # the store round trip is lossless and validates
    again = DPSchedule.from_dict(json.loads(json.dumps(sched.to_dict())))
    assert again == sched
    sched.validate(lengths)


def aligned(x, q):
    return max(1, math.ceil(x / q)) * q


# ------------------------------------------------------------------------------------------------------- properties


@st.composite
def problems(draw):
    n_groups = draw(st.integers(0, 40))
    sizes = draw(st.lists(st.integers(1, 6), min_size=n_groups, max_size=n_groups))
    n = sum(sizes)
    lengths = draw(st.lists(st.integers(1, 3000) | st.integers(3000, 20000), min_size=n, max_size=n))
    ids = [g for g, k in enumerate(sizes) for _ in range(k)]
    if draw(st.booleans()):  # non-contiguous groups, arbitrary labels
        ids = draw(st.permutations(ids))
        ids = [f"g{g * 7 % 13}-{g}" for g in ids]
    group_ids = ids if draw(st.booleans()) or n == 0 else None
    dp = draw(st.integers(1, 6))
    gbs = draw(st.none() | st.integers(1, 12))
    mult = draw(st.integers(1, 3))
    static = draw(st.booleans())
    cap = None if static else draw(st.integers(1, 12000))
    mbs = draw(st.integers(1, 6)) if static else None
    cost = draw(st.sampled_from(["tokens", "flops"]))
    return dict(lengths=lengths, group_ids=group_ids, dp=dp, gbs=gbs, mult=mult, cap=cap, mbs=mbs, cost=cost)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_invariants_hold_or_documented_error(p):
    lengths = p["lengths"]
    steps, _ = expected_steps(len(lengths), p["group_ids"], p["gbs"])
    sizes = [sum(map(len, g)) for g in steps]
    kwargs = dict(dp_size=p["dp"], global_batch_size=p["gbs"], group_ids=p["group_ids"],
                  max_tokens_per_gpu=p["cap"], micro_batch_size=p["mbs"], microbatch_multiple=p["mult"],
                  cost=p["cost"])
    if any(k < p["dp"] for k in sizes):  # short step: documented ValueError
        event("short step")
        with pytest.raises(ValueError, match=r"^(global_batch_size|lengths): step \d+ has \d+ samples, fewer"):
            build_dp_schedule(lengths, **kwargs)
        return
    q = p["dp"] * p["mult"]
    if p["mbs"] is not None and any(aligned(math.ceil(k / p["mbs"]), q) > k for k in sizes):
        event("static count cannot be aligned")
        with pytest.raises(ValueError, match=r"^micro_batch_size: .*cannot be aligned"):
            build_dp_schedule(lengths, **kwargs)
        return
    sched = build_dp_schedule(lengths, **kwargs)
    event(f"scheduled ({'no steps' if not steps else 'static' if p['mbs'] else 'dynamic'})")
    check_invariants(sched, lengths, dp=p["dp"], group_ids=p["group_ids"], gbs=p["gbs"], cap=p["cap"],
                     mbs=p["mbs"], mult=p["mult"])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=64, max_size=300), st.sampled_from([2, 4, 8]),
       st.integers(4000, 20000))
def test_balance_and_count_on_roomy_steps(lengths, dp, cap):
    """With a few samples per micro-batch the count is at the aligned lower bound and no rank exceeds the mean by
    more than one sample's tokens."""
    sched = build_dp_schedule(lengths, dp_size=dp, max_tokens_per_gpu=cap)
    (stats,) = schedule_stats(sched, lengths)
    assert stats["max_rank_tokens"] - stats["mean_rank_tokens"] <= max(lengths)
    check_invariants(sched, lengths, dp=dp, cap=cap)


# ------------------------------------------------------------------------------------------------------- unit cases


def test_uniform_lengths_are_perfectly_balanced():
    lengths = [1000] * 64
    sched = build_dp_schedule(lengths, dp_size=4, max_tokens_per_gpu=4000)
    (stats,) = schedule_stats(sched, lengths)
    assert sched.num_microbatches == [4]
    assert stats["token_imbalance"] == 1.0 and stats["fill_ratio"] == 1.0
    assert all(len(mb) == 4 for r in range(4) for mb in sched.step_microbatches(r, 0))
    check_invariants(sched, lengths, dp=4, cap=4000)


def test_skewed_lengths_balanced_at_lower_bound():
    rng = np.random.default_rng(7)
    lengths = (rng.integers(100, 1500, 512) + np.minimum(rng.lognormal(7, 1, 512), 16000)).astype(int).tolist()
    sched = build_dp_schedule(lengths, dp_size=8, max_tokens_per_gpu=32768, global_batch_size=256)
    stats = schedule_stats(sched, lengths)
    assert len(stats) == 2
    for s in stats:
        assert s["microbatches_per_rank"] == s["lower_bound_microbatches"]
        assert s["token_imbalance"] <= 1.01
    check_invariants(sched, lengths, dp=8, gbs=256, cap=32768)


def test_oversized_sample_is_alone_and_counts_once_in_the_bound():
    lengths = [50_000] + [1000] * 47
    sched = build_dp_schedule(lengths, dp_size=4, max_tokens_per_gpu=16_000)
    mbs = [mb for r in range(4) for mb in sched.step_microbatches(r, 0)]
    assert [0] in mbs
    # 1 micro-batch for the oversized sample + ceil(47000 / 16000) = 4 -> aligned to 4 ranks: 4 total, 1 per rank
    assert lower_bound_microbatches(np.array(lengths), dp_size=4, token_cap=16_000) == 4
    assert sched.num_microbatches == [1]
    check_invariants(sched, lengths, dp=4, cap=16_000)


def test_virtual_pipeline_multiple():
    lengths = [700 + 13 * i for i in range(200)]
    sched = build_dp_schedule(lengths, dp_size=4, max_tokens_per_gpu=8192, microbatch_multiple=3)
    (stats,) = schedule_stats(sched, lengths)
    assert sched.num_microbatches[0] % 3 == 0
    assert stats["microbatches_per_rank"] == stats["lower_bound_microbatches"]
    assert stats["token_imbalance"] <= 1.01
    check_invariants(sched, lengths, dp=4, cap=8192, mult=3)


def test_multi_sample_groups_stay_in_one_step_and_trailing_groups_are_leftover():
    # 7 groups of 3 samples, interleaved (non-contiguous): a, b, a, c, b, ...
    group_ids = [g for _ in range(3) for g in "abcdefg"]
    lengths = [100 * (i + 1) for i in range(21)]
    sched = build_dp_schedule(lengths, dp_size=2, global_batch_size=3, group_ids=group_ids, max_tokens_per_gpu=2000)
    assert sched.global_batch_sizes == [9, 9]
    assert sorted(sched.step_samples(0)) == sorted(i for i, g in enumerate(group_ids) if g in "abc")
    assert sorted(sched.step_samples(1)) == sorted(i for i, g in enumerate(group_ids) if g in "def")
    assert sched.leftover == [i for i, g in enumerate(group_ids) if g == "g"]
    check_invariants(sched, lengths, dp=2, group_ids=group_ids, gbs=3, cap=2000)


def test_leftover_and_all_groups_in_one_step():
    lengths = [10] * 10
    sched = build_dp_schedule(lengths, dp_size=2, global_batch_size=4, micro_batch_size=2)
    assert sched.global_batch_sizes == [4, 4] and sched.leftover == [8, 9]
    whole = build_dp_schedule(lengths, dp_size=2, micro_batch_size=2)
    assert whole.global_batch_sizes == [10] and whole.leftover == []
    too_few = build_dp_schedule(lengths, dp_size=2, global_batch_size=11, micro_batch_size=2)
    assert too_few.num_steps == 0 and too_few.leftover == list(range(10))


def test_static_mode_that_cannot_be_aligned_is_a_clear_error():
    # 6 samples of at most 1 per micro-batch: 6 micro-batches, aligned to dp 4 -> 8 > 6 samples
    with pytest.raises(ValueError, match=r"^micro_batch_size: .*cannot be aligned.*\(step 0\)"):
        build_dp_schedule([5] * 6, dp_size=4, micro_batch_size=1)
    ok = build_dp_schedule([5] * 8, dp_size=4, micro_batch_size=1)
    assert ok.num_microbatches == [2]


def test_static_mode_balances_cost_within_size():
    lengths = [100, 200, 300, 400, 500, 600, 700, 800] * 4
    sched = build_dp_schedule(lengths, dp_size=4, micro_batch_size=3)
    (stats,) = schedule_stats(sched, lengths)
    assert stats["token_imbalance"] == 1.0
    check_invariants(sched, lengths, dp=4, mbs=3)


def test_step_shorter_than_dp_is_an_error():
    with pytest.raises(ValueError, match=r"^global_batch_size: step 0 has 3 samples, fewer than dp_size=4"):
        build_dp_schedule([1] * 12, dp_size=4, global_batch_size=3, max_tokens_per_gpu=10)
    with pytest.raises(ValueError, match=r"^lengths: step 0 has 3 samples"):
        build_dp_schedule([1] * 3, dp_size=4, max_tokens_per_gpu=10)


def test_empty_microbatches_only_when_unavoidable():
    # 3 samples close to the cap need 3 micro-batches; dp 2 × multiple 2 aligns that to 4: one must be empty
    lengths = [900, 950, 990]
    sched = build_dp_schedule(lengths, dp_size=2, max_tokens_per_gpu=1000, microbatch_multiple=2)
    assert sched.num_microbatches == [2]
    per_rank = [sched.step_microbatches(r, 0) for r in range(2)]
    assert sum(1 for rank in per_rank for mb in rank if not mb) == 1
    assert all(any(rank) for rank in per_rank)
    (stats,) = schedule_stats(sched, lengths)
    assert stats["empty_microbatches"] == 1
    check_invariants(sched, lengths, dp=2, cap=1000, mult=2)


def test_no_samples_gives_no_steps():
    sched = build_dp_schedule([], dp_size=3, max_tokens_per_gpu=100)
    assert sched.num_steps == 0 and sched.partitions == [[], [], []] and sched.leftover == []


def test_flops_cost_balances_attention_heavy_steps_better():
    rng = np.random.default_rng(3)
    lengths = np.concatenate([rng.integers(100, 600, 240), rng.integers(20000, 30000, 16)]).tolist()
    by_tokens = schedule_stats(build_dp_schedule(lengths, dp_size=8, max_tokens_per_gpu=65536), lengths)[0]
    by_flops = schedule_stats(build_dp_schedule(lengths, dp_size=8, max_tokens_per_gpu=65536, cost="flops"),
                              lengths, cost="flops")[0]
    assert by_flops["flops_imbalance"] < by_tokens["flops_imbalance"]
    assert by_flops["imbalance"] == by_flops["flops_imbalance"]


def test_deterministic_and_accepts_numpy():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 4000, 300)
    a = build_dp_schedule(lengths, dp_size=4, max_tokens_per_gpu=9000, group_ids=np.repeat(np.arange(60), 5),
                          global_batch_size=16)
    b = build_dp_schedule(lengths.tolist(), dp_size=4, max_tokens_per_gpu=9000,
                          group_ids=[i // 5 for i in range(300)], global_batch_size=16)
    assert a == b
    assert json.dumps(a.to_dict())  # plain ints


def test_step_loss_tokens_and_helpers():
    lengths = [10, 20, 30, 40, 50, 60]
    sched = build_dp_schedule(lengths, dp_size=2, global_batch_size=2, micro_batch_size=1)
    assert sched.num_steps == 3 and sched.dp_size == 2
    loss_tokens = [1, 2, 3, 4, 5, 6]
    assert sched.step_loss_tokens(loss_tokens) == [3, 7, 11]
    assert sorted(sched.step_samples(1)) == [2, 3]
    assert sorted(i for r in range(2) for mb in sched.step_microbatches(r, 2) for i in mb) == [4, 5]
    with pytest.raises(ValueError, match="^loss_token_counts"):
        sched.step_loss_tokens([1, 2])
    with pytest.raises(IndexError):
        sched.step_microbatches(2, 0)
    with pytest.raises(IndexError):
        sched.step_samples(3)


def test_stats_numbers():
    lengths = [300, 300, 200, 200]
    sched = build_dp_schedule(lengths, dp_size=2, max_tokens_per_gpu=500)
    (s,) = schedule_stats(sched, lengths)
    assert s["global_batch_size"] == 4 and s["microbatches_per_rank"] == 1 and s["lower_bound_microbatches"] == 1
    assert s["max_rank_tokens"] == 500 and s["mean_rank_tokens"] == 500 and s["token_imbalance"] == 1.0
    assert s["fill_ratio"] == 1.0 and s["tokens"] == 1000
    # a cap passed explicitly overrides the schedule's own
    assert schedule_stats(sched, lengths, max_tokens_per_gpu=1000)[0]["fill_ratio"] == 0.5


def test_from_dict_rejects_a_broken_schedule():
    sched = build_dp_schedule([5] * 8, dp_size=2, micro_batch_size=2)
    data = sched.to_dict()
    data["global_batch_sizes"] = [7]
    with pytest.raises(ValueError, match="^schedule: step 0 holds 8 samples"):
        DPSchedule.from_dict(data)
    data = sched.to_dict()
    data["micro_batch_indices"][0] = data["micro_batch_indices"][0][:-1]
    with pytest.raises(ValueError, match="^schedule: rank 0"):
        DPSchedule.from_dict(data)
    with pytest.raises(ValueError, match="^schedule: malformed"):
        DPSchedule.from_dict({"partitions": []})


@pytest.mark.parametrize(
    ("lengths", "kwargs", "name"),
    [
        ([0, 5], {}, "lengths"),
        ([-3, 5], {}, "lengths"),
        ([1.5, 2], {}, "lengths"),
        ([[1, 2]], {}, "lengths"),
        (["a"], {}, "lengths"),
        ([5, 5], {"dp_size": 0}, "dp_size"),
        ([5, 5], {"dp_size": True}, "dp_size"),
        ([5, 5], {"dp_size": 2.0}, "dp_size"),
        ([5, 5], {"micro_batch_size": 2}, "max_tokens_per_gpu"),  # both modes
        ([5, 5], {"max_tokens_per_gpu": None}, "max_tokens_per_gpu"),  # neither mode
        ([5, 5], {"max_tokens_per_gpu": 0}, "max_tokens_per_gpu"),
        ([5, 5], {"group_ids": [1]}, "group_ids"),
        ([5, 5], {"group_ids": [[1], [2]]}, "group_ids"),
        ([5, 5], {"global_batch_size": 0}, "global_batch_size"),
        ([5, 5], {"microbatch_multiple": 0}, "microbatch_multiple"),
        ([5, 5], {"cost": "seconds"}, "cost"),
    ],
)
def test_bad_arguments_name_the_argument(lengths, kwargs, name):
    args = {"dp_size": 1, "max_tokens_per_gpu": 100} | kwargs
    with pytest.raises(ValueError, match=f"^{name}: "):
        build_dp_schedule(lengths, **args)


# ------------------------------------------------------------------------------- faster code, the same schedules


@contextmanager
def reference_scheduler():
    """The scheduler with its LPT heap and its refinement as they were before they were made faster (issue 19)."""
    def lpt_tokens(tok, order, item_bin, btok, first_bin, n_bins, token_cap):
        return reference_pack_lpt(tok, [float(t) for t in tok], order, item_bin, btok, first_bin, n_bins, token_cap,
                                  math.inf, True)

    def lpt(tok, cost, order, item_bin, btok, first_bin, n_bins, token_cap, count_cap):
        return reference_pack_lpt(tok, cost, order, item_bin, btok, first_bin, n_bins, token_cap, count_cap, False)

    with (mock.patch.object(packing, "_Refiner", ReferenceRefiner),
          mock.patch.object(packing, "_pack_lpt_tokens", lpt_tokens),
          mock.patch.object(packing, "_pack_lpt", lpt)):
        yield


def schedule_or_error(**kwargs):
    try:
        return build_dp_schedule(**kwargs)
    except ValueError as exc:
        return f"ValueError: {exc}"


def assert_same_as_reference(**kwargs):
    with reference_scheduler():
        expected = schedule_or_error(**kwargs)
    assert isinstance(expected, (DPSchedule, str))
    assert schedule_or_error(**kwargs) == expected


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_same_schedule_as_the_reference_implementation(p):
    assert_same_as_reference(lengths=p["lengths"], dp_size=p["dp"], global_batch_size=p["gbs"],
                             group_ids=p["group_ids"], max_tokens_per_gpu=p["cap"], micro_batch_size=p["mbs"],
                             microbatch_multiple=p["mult"], cost=p["cost"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from([8, 16, 64]), st.sampled_from([16_384, 32_768]),
       st.sampled_from(["tokens", "flops"]), st.integers(1, 2), st.booleans())
def test_same_schedule_as_the_reference_on_large_rl_like_steps(seed, dp, cap, cost, mult, outlier):
    """Steps of the size the benchmark times (up to 1024 samples, dp up to 64), where the refinement runs longest."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(dp, 1025))
    lengths = rng.integers(100, 1501, n) + np.minimum(rng.lognormal(7.0, 1.0, n), 16_000).astype(np.int64)
    if outlier:
        lengths[rng.integers(n)] = 2 * cap
    assert_same_as_reference(lengths=lengths, dp_size=dp, max_tokens_per_gpu=cap, microbatch_multiple=mult,
                             cost=cost, group_ids=np.arange(n) // 8)


class _RecordingRefiner(packing._Refiner):
    """The refinement, counting which of its branches each step takes."""

    seen: Counter = Counter()

    def _load_state(self):
        self.seen["refined a step"] += 1
        super()._load_state()

    def _best_change(self, A, B, xs, gap):
        op = super()._best_change(A, B, xs, gap)
        lightest = self.rank_cost.index(min(self.rank_cost))
        self.seen["the lightest partner" if B == lightest else "a later partner"] += 1
        self.seen[op[0] if op else "no change with this partner"] += 1
        return op


def test_the_reference_comparison_covers_every_branch_of_the_refinement():
    """On these steps the refinement takes each of its branches (a step already balanced, a whole micro-batch swapped,
    a sample moved, two samples swapped, a partner with no change and a later partner tried), and the schedule is
    the reference's on every one, so a wrong branch would show."""
    rng = np.random.default_rng(11)
    problems_ = []
    for dp in (2, 4, 8):
        for kind in ("dynamic", "outlier", "static"):
            lengths = rng.integers(100, 1500, 96) + np.minimum(rng.lognormal(7, 1, 96), 16_000).astype(np.int64)
            if kind == "outlier":
                lengths[5] = 40_000
            mode = {"micro_batch_size": 3} if kind == "static" else {"max_tokens_per_gpu": 16_384}
            problems_.append(dict(lengths=lengths, dp_size=dp, global_batch_size=24, group_ids=np.arange(96) // 4,
                                  **mode))
    rng = np.random.default_rng(3)
    lengths = rng.integers(100, 1500, 64) + np.minimum(rng.lognormal(7, 1, 64), 16_000).astype(np.int64)
    problems_.append(dict(lengths=lengths, dp_size=16, max_tokens_per_gpu=4096))

    _RecordingRefiner.seen = Counter()
    steps = 0
    with mock.patch.object(packing, "_Refiner", _RecordingRefiner):
        for kwargs in problems_:
            steps += build_dp_schedule(**kwargs).num_steps
    seen = _RecordingRefiner.seen
    assert steps > seen["refined a step"] > 0
    for branch in ("bins", "move", "swap", "no change with this partner", "a later partner"):
        assert seen[branch] > 0, branch
    for kwargs in problems_:
        assert_same_as_reference(**kwargs)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 9000), max_size=200), st.integers(1, 40), st.integers(0, 45),
       st.integers(1000, 20_000))
def test_token_lpt_places_like_the_general_lpt(lengths, n_bins, first_bin, cap):
    """The int-keyed LPT heap for the token cost gives the general LPT's placement, its bin tokens and its stop."""
    tok = [min(t, cap) for t in lengths]
    order = sorted(range(len(tok)), key=lambda i: -tok[i])
    first_bin = min(first_bin, n_bins)
    got_bins, want_bins = [-1] * len(tok), [-1] * len(tok)
    got_tok, want_tok = [0] * n_bins, [0] * n_bins
    want = packing._pack_lpt(tok, [float(t) for t in tok], order, want_bins, want_tok, first_bin, n_bins, cap,
                             math.inf)
    got = packing._pack_lpt_tokens(tok, order, got_bins, got_tok, first_bin, n_bins, cap)
    event("stopped early" if want < len(order) else "placed all")
    assert (got, got_bins, got_tok) == (want, want_bins, want_tok)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 6000), min_size=8, max_size=300), st.sampled_from([1, 2, 4, 8]),
       st.integers(2000, 20_000), st.integers(1, 3))
def test_microbatches_run_largest_first_with_samples_in_index_order(lengths, dp, cap, mult):
    sched = build_dp_schedule(lengths, dp_size=dp, max_tokens_per_gpu=cap, microbatch_multiple=mult)
    for r in range(dp):
        mbs = sched.step_microbatches(r, 0)
        tokens = [sum(lengths[i] for i in mb) for mb in mbs]
        assert tokens == sorted(tokens, reverse=True)
        assert all(mb == sorted(mb) for mb in mbs)
