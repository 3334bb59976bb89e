"""Trainer rank 0's side of the `broadcast` weight sync: a TCPStore, the latest weights, and one transfer per request.

`BroadcastSender(port=...)` hosts a TCPStore that the engine's workers connect to (see `worker_ext.py` for the
protocol). `set_weights(version, named_tensors)` takes a snapshot of the weights in the engine's dtype, packed into
flat buckets per dtype (a copy, so training may go on changing the model), and keeps the newest
`keep_versions` (maxPolicyLag + 1; the oldest is let go before the next is made, so the sender never holds one more).
The tensors may come as a stream (the streamed sync's buckets): each bucket is packed as it fills. A background
thread (`start()`) or `serve_next()` serves each transfer request with the version it asks for. A transfer that
fails (engine died, timeout) is logged and dropped; the engine keeps its old weights whole and the rollout asks
again.

Backends: gloo (CPU tensors) or NCCL (tensors on this rank's GPU); the engine side uses the same.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from trainingrun.engines.vllm.worker_ext import (
    DONE_KEY,
    MANIFEST_KEY,
    PG_PREFIX,
    REQUEST_KEY,
    bucket_checksum,
    checksum_kind,
    make_group,
)

DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass
class Snapshot:
    version: int
    manifest: dict[str, Any]
    buckets: list  # flat tensors
    nbytes: int


def pack(version: int, named: Iterable[tuple[str, Any]], *, dtype: str | None, device: Any,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Snapshot:
    """Copy `named` tensors (cast to `dtype` when given; floating point only) into flat per-dtype buckets of at most
    `bucket_bytes` (a larger tensor alone). `named` is read once, in order, and each bucket is made as soon as it is
    full, so a stream of tensors (the streamed sync's buckets) costs the snapshot plus one open bucket per dtype."""
    import torch  # deferred: torch

    tensors, buckets, bucket_meta = [], [], []
    open_: dict[str, list[tuple[str, torch.Tensor]]] = {}  # dtype -> the tensors of its bucket being filled
    sizes: dict[str, int] = {}
    nbytes = 0

    def close(key: str) -> None:
        chunk = open_.pop(key)
        flat = torch.cat([t.reshape(-1) for _, t in chunk]).to(device)  # a copy, also for one tensor
        b = len(buckets)
        buckets.append(flat)
        bucket_meta.append([key, int(flat.numel())])
        tensors.extend([name, key, list(t.shape), b] for name, t in chunk)
        sizes[key] = 0

    for name, t in named:
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(getattr(torch, dtype))
        key = str(t.dtype).removeprefix("torch.")
        size = t.numel() * t.element_size()
        if open_.get(key) and sizes[key] + size > bucket_bytes:
            close(key)
        open_.setdefault(key, []).append((name, t))
        sizes[key] = sizes.get(key, 0) + size
        nbytes += size
    for key in list(open_):
        close(key)
    manifest = {"version": int(version), "tensors": tensors, "buckets": bucket_meta, "bytes": nbytes,
                "checksum": checksum_kind(buckets[0]) if buckets else "crc32",
                "checksums": [bucket_checksum(b) for b in buckets]}  # checked by every receiver (worker_ext)
    return Snapshot(int(version), manifest, buckets, nbytes)


class BroadcastSender:
    def __init__(self, port: int = 0, *, host: str = "0.0.0.0", backend: str = "gloo", timeout: float = 300.0,
                 dtype: str | None = "bfloat16", device: Any = "cpu", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 keep_versions: int = 1, log: Callable[[str], None] | None = None):
        import torch.distributed as dist  # deferred: torch

        self.backend = backend
        self.timeout = timeout
        self.dtype = dtype
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.log = log or (lambda msg: print(f"[weights] {msg}", file=sys.stderr, flush=True))
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout))
        self.port = self.store.port
        self.keep_versions = keep_versions
        self.transfers = 0  # served successfully
        self.failures = 0
        self.last: dict[str, Any] | None = None  # stats of the last successful transfer
        self._next_request = 0
        self._snapshots: dict[int, Snapshot] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ weights
    def set_weights(self, version: int, named: Iterable[tuple[str, Any]]) -> Snapshot:
        """Snapshot `named` as `version`; keep the newest `keep_versions` versions (maxPolicyLag + 1: a rollout may
        still ask for version − maxPolicyLag)."""
        with self._lock:  # the versions this one pushes out go first: never keep_versions + 1 snapshots at once
            others = sorted(v for v in self._snapshots if v != version)
            for v in others[: max(0, len(others) - (self.keep_versions - 1))]:
                del self._snapshots[v]  # a transfer of it under way keeps its buffers until it ends
        snap = pack(version, named, dtype=self.dtype, device=self.device, bucket_bytes=self.bucket_bytes)
        with self._lock:
            self._snapshots[snap.version] = snap
            for v in sorted(self._snapshots)[: -self.keep_versions]:
                del self._snapshots[v]
        return snap

    @property
    def version(self) -> int | None:
        """The newest version held."""
        with self._lock:
            return max(self._snapshots, default=None)

    @property
    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._snapshots)

    # ------------------------------------------------------------------ serving
    def serve_next(self, timeout: float) -> dict[str, Any] | None:
        """Serve the next queued request; None when none came within `timeout` seconds (or no weights yet)."""
        key = REQUEST_KEY.format(n=self._next_request)
        deadline = time.monotonic() + timeout
        while not self.store.check([key]):  # check(), not wait(): a timed-out wait logs a warning each time
            if time.monotonic() >= deadline or self._stop.is_set():
                return None
            time.sleep(0.02)
        req = json.loads(self.store.get(key))
        self._next_request += 1
        wanted = req.get("version")
        with self._lock:
            held = sorted(self._snapshots)
            snap = self._snapshots.get(held[-1] if wanted is None and held else wanted)
        if snap is None:
            self.failures += 1
            error = f"weight version {wanted} is not held here (held: {held})"
            self.store.set(MANIFEST_KEY.format(group=req["group"]), json.dumps({"error": error}))
            self.log(f"transfer {req.get('group')}: {error}")
            return {"error": error, "version": wanted, "group": req.get("group")}
        try:
            stats = self._send(snap, req)
        except Exception as exc:  # noqa: BLE001 - the engine keeps its old weights; the rollout retries
            self.failures += 1
            self.log(f"transfer {req.get('group')} of version {snap.version} failed: {exc}")
            return {"error": str(exc), "version": snap.version, "group": req.get("group")}
        self.transfers += 1
        self.last = stats
        return stats

    def _send(self, snap: Snapshot, req: dict[str, Any]) -> dict[str, Any]:
        import torch.distributed as dist  # deferred: torch

        group, world = str(req["group"]), int(req["world_size"])
        t0 = time.perf_counter()
        self.store.set(MANIFEST_KEY.format(group=group), json.dumps(snap.manifest))
        pg = make_group(dist.PrefixStore(PG_PREFIX.format(group=group), self.store), 0, world, self.backend,
                        self.timeout)
        for buf in snap.buckets:
            pg.broadcast(buf, 0).wait()
        t1 = time.perf_counter()
        self.store.wait([DONE_KEY.format(group=group, rank=r) for r in range(1, world)],
                        timedelta(seconds=self.timeout))
        t2 = time.perf_counter()
        for r in range(1, world):
            self.store.delete_key(DONE_KEY.format(group=group, rank=r))
        self.store.delete_key(MANIFEST_KEY.format(group=group))
        return {"version": snap.version, "group": group, "bytes": snap.nbytes, "send_seconds": t1 - t0,
                "total_seconds": t2 - t0}

    def start(self) -> BroadcastSender:
        """Serve requests in a background thread until close()."""
        def loop() -> None:
            while not self._stop.is_set():
                self.serve_next(timeout=0.5)

        self._thread = threading.Thread(target=loop, name="trainingrun-weights-broadcast", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout + 5)
            self._thread = None


def new_group_name() -> str:
    return f"tr-{uuid.uuid4().hex[:12]}"
