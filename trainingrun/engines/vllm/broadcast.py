"""The trainers' side of the `broadcast` weight sync: a TCPStore on rank 0, the kept versions sharded over the owner
ranks in host memory, and one transfer per pool sync.

`BroadcastSender(port=...)` (trainer rank 0) hosts a TCPStore that the engines' workers connect to (see
`worker_ext.py` for the protocol). `set_weights(version, named_tensors)` takes a snapshot of this rank's weights in
the engine's dtype, packed into flat buckets per dtype (a copy, so training may go on changing the model), and keeps
the newest `keep_versions` (maxPolicyLag + 1; the oldest is let go before the next is made, so no rank ever holds one
more). The tensors may come as a stream (the streamed sync's buckets): each bucket is packed as it fills.

Sharded (`owners` > 1, issue 28 item 3): each owner rank of replica 0 (TP/EP ranks of every stage) snapshots only the
buckets it owns, in host memory; its part's manifest goes into rank 0's store (PART_KEY). Rank 0 is owner 0; the
others run a `ShardServer`, a thread that answers each transfer rank 0 announces (TRANSFER_KEY; READY_KEY: it holds
the version or not, before any engine is told to join), joins it and sends its own buckets. A transfer's manifest is
assembled from the parts (`assemble`: each bucket names its owner, the root that sends it).

Serving (`start()`: a thread; or `serve_next()`): requests are taken in order; the requests of one pool sync (the
same `joint` id and version, up to its `members`, within `join_window` seconds of the first) are served in one
transfer (issue 28 item 2): one group — the owners as ranks 0 … owners − 1, then every engine's workers at their
offsets — through which each bucket goes once from its owner (`worker_ext.transfer_buckets`: a pipelined chain on
gloo, NCCL's ring broadcast on GPUs). An engine whose workers do not all answer "ok" is dropped from it (it loads
again alone; a dead one is taken out by the pool); a request that comes late gets a transfer of its own, after. A
transfer that fails (engine died, timeout) is logged; the engines keep their old weights whole and load again.
Engines of tensor parallelism t > 1 (issue 28 item 6, `sliced`): each bucket is cut into t slices as the transfer
reaches it (`tp_slice`), slice r going down a chain of the workers of TP rank r of every engine (gloo), or on NCCL
broadcast in a group of its own, the owners and those workers (`worker_ext.transfer_groups`), so each worker
receives its part only and rank 0 sends about one copy of the model; only the engines of one layout share a
transfer.
`bytes_sent` counts what this rank put on the wire.

Backends: gloo (CPU tensors) or NCCL (each bucket copied to this rank's GPU for its broadcast; the snapshots stay
in host memory); the engine side uses the same.
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

from trainingrun.engines.vllm.tp_slice import EngineTP, rules, unit_buffers, unit_sizes
from trainingrun.engines.vllm.worker_ext import (
    DONE_KEY,
    MANIFEST_KEY,
    PG_PREFIX,
    REQUEST_KEY,
    CHUNK_BYTES,
    ITEMSIZE,
    ChainCounter,
    bucket_root,
    bucket_checksum,
    checksum_kind,
    connect,
    transfer_buckets,
    transfer_groups,
)

PART_KEY = "trainingrun/part/{version}/{owner}"  # an owner's part manifest of a version (JSON)
TRANSFER_KEY = "trainingrun/transfer/{n}"  # rank 0 → the other owners: join transfer n (JSON)
READY_KEY = "{group}/ready/{owner}"  # an owner → rank 0: "ready" (holds the version, joins) or "missing"

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
                 chunk_bytes: int = CHUNK_BYTES, owners: int = 1, owner: int = 0, transfer_device: Any = None,
                 store: Any = None):
        import torch.distributed as dist  # deferred: torch

        self.backend = backend
        self.timeout = timeout
        self.dtype = dtype
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.log = log or (lambda msg: print(f"[weights] {msg}", file=sys.stderr, flush=True))
        self.owners, self.owner = owners, owner
        self.transfer_device = transfer_device if transfer_device is not None else device  # NCCL: the GPU
        self.store = store if store is not None else dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                                                   timeout=timedelta(seconds=timeout))
        self.port = port if store is not None else self.store.port
        self._next_transfer = 0
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
                if self.owners > 1:
                    self.store.delete_key(PART_KEY.format(version=v, owner=self.owner))
        snap = pack(version, named, dtype=self.dtype, device=self.device, bucket_bytes=self.bucket_bytes)
        with self._lock:
            self._snapshots[snap.version] = snap
            gone = sorted(self._snapshots)[: -self.keep_versions]
            for v in gone:
                del self._snapshots[v]
        if self.owners > 1:  # rank 0 assembles the transfer's manifest from every owner's part
            self.store.set(PART_KEY.format(version=snap.version, owner=self.owner), json.dumps(snap.manifest))
            for v in gone:
                self.store.delete_key(PART_KEY.format(version=v, owner=self.owner))
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
        same = lambda r: ((r.get("joint") or {}).get("id") == joint["id"] and r.get("version") == first.get("version")
                          and EngineTP.from_json(r.get("tp")) == EngineTP.from_json(first.get("tp")))
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
        error = None
        if snap is None:
            error = f"weight version {wanted} is not held here (held: {held})"
        elif self.owners > 1:
            try:  # a version asked for by number was committed, so every part was there: a missing one was let go
                snap = self.assemble(snap, wait=wanted is None)
            except (RuntimeError, ValueError) as exc:
                error = str(exc)
        if error is not None:
            self.failures += 1
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
        members, offset = [], self.owners
        for r in reqs:
            members.append({"group": str(r["group"]), "offset": offset, "workers": int(r["world_size"]) - 1})
            offset += int(r["world_size"]) - 1
        world = offset
        chain = list(range(self.owners, world))
        manifest, chains, per_rank = sliced(snap.manifest, EngineTP.from_json(reqs[0].get("tp")), members)
        t0 = time.perf_counter()
        if self.owners > 1:  # the other owners join as ranks 1 … owners − 1 and send their own buckets
            self.store.set(TRANSFER_KEY.format(n=self._next_transfer), json.dumps(
                {"group": name, "version": snap.version, "world_size": world, "chain": chain,
                 "chunk_bytes": self.chunk_bytes, "buckets": manifest["buckets"],
                 **({"chains": chains, "tp": manifest["tp"], "tensors": manifest["tensors"],
                     "slices": manifest["slices"], "checksum": manifest["checksum"]} if chains else {})}))
            self._next_transfer += 1
            self._owners_ready(name, snap.version, [m["group"] for m in members])
        for m in members:
            transfer = {"group": name, "offset": m["offset"], "world_size": world, "chain": chain,
                        "chunk_bytes": self.chunk_bytes, **({"chains": chains} if chains else {})}
            self.store.set(MANIFEST_KEY.format(group=m["group"]), json.dumps({**manifest, "transfer": transfer}))
        counter = self.sending = ChainCounter()  # live: what this transfer sent so far
        try:
            pg, groups = transfer_groups(dist.PrefixStore(PG_PREFIX.format(group=name), self.store), 0, world,
                                         self.backend, self.timeout, chains, broadcast=self.backend == "nccl")
            transfer_buckets(pg, _buffers(list(snap.buckets), manifest), manifest["buckets"], me=0,
                             chain=None if self.backend == "nccl" else chain, chunk_bytes=self.chunk_bytes,
                             counter=counter, device=self.transfer_device, chains=chains,
                             checksum=manifest.get("checksum"), groups=groups)
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
                "total_seconds": t2 - t0, "tp": len(per_rank), "bytes_per_worker": per_rank}

    def _owners_ready(self, name: str, version: int, groups: list[str]) -> None:
        """Every other owner's answer to transfer `name` before any engine is told to join: an owner that no longer
        holds `version` (it packed the next one first) answers "missing" and would never join the group, which
        would leave this rank and the engines waiting for it for the group's whole timeout. Then the engines get
        an error manifest at once (they load again) and RuntimeError names the owners."""
        keys = {g: READY_KEY.format(group=name, owner=g) for g in range(1, self.owners)}
        deadline = time.monotonic() + self.timeout
        while not all(self.store.check([k]) for k in keys.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        answers = {g: self.store.get(k).decode() if self.store.check([k]) else "no answer" for g, k in keys.items()}
        for k in keys.values():
            self.store.delete_key(k)
        bad = {g: a for g, a in answers.items() if a != "ready"}
        if bad:
            error = f"weight version {version}: trainer owners {bad} cannot send their part; load again"
            for group in groups:
                self.store.set(MANIFEST_KEY.format(group=group), json.dumps({"error": error}))
            raise RuntimeError(error)

    def _wait_done(self, name: str, world: int) -> dict[int, str]:
        """{rank: its answer} of the other owners and the receivers that answered within the timeout (keys
        deleted)."""
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

    def parts(self, version: int, timeout: float | None = None) -> list[dict[str, Any]]:
        """Every owner's part manifest of `version` (waiting up to `timeout` for them: the owners pack in step with
        this rank); RuntimeError naming the owners whose part is not there."""
        keys = [PART_KEY.format(version=version, owner=g) for g in range(self.owners)]
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not all(self.store.check([k]) for k in keys):
            if time.monotonic() >= deadline:
                missing = [g for g, k in enumerate(keys) if not self.store.check([k])]
                raise RuntimeError(f"weight version {version} is not held by trainer owners {missing} (of "
                                   f"{self.owners}): released or never packed")
            time.sleep(0.02)
        return [json.loads(self.store.get(k)) for k in keys]

    def assemble(self, snap: Snapshot, wait: bool = True) -> Snapshot:
        """The transfer's view of a sharded version: the manifest of every owner's buckets (owner g's after owner
        g − 1's, each bucket's entry naming its owner as the root that sends it) and this rank's buffers at its
        own buckets' places (None at the others'). `wait`: for parts not packed yet (up to the timeout, 60 s at
        most); else a missing part raises at once."""
        parts = self.parts(snap.version, timeout=min(self.timeout, 60.0) if wait else 0.0)
        tensors, entries, sums, buffers, nbytes = [], [], [], [], 0
        for g, part in enumerate(parts):
            base = len(entries)
            tensors += [[n, d, shape, b + base] for n, d, shape, b in part["tensors"]]
            entries += [[d, n, g] for d, n in part["buckets"]]
            sums += part["checksums"]
            buffers += list(snap.buckets) if g == self.owner else [None] * len(part["buckets"])
            nbytes += int(part["bytes"])
        kinds = {p["checksum"] for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"weight version {snap.version}: owners' checksums differ in kind {sorted(kinds)}")
        manifest = {"version": snap.version, "tensors": tensors, "buckets": entries, "bytes": nbytes,
                    "checksum": kinds.pop(), "checksums": sums}
        return Snapshot(snap.version, manifest, buffers, nbytes)

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


class ShardServer(BroadcastSender):
    """An owner of part of the weights other than trainer rank 0 (`owner` ≥ 1 of `owners`): keeps its own buckets of
    each version in host memory (`set_weights`: its part of the sharded stream; the part's manifest goes into rank
    0's store) and, from a thread, joins every transfer rank 0 announces (TRANSFER_KEY, in order) as rank `owner`,
    sending its own buckets down the chain of the engines' workers. Its wait for rank 0's store is bounded
    (`worker_ext.connect`). It answers each transfer first (READY_KEY): "ready" (the version's buffers held until
    the transfer ends) or "missing" (a version it already let go): rank 0 then tells the engines at once, before
    any of them joins (`_owners_ready`), and they load again."""

    def __init__(self, host: str, port: int, *, owner: int, owners: int, timeout: float = 300.0,
                 connect_timeout: float = 60.0, **kw):
        store = connect(host, port, connect_timeout, timeout)
        super().__init__(port, timeout=timeout, owners=owners, owner=owner, store=store, **kw)

    def serve_next(self, timeout: float) -> dict[str, Any] | None:
        key = TRANSFER_KEY.format(n=self._next_transfer)
        deadline = time.monotonic() + timeout
        while not self.store.check([key]):
            if time.monotonic() >= deadline or self._stop.is_set():
                return None
            time.sleep(0.02)
        self._next_transfer += 1
        t = json.loads(self.store.get(key))
        name, done = str(t["group"]), DONE_KEY.format(group=t["group"], rank=self.owner)
        with self._lock:
            snap = self._snapshots.get(int(t["version"]))  # held here until the transfer ends
        self.store.set(READY_KEY.format(group=name, owner=self.owner), "missing" if snap is None else "ready")
        if snap is None:
            self.failures += 1
            self.log(f"transfer {name}: version {t['version']} is not held here (held: {self.versions})")
            return {"error": "missing", "group": name}
        import torch.distributed as dist  # deferred: torch

        own = iter(snap.buckets)
        chains = t.get("chains")
        size = int(t["tp"]["size"]) if chains else 1
        buffers = [next(own) if int(e[2]) == self.owner else None for e in t["buckets"][::size]]
        if chains:  # sliced: this owner's buckets cut as the transfer reaches them, as rank 0 cuts its own
            buffers = _buffers(buffers, t)
        counter = self.sending = ChainCounter()
        try:
            pg, groups = transfer_groups(dist.PrefixStore(PG_PREFIX.format(group=name), self.store), self.owner,
                                         int(t["world_size"]), self.backend, self.timeout, chains,
                                         broadcast=self.backend == "nccl")
            transfer_buckets(pg, buffers, t["buckets"], me=self.owner,
                             chain=None if self.backend == "nccl" else [int(r) for r in t["chain"]],
                             chunk_bytes=int(t["chunk_bytes"]), counter=counter, device=self.transfer_device,
                             chains=chains, checksum=t.get("checksum"), groups=groups)
        except Exception as exc:  # noqa: BLE001 - the engines keep their weights and transfer again
            self.store.set(done, "failed")
            self.failures += 1
            self.log(f"transfer {name} of version {snap.version} failed here: {exc}")
            return {"error": str(exc), "group": name}
        finally:
            self.bytes_sent += counter.bytes
        self.store.set(done, "ok")
        self.transfers += 1
        return {"group": name, "version": snap.version, "bytes_sent": counter.bytes}


def sliced(manifest: dict[str, Any], tp: EngineTP,
           members: list[dict[str, Any]]) -> tuple[dict[str, Any], list[list[int]] | None, list[int]]:
    """A transfer's manifest, its chains and the bytes each worker receives. For engines of TP t > 1
    (`tp_slice`): each bucket becomes t slices, entries [dtype, numel, root, r] (bucket b's slice r is entry b·t + r),
    slice r going down `chains[r]`, the workers of TP rank r of every engine (worker i is TP rank i mod t); each
    tensor's rule in "slices"; the checksums travel with the slices. Unchanged (chains None) when t is 1 or the
    table slices nothing, or an engine's workers are not a multiple of t."""
    t = tp.size
    whole = [int(e[1]) * ITEMSIZE.get(e[0], 4) for e in manifest["buckets"]]
    if t <= 1 or any(m["workers"] % t for m in members):
        return manifest, None, [sum(whole)]
    slices = rules(manifest["tensors"], tp)
    if not any(slices):
        return manifest, None, [sum(whole)]
    sizes = unit_sizes(manifest["tensors"], slices, len(manifest["buckets"]), t)
    units = [[e[0], sizes[b][r], bucket_root(e), r] for b, e in enumerate(manifest["buckets"]) for r in range(t)]
    chains = [[m["offset"] + i for m in members for i in range(m["workers"]) if i % t == r] for r in range(t)]
    per_rank = [sum(int(u[1]) * ITEMSIZE.get(u[0], 4) for u in units if u[3] == r) for r in range(t)]
    out = {k: v for k, v in manifest.items() if k != "checksums"}
    return {**out, "buckets": units, "slices": slices, "tp": tp.to_json()}, chains, per_rank


def _buffers(buckets: list, manifest: dict[str, Any]):
    """What a sender's `transfer_buckets` sends: its buckets (None: another owner's), or for a sliced transfer their
    slices, each bucket cut when the transfer reaches it."""
    if not manifest.get("slices"):
        return buckets
    return unit_buffers(buckets, manifest["tensors"], manifest["slices"], int(manifest["tp"]["size"]))


def new_group_name() -> str:
    return f"tr-{uuid.uuid4().hex[:12]}"
