"""modeling/sync_plan.py: the streamed weight sync's plan — buckets in order, the bound, and who owns each tensor."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainingrun.api.spec.engine import WeightSyncSpec
from trainingrun.modeling import sync_plan
from trainingrun.modeling.sync_plan import Layout, assign_owners, bucket_bytes, owners, peak_bytes, plan_buckets

sizes_st = st.lists(st.integers(min_value=0, max_value=5000), max_size=60).map(
    lambda xs: [(f"t{i}", n) for i, n in enumerate(xs)])


@given(sizes=sizes_st, limit=st.integers(min_value=1, max_value=4000))
def test_every_tensor_in_exactly_one_bucket_in_order(sizes, limit):
    buckets = plan_buckets(sizes, limit)
    flat = [n for b in buckets for n in b.names]
    assert flat == [n for n, _ in sizes]
    assert all(b.names for b in buckets)


@given(sizes=sizes_st, limit=st.integers(min_value=1, max_value=4000))
def test_bucket_bound_except_a_single_oversized_tensor(sizes, limit):
    size_of = dict(sizes)
    for b in plan_buckets(sizes, limit):
        assert b.nbytes == sum(size_of[n] for n in b.names)
        if b.nbytes > limit:
            assert len(b.names) == 1
    assert sum(b.nbytes for b in plan_buckets(sizes, limit)) == sum(size_of.values())


@given(sizes=sizes_st, limit=st.integers(min_value=1, max_value=4000))
def test_greedy_buckets_are_not_closed_early(sizes, limit):
    buckets = plan_buckets(sizes, limit)
    size_of = dict(sizes)
    for b, nxt in zip(buckets, buckets[1:]):
        assert b.nbytes + size_of[nxt.names[0]] > limit


@given(sizes=sizes_st, limit=st.integers(min_value=1, max_value=4000))
def test_peak_is_at_most_two_buckets(sizes, limit):
    buckets = plan_buckets(sizes, limit)
    biggest = max([n for _, n in sizes], default=0)
    assert peak_bytes(buckets) <= 2 * max(limit, biggest)


def test_repeated_name_and_bad_limit_raise():
    with pytest.raises(ValueError, match="twice"):
        plan_buckets([("a", 1), ("a", 2)], 10)
    with pytest.raises(ValueError, match="limit"):
        plan_buckets([("a", 1)], 0)
    with pytest.raises(ValueError, match="negative"):
        plan_buckets([("a", -1)], 10)


def test_bucket_bytes_range_names_the_field():
    assert bucket_bytes() == 512 * sync_plan.MIB
    assert bucket_bytes(1) == sync_plan.MIB and bucket_bytes(16384) == 16384 * sync_plan.MIB
    for bad in (0, 16385, 2.5, True):
        with pytest.raises(ValueError, match="weightSync.bucketMiB"):
            bucket_bytes(bad)


def test_spec_field_has_the_same_range():
    assert WeightSyncSpec().bucket_mib == sync_plan.DEFAULT_BUCKET_MIB
    assert WeightSyncSpec(bucketMiB=16384).bucket_mib == 16384
    for bad in (0, 16385):
        with pytest.raises(ValueError, match="bucketMiB"):
            WeightSyncSpec(bucketMiB=bad)


@given(tp=st.integers(1, 8), pp=st.integers(1, 8), ep=st.integers(1, 8), data=st.data())
def test_owners_are_the_stage_ranks_that_hold_parts(tp, pp, ep, data):
    layout = Layout(tp=tp, pp=pp, ep=ep)
    stage = data.draw(st.integers(0, pp - 1))
    assert owners(stage, "tp", layout) == tuple((stage, t, 0) for t in range(tp))
    assert owners(stage, "ep", layout) == tuple((stage, 0, e) for e in range(ep))
    assert owners(stage, None, layout) == ((stage, 0, 0),)
    with pytest.raises(ValueError, match="stage"):
        owners(pp, None, layout)


def test_owners_bad_split_and_layout():
    with pytest.raises(ValueError, match="split"):
        owners(0, "dp", Layout())
    with pytest.raises(ValueError, match="tp"):
        Layout(tp=0)


@pytest.mark.parametrize("owners", [1, 2, 3, 4])
def test_sharded_owners_are_balanced_by_bytes_and_the_same_everywhere(owners):
    rng = random.Random(owners)
    sizes = [rng.choice([1, 5, 56, 28, 32]) * 1000 for _ in range(40)]
    got = assign_owners(sizes, owners)
    assert got == assign_owners(list(sizes), owners)  # deterministic: every rank computes the same
    assert set(got) == set(range(owners))
    held = [sum(s for s, g in zip(sizes, got) if g == o) for o in range(owners)]
    assert max(held) <= sum(sizes) / owners + max(sizes)
    # bucket k mod owners (the first cut) is not balanced on a plan whose large buckets fall on one owner
    alternating = [56_000, 1_000] * 10
    held_mod = [sum(s for k, s in enumerate(alternating) if k % 2 == o) for o in range(2)]
    held_bal = [sum(s for s, g in zip(alternating, assign_owners(alternating, 2)) if g == o) for o in range(2)]
    assert max(held_mod) - min(held_mod) == 550_000 and max(held_bal) - min(held_bal) <= 56_000
    with pytest.raises(ValueError, match="owners"):
        assign_owners(sizes, 0)
