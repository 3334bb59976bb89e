"""Live progress: trainer rank 0 writes it to the run's store, the operator reads it into the TrainingRun status.

Contract (key `PROGRESS_KEY` via `Store.put_json`, written by trainer rank 0 after every optimizer step):
  {"step": int,                    optimizer steps completed (global)
   "samples_consumed": int,        samples trained on so far
   "last_global_batch_size": int,  samples in the last step
   "rollout": int,                 rollout being trained
   "attempt": int,                 TRAININGRUN_ATTEMPT of the writer
   "time": float}                  unix time of the write (hang detection: progressDeadlineSeconds)
camelCase keys (samplesConsumed, lastGlobalBatchSize) are accepted too.

Why through the store: trainer pods then need no Kubernetes API permission at all (no service account token is
mounted), and the operator needs no pod exec/log/proxy permission. Only redis:// stores (an external URL or the
managed store) can be read by the operator; a file:// store lives inside the pods and is refused by the operator
(`render.cluster_errors`), so in a cluster progress always flows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

PROGRESS_KEY = "progress"
log = logging.getLogger(__name__)


class ProgressReader:
    """Reads the progress key of each run's store (one open store per URL, opened lazily, closed on `forget`)."""

    def __init__(self, timeout: float = 3.0, max_age: float = 2.0):
        self.timeout = timeout
        self.max_age = max_age
        self._stores: dict[str, Any] = {}
        self._cache: dict[str, tuple[float, dict[str, Any] | None]] = {}
        self._tasks: dict[str, asyncio.Task] = {}

    def peek(self, url: str, on_change: Callable[[], None] | None = None) -> dict[str, Any] | None:
        """The last progress read from `url` without waiting (a reconcile never blocks on a slow store); starts a
        background refresh when the value is older than `max_age`, and calls `on_change` when it changed."""
        cached = self._cache.get(url)
        if url.startswith("redis://") and url not in self._tasks and (
            cached is None or time.monotonic() - cached[0] >= self.max_age
        ):
            self._tasks[url] = asyncio.get_running_loop().create_task(self._refresh(url, on_change))
        return cached[1] if cached else None

    async def _refresh(self, url: str, on_change: Callable[[], None] | None) -> None:
        try:
            value = await self.read(url)
        finally:
            self._tasks.pop(url, None)
        old = self._cache.get(url)
        if value is None and old is not None:
            value = old[1]  # unreachable for now: keep the last known progress
        self._cache[url] = (time.monotonic(), value)
        if on_change is not None and (old is None or old[1] != value) and value is not None:
            on_change()

    def _read(self, url: str) -> dict[str, Any] | None:
        store = self._stores.get(url)
        if store is None:
            from trainingrun.store import open_store

            store = open_store(url)
            self._stores[url] = store
        try:
            return store.get_json(PROGRESS_KEY)
        except Exception:
            self._stores.pop(url, None)
            try:
                store.close()
            except Exception:  # noqa: BLE001 - best effort
                pass
            raise

    async def read(self, url: str) -> dict[str, Any] | None:
        """The progress dict, or None when the store has none yet or cannot be reached (logged, not raised)."""
        if not url.startswith("redis://"):
            return None
        try:
            return await asyncio.wait_for(asyncio.to_thread(self._read, url), self.timeout)
        except Exception as exc:  # noqa: BLE001 - the store may not be up yet; status keeps the last progress
            log.debug("progress from %s not available: %s", url, exc)
            return None

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
