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
from typing import Any

PROGRESS_KEY = "progress"
log = logging.getLogger(__name__)


class ProgressReader:
    """Reads the progress key of each run's store (one open store per URL, opened lazily, closed on `forget`)."""

    def __init__(self, timeout: float = 3.0):
        self.timeout = timeout
        self._stores: dict[str, Any] = {}

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
        store = self._stores.pop(url, None)
        if store is not None:
            try:
                store.close()
            except Exception:  # noqa: BLE001
                pass
