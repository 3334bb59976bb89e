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

import collections
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
    CHUNK_BYTES,
    ChainCounter,
    bucket_checksum,
    checksum_kind,
    make_group,
    transfer_buckets,
)

JOIN_WINDOW = 5.0  # seconds the sender waits for the other engines of a pool sync before it starts the transfer

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
                 keep_versions: int = 1, log: Callable[[str], None] | None = None, join_window: float = JOIN_WINDOW,
                 chunk_bytes: int = CHUNK_BYTES):
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
        self.dropped = 0  # engines dropped from a transfer of the pool (they loaded again alone, or were taken out)
        self.sending: ChainCounter | None = None
        self.bytes_sent = 0  # bytes this rank put on the wire, all transfers (flat in the pool's size: one chain)
        self.join_window = join_window
        self.chunk_bytes = chunk_bytes
        self._later: list[dict[str, Any]] = []  # requests taken while gathering another sync's, served next
        self.last: dict[str, Any] | None = None  # stats of the last successful transfer
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=64)  # of the last transfers
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
    def _poll(self) -> dict[str, Any] | None:
        """The next request queued in the store, if one is there now (requests are taken in order)."""
        key = REQUEST_KEY.format(n=self._next_request)
        if not self.store.check([key]):  # check(), not wait(): a timed-out wait logs a warning each time
            return None
        self._next_request += 1
        return json.loads(self.store.get(key))

    def _take(self, timeout: float) -> dict[str, Any] | None:
        if self._later:
            return self._later.pop(0)
        deadline = time.monotonic() + timeout
        while (req := self._poll()) is None:
            if time.monotonic() >= deadline or self._stop.is_set():
                return None
            time.sleep(0.02)
        return req

    def _gather(self, first: dict[str, Any]) -> list[dict[str, Any]]:
        """The requests served together with `first`: those of the same pool sync (`joint` id, same version) that
        come within `join_window` seconds, up to the members the pool announced. Others are kept for later; an
        engine that asks after the window (restarted, late) gets a transfer of its own, after this one."""
        joint = first.get("joint") or {}
        members = int(joint.get("members") or 1)
        if not joint.get("id") or members <= 1:
            return [first]
        reqs = [first]
        same = lambda r: (r.get("joint") or {}).get("id") == joint["id"] and r.get("version") == first.get("version")
        for r in [r for r in self._later if same(r)]:
            self._later.remove(r)
            reqs.append(r)
        end = time.monotonic() + self.join_window
        while len(reqs) < members and time.monotonic() < end and not self._stop.is_set():
            req = self._poll()
            if req is None:
                time.sleep(0.01)
            elif same(req):
                reqs.append(req)
            else:
                self._later.append(req)
        self._later.extend(reqs[members:])
        return reqs[:members]

    def serve_next(self, timeout: float) -> dict[str, Any] | None:
        """Serve the next queued request (with the requests of the same pool sync: one transfer); None when none
        came within `timeout` seconds."""
        first = self._take(timeout)
        if first is None:
            return None
        reqs = self._gather(first)
        wanted = first.get("version")
        groups = [r.get("group") for r in reqs]
        with self._lock:
            held = sorted(self._snapshots)
            snap = self._snapshots.get(held[-1] if wanted is None and held else wanted)
        if snap is None:
            self.failures += 1
            error = f"weight version {wanted} is not held here (held: {held})"
            for r in reqs:
                self.store.set(MANIFEST_KEY.format(group=r["group"]), json.dumps({"error": error}))
            self.log(f"transfer {groups}: {error}")
            return {"error": error, "version": wanted, "groups": groups}
        try:
            stats = self._send(snap, reqs)
        except Exception as exc:  # noqa: BLE001 - the engines keep their old weights; the rollout retries
            self.failures += 1
            self.dropped += len(reqs) if len(reqs) > 1 else 0
            self.log(f"transfer {groups} of version {snap.version} failed: {exc}")
            return {"error": str(exc), "version": snap.version, "groups": groups}
        self.last = stats
        self.history.append(stats)
        self.transfers += 1
        return stats

    def _send(self, snap: Snapshot, reqs: list[dict[str, Any]]) -> dict[str, Any]:
        """One transfer of `snap` to every engine of `reqs`: one group, rank 0 this sender, each engine's workers at
        their offset; every bucket sent once (`worker_ext.transfer_buckets`). An engine whose workers do not all say
        "ok" is dropped (its load failed: it transfers again alone), the others count."""
        import torch.distributed as dist  # deferred: torch

        name = str(reqs[0]["group"]) if len(reqs) == 1 else f"{reqs[0]['group']}-pool{len(reqs)}"
        members, offset = [], 1
        for r in reqs:
            members.append({"group": str(r["group"]), "offset": offset, "workers": int(r["world_size"]) - 1})
            offset += int(r["world_size"]) - 1
        world = offset
        chain = list(range(1, world))
        t0 = time.perf_counter()
        for m in members:
            transfer = {"group": name, "offset": m["offset"], "world_size": world, "chain": chain,
                        "chunk_bytes": self.chunk_bytes}
            self.store.set(MANIFEST_KEY.format(group=m["group"]), json.dumps({**snap.manifest, "transfer": transfer}))
        counter = self.sending = ChainCounter()  # live: what this transfer sent so far
        try:
            pg = make_group(dist.PrefixStore(PG_PREFIX.format(group=name), self.store), 0, world, self.backend,
                            self.timeout)
            transfer_buckets(pg, list(snap.buckets), snap.manifest["buckets"], me=0,
                             chain=None if self.backend == "nccl" else chain, chunk_bytes=self.chunk_bytes,
                             counter=counter)
            t1 = time.perf_counter()
            done = self._wait_done(name, world)
        finally:
            self.bytes_sent += counter.bytes
            for m in members:
                self.store.delete_key(MANIFEST_KEY.format(group=m["group"]))
        t2 = time.perf_counter()
        loaded = [m["group"] for m in members
                  if all(done.get(r) == "ok" for r in range(m["offset"], m["offset"] + m["workers"]))]
        dropped = [m["group"] for m in members if m["group"] not in loaded]
        self.dropped += len(dropped)
        if dropped:
            self.log(f"transfer {name} of version {snap.version}: dropped {dropped} (answers {done}; they load again "
                     f"in transfers of their own), loaded {len(loaded)} of {len(members)}")
        return {"version": snap.version, "group": name, "engines": len(members), "loaded": loaded,
                "dropped": dropped, "bytes": snap.nbytes, "bytes_sent": counter.bytes, "send_seconds": t1 - t0,
                "total_seconds": t2 - t0}

    def _wait_done(self, name: str, world: int) -> dict[int, str]:
        """{rank: its answer} of the receivers that answered within the timeout (keys deleted)."""
        keys = {r: DONE_KEY.format(group=name, rank=r) for r in range(1, world)}
        deadline = time.monotonic() + self.timeout
        while not all(self.store.check([k]) for k in keys.values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        done = {}
        for r, k in keys.items():
            if self.store.check([k]):
                done[r] = self.store.get(k).decode()
                self.store.delete_key(k)
        return done

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
