"""The Store protocol: the only channel between the rollout and the trainers.

Contract between `trainingrun.rollout` (writer) and `trainingrun.trainer` (readers); backends in this package
(`file://`, `redis://`) implement it. Open one with `trainingrun.store.open_store(url)`. The protocol has three
parts: the rollout stream (`RolloutStream`), weight versions (`WeightVersions`) and key/value (`KeyValue`); `Store`
is all three.

A rollout k is published as: per-rank payloads, then the schedule (JSON), then a commit marker. Readers only ever see
committed rollouts. Payloads are numpy arrays (never pickled); schedules and metadata are JSON.

Rank payloads: `trainingrun.contract.payload` (the fields and dtypes of a `RankPayload`). Errors: `StoreError` and
`CorruptPayload` are `trainingrun.contract.errors` (the contract's records raise them too); the others are below.

Schedule (JSON dict) of rollout k: the document `trainingrun.contract.published.PublishedRollout` writes and reads
(rollout, dp_size, schedule: DPSchedule.to_dict(), global_batch_sizes, loss_tokens per step, step_offset,
samples_offset, ...). The store only checks `rollout` and `dp_size`; nothing else reads the document by its keys.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from trainingrun.contract.errors import StoreError
from trainingrun.contract.payload import RankPayload


class StoreTimeout(StoreError):
    """Waited longer than the timeout for a rollout or key."""


class RolloutReleased(StoreError):
    """A reader asked for a rollout that was already deleted (acked by every rank and covered by a checkpoint):
    the store holds a run that is further along than this reader (e.g. a store reused by a fresh run)."""


class StoreDataLost(StoreError):
    """The store lost data this process had seen: its epoch (an identity written once, when the store is first
    used) vanished or changed, or a committed rollout's parts are gone. A Redis server restarted without
    persistence, keys evicted under memory pressure, or a wiped directory. The message says how to recover."""


class StaleAttempt(StoreError):
    """A write from an attempt older than the store's current attempt: a process of a run that has since been
    restarted (a zombie on a lost node) is fenced off. `attempt` is the writer's, `current` the store's."""

    def __init__(self, message: str, *, attempt: int, current: int):
        super().__init__(message)
        self.attempt = attempt
        self.current = current


class WriterConflict(StoreError):
    """Another live rollout writer of the same attempt holds the store's writer claim; `owner` describes it."""

    def __init__(self, message: str, *, owner: dict[str, Any]):
        super().__init__(message)
        self.owner = owner


class IncompleteWeights(StoreError):
    """A weight version written in parts (`WeightVersions.commit_weights`) was not committed: one of its owners
    failed, wrote no record or lacks a part it recorded. `owner` is that owner; the version's parts of this attempt
    are removed."""

    def __init__(self, message: str, *, owner: int):
        super().__init__(message)
        self.owner = owner


class Handle(Protocol):
    """What every store handle has: its URL, its attempt, fencing and `close()`."""

    url: str
    attempt: int | None  # the attempt this handle writes for (None: unfenced, e.g. tools and tests)

    def enter_attempt(self) -> int:
        """Raise the store's current attempt to this handle's (StaleAttempt if it is already newer); returns it."""

    def close(self) -> None:
        """Release the writer claim (if held) and the connection."""


class KeyValue(Handle, Protocol):
    """Shared state between processes (trainer rank 0 writes progress and its resume point, the rollout its state;
    the operator and the launcher read): JSON objects under short keys. The operator's progress reader needs only
    this."""

    def put_json(self, key: str, value: dict[str, Any]) -> None: ...

    def get_json(self, key: str) -> dict[str, Any] | None: ...


class RolloutStream(Handle, Protocol):
    """The stream of rollouts: one writer (the rollout, holding the writer claim) publishes, the trainers read,
    acknowledge and release."""

    # --- the single writer
    def claim_writer(self) -> dict[str, Any]:
        """Claim the store for this handle as its one rollout writer (returns the owner record): a newer attempt
        takes over from an older one; a live writer of the same attempt is refused at once (WriterConflict naming
        it); an older attempt is StaleAttempt. Released by `close()`."""

    # --- writer (rollout)
    def publish_rollout(self, rollout: int, payloads: dict[int, RankPayload], schedule: dict[str, Any]) -> bool:
        """Atomically publish rollout `rollout`; False (nothing written) when it is already committed."""

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


class WeightVersions(Handle, Protocol):
    """Weight versions (trainer ranks write, fenced by their attempt, without the writer claim; the rollout's engine
    reads; `spec.weightSync.type: store`). A version is either one blob (`publish_weights`: the vLLM syncs' commit
    records) or parts written by several owners and committed by one (`begin_weights`, `write_weights_part`,
    `write_weights_owner`, `commit_weights`: the store sync); `read_weights` reads both, whole."""

    def publish_weights(self, version: int, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> bool:
        """Atomically publish weight version `version` (named numeric arrays + JSON meta); visible only when
        complete. False (nothing written) when that version is already committed."""

    def latest_weights(self) -> int | None:
        """The newest committed weight version, or None."""

    def read_weights(self, version: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(arrays, meta) of a committed version, a version in parts assembled (every part's arrays, the owners'
        meta joined); StoreError when it is not (or no longer) there."""

    def release_weights_below(self, version: int) -> None:
        """Delete committed versions < `version` (commit marker first: a reader never sees half a version), their
        parts with them, and the parts of versions < `version` that were never committed."""

    # --- a version in parts: each owner (a trainer rank) writes its own, one rank commits (`engines/store_sync.py`)
    def begin_weights(self, version: int) -> bool:
        """Before the owners write `version`'s parts: False when it is committed already (nothing to write); else
        True, this attempt's leftovers of it (parts of a publish that never committed) removed."""

    def write_weights_part(self, version: int, owner: int, index: int, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        """Store part `index` of `owner` (named arrays, the wire format) under this attempt, invisible until the
        commit; returns its descriptor (name, bytes, pieces) for the owner's record."""

    def write_weights_owner(self, version: int, owner: int, *, parts: list[dict[str, Any]] | None = None,
                            meta: dict[str, Any] | None = None, error: str | None = None) -> None:
        """`owner`'s record of `version`, written once its parts are: their descriptors and a JSON `meta` of its own
        (joined into the version's meta), or the `error` that stopped it."""

    def commit_weights(self, version: int, owners: int, meta: dict[str, Any]) -> bool:
        """Commit `version` from the records of owners 0 … owners − 1 (every part each names checked to be stored,
        with its size): the parts index and the meta, then the commit marker. IncompleteWeights naming the owner
        (and nothing committed, this attempt's parts of `version` removed) when one failed, wrote no record or
        lacks a part; False (nothing written) when the version is committed already. `read_weights` assembles it."""


class Store(RolloutStream, WeightVersions, KeyValue, Protocol):
    """A whole store, as `open_store(url)` returns it: the rollout stream, weight versions and key/value. Code that
    uses one part types its argument with that part."""
