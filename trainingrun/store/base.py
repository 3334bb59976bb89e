"""The Store protocol: the only channel between the rollout and the trainers.

Contract between `trainingrun.rollout` (writer) and `trainingrun.trainer` (readers); backends in this package
(`file://`, `redis://`) implement it. Open one with `trainingrun.store.open_store(url)`.

A rollout k is published as: per-rank payloads, then the schedule (JSON), then a commit marker. Readers only ever see
committed rollouts. Payloads are numpy arrays (never pickled); schedules and metadata are JSON.

RankPayload (rank r's part of rollout k; arrays in `partitions[r]` order, i.e. the rank's samples in micro-batch
order, flat over the rollout's steps):
  tokens      int32   [total tokens]   all samples' tokens, concatenated
  offsets     int64   [n + 1]          sample i is tokens[offsets[i]:offsets[i+1]]
  loss_mask   uint8   [total tokens]   1 where the token's prediction is trained (target positions)
  advantages  float32 [n]              per-sample advantage (policy_gradient) or reward
  rewards     float32 [n]              per-sample raw reward
  sample_ids  int64   [n]              global sample ids (rollout-unique), for exactly-once checks

Schedule (JSON dict) of rollout k: the document `trainingrun.rollout.published.PublishedRollout` writes and reads
(rollout, dp_size, schedule: DPSchedule.to_dict(), global_batch_sizes, loss_tokens per step, step_offset,
samples_offset, ...). The store only checks `rollout` and `dp_size`; nothing else reads the document by its keys.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

PAYLOAD_FIELDS: dict[str, np.dtype] = {
    "tokens": np.dtype(np.int32),
    "offsets": np.dtype(np.int64),
    "loss_mask": np.dtype(np.uint8),
    "advantages": np.dtype(np.float32),
    "rewards": np.dtype(np.float32),
    "sample_ids": np.dtype(np.int64),
}

RankPayload = dict[str, np.ndarray]


class StoreError(RuntimeError):
    """A store operation failed permanently; the message names the store URL and key."""


class StoreTimeout(StoreError):
    """Waited longer than the timeout for a rollout or key."""


class RolloutReleased(StoreError):
    """A reader asked for a rollout that was already deleted (acked by every rank and covered by a checkpoint):
    the store holds a run that is further along than this reader (e.g. a store reused by a fresh run)."""


class CorruptPayload(StoreError):
    """Stored bytes do not decode as the expected wire format."""


class Store(Protocol):
    url: str

    # --- writer (rollout)
    def publish_rollout(self, rollout: int, payloads: dict[int, RankPayload], schedule: dict[str, Any]) -> None:
        """Atomically publish rollout `rollout`; idempotent for a re-publish of the same rollout."""

    def finish(self, num_rollouts: int) -> None:
        """Mark the end of the stream: no rollout >= num_rollouts will ever be published."""

    def pending_rollouts(self) -> int:
        """Committed rollouts not yet acknowledged by every rank."""

    # --- readers (trainers)
    def wait_rollout(self, rollout: int, timeout: float | None = None) -> bool:
        """Block until rollout is committed (True) or the stream finished before it (False); StoreTimeout on timeout."""

    def read_schedule(self, rollout: int) -> dict[str, Any]: ...

    def read_payload(self, rollout: int, rank: int) -> RankPayload:
        """Rank `rank`'s part only; the other ranks' payloads are not read."""

    def ack(self, rollout: int, rank: int) -> None:
        """Rank `rank` consumed `rollout`."""

    def release_upto(self, rollout: int) -> None:
        """A checkpoint covers every rollout < `rollout`: those acknowledged by all ranks may be deleted."""

    # --- progress / state shared between processes (rank 0 writes, operator and launcher read)
    def put_json(self, key: str, value: dict[str, Any]) -> None: ...

    def get_json(self, key: str) -> dict[str, Any] | None: ...

    def close(self) -> None: ...
