"""Live progress: trainer rank 0 writes the trainers' progress record to the run's store, the operator reads it into
the TrainingRun status.

The record and its key: `trainingrun.contract.progress.ProgressRecord` (written after every optimizer step: step,
samples consumed, last global batch size, rollout, attempt, time, ...). A malformed record is an error of the read
(`CorruptPayload` naming the field), observed like any other.

A store that cannot be read (a NetworkPolicy, a password the operator lacks, an outage) is observed as such
(`ProgressObs.error`): the status gets a ProgressUnknown condition naming the error, and hang detection
(progressDeadlineSeconds) pauses until progress can be read again.

Why through the store: trainer pods then need no Kubernetes API permission at all (no service account token is
mounted), and the operator needs no pod exec/log/proxy permission. Only redis:// stores (an external URL or the
managed store) can be read by the operator; a file:// store lives inside the pods and is refused by the operator
(`checks.cluster_errors`), so in a cluster progress always flows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from trainingrun.contract.progress import ProgressRecord
from trainingrun.operator.observe import ProgressObs
from trainingrun.store import KeyValue, open_store

log = logging.getLogger(__name__)


class ProgressReader:
    """Reads the progress record of each run's store (one open store per URL, opened lazily, closed on `forget`).

    A read that fails is an observation too: `peek` then returns the last value read with the error, and the
    status shows a ProgressUnknown condition instead of treating "cannot read" as "no progress".
    """

    def __init__(self, timeout: float = 3.0, max_age: float = 2.0):
        self.timeout = timeout
        self.max_age = max_age
        self._stores: dict[str, KeyValue] = {}  # progress is read through the key/value part of the store only
        self._cache: dict[str, tuple[float, ProgressObs]] = {}
        self._tasks: dict[str, asyncio.Task] = {}

    def peek(self, url: str, on_change: Callable[[], None] | None = None) -> ProgressObs | None:
        """The last observation of `url` without waiting (a reconcile never blocks on a slow store); starts a
        background refresh when it is older than `max_age`, and calls `on_change` when it changed. None before the
        first read finished, and for stores the operator cannot read (not redis://)."""
        cached = self._cache.get(url)
        if url.startswith("redis://") and url not in self._tasks and (
            cached is None or time.monotonic() - cached[0] >= self.max_age
        ):
            self._tasks[url] = asyncio.get_running_loop().create_task(self._refresh(url, on_change))
        return cached[1] if cached else None

    async def _refresh(self, url: str, on_change: Callable[[], None] | None) -> None:
        old = self._cache.get(url)
        try:
            value, error = await self.read(url), None
        except Exception as exc:  # noqa: BLE001 - any failure to read is reported, not raised
            value, error = (old[1].value if old else None), f"{type(exc).__name__}: {exc}"[:1000]
            log.info("progress from %s cannot be read: %s", url, error)
        finally:
            self._tasks.pop(url, None)
        obs = ProgressObs(value=value, error=error)
        self._cache[url] = (time.monotonic(), obs)
        if on_change is not None and (old is None or old[1] != obs):
            on_change()

    def _read(self, url: str) -> ProgressRecord | None:
        store = self._stores.get(url)
        if store is None:
            store = open_store(url)
            # Report an outage, don't wait it out: the store's own retries (and redis-py's) are for the pods.
            if hasattr(store, "retry_seconds"):
                store.retry_seconds = min(store.retry_seconds, self.timeout / 3)
            if hasattr(getattr(store, "client", None), "set_retry"):
                from redis.backoff import NoBackoff  # deferred: redis (only for redis:// stores)
                from redis.retry import Retry  # deferred: redis

                store.client.set_retry(Retry(NoBackoff(), 0))
            self._stores[url] = store
        try:
            return ProgressRecord.read(store)
        except Exception:
            self._stores.pop(url, None)
            try:
                store.close()
            except Exception:  # noqa: BLE001 - best effort
                pass
            raise

    async def read(self, url: str) -> ProgressRecord | None:
        """The progress record, or None when the store has none yet; raises when the store cannot be read or the
        record is malformed."""
        if not url.startswith("redis://"):
            return None
        try:
            return await asyncio.wait_for(asyncio.to_thread(self._read, url), self.timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer from the store within {self.timeout:g}s") from None

    def forget(self, url: str) -> None:
        self._cache.pop(url, None)
        task = self._tasks.pop(url, None)
        if task is not None:
            task.cancel()
        store = self._stores.pop(url, None)
        if store is not None:
            try:
                store.close()
            except Exception:  # noqa: BLE001
                pass
