"""trainingrun.store: the shared store between the rollout (writer) and the trainers (readers).

`open_store(url)` picks the backend by URL scheme: `file:///abs/path` (or `file://relative/path`, resolved against the
current directory) and `redis://host:port/db`. Protocol (`Store` = `RolloutStream` + `WeightVersions` + `KeyValue`):
`trainingrun.store.base`; what travels through it (rank payloads, published rollouts, the resume point and the
progress record): `trainingrun.contract`; layout, atomicity and retention: docs/store.md.

Module map:
  base.py      the protocols (`RolloutStream`, `WeightVersions`, `KeyValue`; `Store`) and the store's error types
  common.py    the rules both backends follow, free of I/O: checks, fencing, the writer claim, the wait verdict,
               release
  parts.py     the rules of a weight version written in parts by several owners and committed by one (free of I/O)
  wire.py      JSON and the binary payload format (rank payloads, weight versions; never pickle)
  file.py      the `file://` backend: the store's layout on a volume
  file_io.py   its file primitives (atomic writes, safe reads, read-only maps)
  redis.py     the `redis://` backend: the store's keys on a Redis server
  redis_io.py  its connection, retries, pipelines and transactions, the writer claim's lease
"""

from __future__ import annotations

import errno

from trainingrun.contract.errors import EXIT_CONFIG_ERROR, CorruptPayload, StoreError
from trainingrun.store.base import (
    IncompleteWeights,
    KeyValue,
    RolloutReleased,
    RolloutStream,
    StaleAttempt,
    Store,
    StoreDataLost,
    StoreTimeout,
    WeightVersions,
    WriterConflict,
)
from trainingrun.store.file import FileStore
from trainingrun.store.redis import RedisStore

__all__ = [
    "CorruptPayload",
    "IncompleteWeights",
    "KeyValue",
    "RolloutReleased",
    "RolloutStream",
    "StaleAttempt",
    "Store",
    "StoreDataLost",
    "StoreError",
    "StoreTimeout",
    "WeightVersions",
    "WriterConflict",
    "exit_status",
    "open_store",
]


def open_store(url: str, *, attempt: int | None = None) -> Store:
    """A Store for `url`; ValueError naming the URL for an unknown scheme or a malformed URL.

    With `attempt` (a run's processes pass their TRAININGRUN_ATTEMPT, `ProcessEnv.attempt`) the handle is fenced: it
    enters the attempt at once (StaleAttempt if the store already saw a newer one) and every write it makes is
    refused once a newer attempt has used the store. Without it (tools, tests) writes are not fenced by attempt."""
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"store url: expected file:///path or redis://host:port/db, got {url!r}")
    scheme = url.split("://", 1)[0].lower()
    store: Store
    if scheme == "file":
        store = FileStore.from_url(url, attempt=attempt)
    elif scheme == "redis":
        store = RedisStore.from_url(url, attempt=attempt)
    else:
        raise ValueError(f"store url: unsupported scheme {scheme!r} in {url!r}; allowed: file://, redis://")
    if attempt is not None:
        try:
            store.enter_attempt()
        except BaseException:
            store.close()
            raise
    return store


def exit_status(exc: BaseException) -> int | None:
    """The exit status a process of the run uses when a store error ends it (None: not a store error).

    78 (EXIT_CONFIG_ERROR: the run fails at once, naming the key) for what no restart can fix: a corrupt stored
    value, a process of an older attempt (fenced off), a second rollout writer, a full or read-only volume. 1 (the
    group restarts) for the rest, notably `StoreDataLost`: the next attempt resumes from the trainers' checkpoint and
    the rollout re-creates the lost rollouts."""
    if isinstance(exc, (CorruptPayload, StaleAttempt, WriterConflict)):
        return EXIT_CONFIG_ERROR
    if isinstance(exc, StoreDataLost):
        return 1
    if isinstance(exc, StoreError):
        if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            return EXIT_CONFIG_ERROR
        return 1
    return None
