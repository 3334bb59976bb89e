"""The rollout stream re-created after the store lost its data (a real redis-server restarted without persistence):
the trainers' resume point, the rollout's fast-forward, and rollouts published exactly as an uninterrupted run
publishes them. In-process rollout, simulated trainers (the end-to-end version with Megatron trainers is in
test_reliability_e2e.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.test_store import assert_payload_equal
from trainingrun.api import parse_trainingrun
from trainingrun.contract.rollout_state import ROLLOUT_STATE_KEY
from trainingrun.rollout.loop import run_rollout
from trainingrun.contract.resume import ResumePoint
from trainingrun.store import StoreDataLost, open_store

ROOT = Path(__file__).resolve().parents[2]
NUM_ROLLOUTS = 8


def spec():
    doc = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    doc["spec"]["rollout"]["numRollouts"] = NUM_ROLLOUTS
    doc["spec"]["rollout"]["samplesPerRollout"] = 32
    doc["spec"]["rollout"]["maxPendingRollouts"] = 2
    return parse_trainingrun(doc)


def quiet(_msg: str) -> None:
    pass


class FakeTrainers:
    """Consume rollouts from `start` like the trainer ranks do (read, ack every rank, release), recording them."""

    def __init__(self, url: str, attempt: int, start: int, stop_after: int | None = None):
        self.store = open_store(url, attempt=attempt)
        self.start, self.stop_after = start, stop_after
        self.seen: dict[int, tuple[dict, dict]] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            k = self.start
            while self.stop_after is None or k < self.stop_after:
                if not self.store.wait_rollout(k, timeout=60):
                    return
                schedule = self.store.read_schedule(k)
                dp = schedule["dp_size"]
                self.seen[k] = (schedule, {r: self.store.read_payload(k, r) for r in range(dp)})
                for r in range(dp):
                    self.store.ack(k, r)
                self.store.release_upto(k + 1)
                k += 1
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            self.error = exc


def reference(url: str) -> dict[int, tuple[dict, dict]]:
    trainers = FakeTrainers(url, attempt=0, start=0)
    trainers.thread.start()
    store = open_store(url, attempt=0)
    store.claim_writer()
    run_rollout(spec(), store, progress=quiet, poll_interval=0.01)
    trainers.thread.join(60)
    assert trainers.error is None and sorted(trainers.seen) == list(range(NUM_ROLLOUTS))
    return trainers.seen


@pytest.mark.parametrize("point_first", [True, False], ids=["resume-point-first", "rollout-first"])
def test_rollout_recreates_the_stream_after_redis_lost_it(redis, tmp_path, point_first):
    ref = reference(f"file://{tmp_path}/ref")
    url = redis.url + "?retry_seconds=20"
    # attempt 0: trainers consume rollouts 0..3 (their "checkpoint" is at rollout 4), then Redis restarts empty
    trainers = FakeTrainers(url, attempt=0, start=0, stop_after=4)
    trainers.thread.start()
    writer = open_store(url, attempt=0)
    writer.claim_writer()
    failure: dict = {}
    rollout = threading.Thread(target=lambda: failure.update(
        error=_catch(lambda: run_rollout(spec(), writer, progress=quiet, poll_interval=0.01))), daemon=True)
    rollout.start()
    trainers.thread.join(60)
    assert trainers.error is None and sorted(trainers.seen) == [0, 1, 2, 3]
    deadline = time.monotonic() + 30
    while not writer.is_committed(5) and time.monotonic() < deadline:  # the rollout runs ahead, then waits
        time.sleep(0.01)
    redis.restart()
    rollout.join(30)
    assert isinstance(failure.get("error"), StoreDataLost), failure  # the rollout fails instead of hanging
    # attempt 1: the trainers resume at rollout 4; the rollout's state is gone with the rest of the store
    point = ResumePoint(rollout=4, step_in_rollout=0, global_step=ref[4][0]["step_offset"],
                        samples_consumed=ref[4][0]["samples_offset"], attempt=1)
    trainers = FakeTrainers(url, attempt=1, start=4)
    messages: list[str] = []
    store = open_store(url, attempt=1)
    store.claim_writer()
    if point_first:
        point.write(trainers.store)
    result: dict = {}
    rollout = threading.Thread(target=lambda: result.update(r=run_rollout(
        spec(), store, progress=messages.append, poll_interval=0.01)), daemon=True)
    rollout.start()
    if not point_first:  # the rollout starts first and publishes rollouts 0, 1 that nobody will read
        deadline = time.monotonic() + 30
        while not store.is_committed(1) and time.monotonic() < deadline:
            time.sleep(0.01)
        point.write(trainers.store)
    trainers.thread.start()
    rollout.join(60)
    trainers.thread.join(60)
    assert trainers.error is None, trainers.error
    assert sorted(trainers.seen) == list(range(4, NUM_ROLLOUTS))
    for k in range(4, NUM_ROLLOUTS):  # published exactly as the uninterrupted run published them
        assert trainers.seen[k][0] == ref[k][0], k
        for r, payload in ref[k][1].items():
            assert_payload_equal(trainers.seen[k][1][r], payload)
    assert any("the store lost data" in m and "re-creating the state up to rollout 4" in m for m in messages)
    if not point_first:  # what it had published below the trainers' resume point was acknowledged and released
        assert any("released rollouts 0..1 nobody will read" in m for m in messages), messages
    assert result["r"].rollouts == NUM_ROLLOUTS
    state = store.get_json(ROLLOUT_STATE_KEY)
    ref_state = open_store(f"file://{tmp_path}/ref").get_json(ROLLOUT_STATE_KEY)
    assert {k: v for k, v in state.items() if k != "updated_at"} == {
        k: v for k, v in ref_state.items() if k != "updated_at"}


def _catch(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - returned to the test
        return exc
    return None


def test_a_resume_point_not_ahead_of_the_stream_changes_nothing(tmp_path):
    url = f"file://{tmp_path}/s"
    ResumePoint(rollout=0, step_in_rollout=0, global_step=0, samples_consumed=0, attempt=0).write(open_store(url))
    ref = reference(f"file://{tmp_path}/ref")
    got = reference(url)
    assert all(got[k][0] == ref[k][0] for k in ref)


def test_a_checkpoint_that_does_not_match_the_data_is_a_config_error(tmp_path):
    from trainingrun.contract.errors import ConfigError

    url = f"file://{tmp_path}/s"
    store = open_store(url, attempt=0)
    ResumePoint(rollout=3, step_in_rollout=0, global_step=999, samples_consumed=0, attempt=0).write(store)
    with pytest.raises(ConfigError, match="re-created rollout 3 starts at step 3, but the trainers' checkpoint is at "
                                          "step 999"):
        run_rollout(spec(), store, progress=quiet)
