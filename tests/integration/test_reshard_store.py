"""Elastic DP against the real store backends (file and a real redis-server): rollouts published for 3 ranks are read
back, re-scheduled for 2 (and 2 → 4), acknowledged in the old ranks' terms (`acked_ranks`), after which nothing is
pending and `release_upto` deletes them — so backpressure and retention keep working across a resize."""

from __future__ import annotations

import pytest

from trainingrun.contract.published import read
from trainingrun.store import open_store
from trainingrun.trainer.reshard import acked_ranks, reschedule
from tests.synthetic import publish


@pytest.mark.parametrize("backend", ["file", "redis"])
@pytest.mark.parametrize("old_dp, new_dp", [(3, 2), (2, 4)])
def test_rescheduled_rollouts_are_acked_and_released(backend, old_dp, new_dp, tmp_path, request):
    url = f"file://{tmp_path}/store" if backend == "file" else request.getfixturevalue("redis").url
    store = open_store(url)
    published = publish(store, num_rollouts=3, samples_per_rollout=[12, 8, 16], dp_size=old_dp, vocab=32, seed=4,
                        finish=True)
    assert store.pending_rollouts() == 3
    for k, pub in enumerate(published):
        got = read(store, k)
        assert got.dp_size == old_dp
        old = {r: store.read_payload(k, r) for r in range(old_dp)}
        schedule, payloads = reschedule(got.schedule, old, new_dp)
        ids = sorted(int(i) for p in payloads.values() for i in p["sample_ids"])
        assert ids == sorted(int(i) for p in old.values() for i in p["sample_ids"])
        assert schedule.global_batch_sizes == pub.schedule.global_batch_sizes
        for r in range(new_dp):  # each new rank acks its share of the old ranks
            for j in acked_ranks(old_dp, new_dp, r):
                store.ack(k, j)
        assert store.pending_rollouts() == 2 - k
    store.release_upto(3)
    assert store.wait_rollout(3, timeout=1) is False  # finished, and everything before it released
    from trainingrun.store import RolloutReleased

    with pytest.raises(RolloutReleased):
        store.wait_rollout(0, timeout=1)
