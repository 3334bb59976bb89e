"""trainingrun.store: the shared store between the rollout (writer) and the trainers (readers).

`open_store(url)` picks the backend by URL scheme: `file:///abs/path` (or `file://relative/path`, resolved against the
current directory) and `redis://host:port/db`. Protocol and wire contract: `trainingrun.store.base`; layout,
atomicity and retention: docs/store.md.
"""

from __future__ import annotations

from trainingrun.store.base import (
    PAYLOAD_FIELDS,
    CorruptPayload,
    RankPayload,
    RolloutReleased,
    Store,
    StoreError,
    StoreTimeout,
)

__all__ = [
    "PAYLOAD_FIELDS",
    "CorruptPayload",
    "RankPayload",
    "RolloutReleased",
    "Store",
    "StoreError",
    "StoreTimeout",
    "open_store",
]


def open_store(url: str) -> Store:
    """A Store for `url`; ValueError naming the URL for an unknown scheme or a malformed URL."""
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"store url: expected file:///path or redis://host:port/db, got {url!r}")
    scheme = url.split("://", 1)[0].lower()
    if scheme == "file":
        from trainingrun.store.file import FileStore

        return FileStore.from_url(url)
    if scheme == "redis":
        from trainingrun.store.redis import RedisStore

        return RedisStore.from_url(url)
    raise ValueError(f"store url: unsupported scheme {scheme!r} in {url!r}; allowed: file://, redis://")
