"""`redis://host:port/db` store (redis-py), the cluster default.

Keys (prefix P = "trainingrun", or `?prefix=NAME` in the URL, so several runs can share one server):

    P:epoch                 {"id", "created", "host"}: set once (SET NX) when the store is first used
    P:attempt               the store's current attempt (the newest that used it)
    P:writer                the rollout writer's claim (owner identity), with a lease (PX), renewed while it lives
    P:r:<k>:a<N>:p:<rank>   rank payload written by attempt N (wire format, one string value)
    P:r:<k>:parts           set of the payload keys written for rollout k (any attempt), deleted on release
    P:r:<k>:schedule        the schedule (JSON)
    P:r:<k>:commit          commit marker (`common.Marker`: rollout, dp_size, attempt, schedule CRC-32, check)
    P:committed             sorted set of committed rollouts (score = member = k)
    P:r:<k>:acks            set of ranks that acknowledged rollout k
    P:w:<v>:a<N>:c:<i>      weight version v written by attempt N: chunk i of its tensors (wire format, in pieces of
                            WEIGHT_CHUNK_BYTES, so any model size fits under Redis' 512 MiB value limit)
    P:w:<v>:parts           set of the chunk keys written for version v (any attempt), deleted on release
    P:w:<v>:meta            its metadata (JSON)
    P:w:<v>:commit          commit marker (`common.WeightsMarker`: version, attempt, bytes, chunks, meta CRC-32, check)
    P:weights               sorted set of committed weight versions
    P:kv:<key>              put_json/get_json
    P:finished              {"num_rollouts": n}
    P:released              k: rollouts < k may have been deleted

Atomicity and fencing: payloads are plain SETs under the writer's attempt (a writer of an older attempt can never
overwrite what a newer one committed); then schedule, commit marker and the `committed` entry go in one MULTI/EXEC
transaction. Every write (the commit, finish, ack, release, put_json) is such a transaction, guarded with WATCH on
the epoch, the current attempt and the writer claim: it commits only if the epoch is the one this handle saw (else
`StoreDataLost`), no newer attempt used the store (else `StaleAttempt`) and, for the writer's operations, this
handle holds the claim (else `WriterConflict`). A writer that dies before EXEC leaves payload keys without a commit
marker, which readers never look at; a re-publish overwrites them and commits. Weight versions (trainer rank 0
writes, the rollout's engine reads) follow the same protocol: chunks under the writer's attempt, then meta, marker
and the `weights` entry in one guarded transaction, fenced by the epoch and the attempt (no writer claim: the
trainer is not the rollout writer).

Transient errors (ConnectionError, TimeoutError, a server still loading its data) are retried with exponential
backoff for up to `retry_seconds` (URL option `?retry_seconds=60`); anything else, or running out of retries, raises
StoreError naming the URL and key. `wait_rollout` keeps polling through a server restart until its own timeout; a
server that comes back without its data is reported as `StoreDataLost`. The writer lease is `?lease_seconds=30`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from trainingrun.contract.errors import CorruptPayload, StoreError
from trainingrun.contract.payload import RankPayload
from trainingrun.store.base import RolloutReleased
from trainingrun.store.common import (
    Marker,
    Owner,
    WeightsMarker,
    backoff,
    check_attempt,
    check_key,
    check_publish,
    check_rollout,
    check_weights,
    conflict,
    lost,
    new_epoch,
    poll,
    stale,
    stored_int,
)
from trainingrun.store.wire import (
    decode_arrays,
    decode_json,
    decode_payload,
    encode_arrays_parts,
    encode_json,
    encode_payload_parts,
)

T = TypeVar("T")
MAX_VALUE_BYTES = 512 * 1024 * 1024  # Redis' limit of one string value
WEIGHT_CHUNK_BYTES = 64 * 1024 * 1024  # weights are stored in pieces of this size (any model size fits)


def _positive(query: dict[str, list[str]], name: str, default: float) -> float:
    if name not in query:
        return default
    raw = query[name][-1]
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0 or value > 86400:
        raise ValueError(f"store url: {name} must be a number of seconds in (0, 86400], got {raw!r}")
    return value


class RedisStore:
    """A Store on a Redis server. See the module docstring for keys, atomicity, fencing and retries."""

    def __init__(self, url: str, *, prefix: str = "trainingrun", retry_seconds: float = 60.0, socket_timeout: float = 30,
                 lease_seconds: float = 30.0, attempt: int | None = None):
        import redis  # the `store` extra

        self._redis = redis
        self.url = url
        self.prefix = prefix
        self.retry_seconds = retry_seconds
        self.lease_seconds = lease_seconds
        self.attempt = check_attempt(attempt)
        parts = urlsplit(url)
        try:
            db = int(parts.path.strip("/") or 0)
            port = parts.port or 6379
        except ValueError:
            raise ValueError(f"store url: {url!r}: expected redis://host:port/db with an integer port and db") from None
        if not parts.hostname:
            raise ValueError(f"store url: {url!r} has no host (expected redis://host:port/db)")
        self.client = redis.Redis(
            host=parts.hostname,
            port=port,
            db=db,
            password=parts.password,
            username=parts.username,
            socket_timeout=socket_timeout,
            socket_connect_timeout=5,
        )
        self._transient = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
        self._epoch: str | None = None  # the epoch id this handle has seen
        self._owner: Owner | None = None  # our writer claim, while held
        self._lost_claim: Owner | None = None  # who took the claim from us (seen by the lease thread)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @classmethod
    def from_url(cls, url: str, *, attempt: int | None = None) -> RedisStore:
        query = parse_qs(urlsplit(url).query)
        kwargs: dict[str, Any] = {"attempt": attempt}
        if "prefix" in query:
            try:
                kwargs["prefix"] = check_key(query["prefix"][-1])
            except ValueError as exc:
                raise ValueError(f"store url: prefix: {exc}") from None
        kwargs["retry_seconds"] = _positive(query, "retry_seconds", 60.0)
        kwargs["lease_seconds"] = _positive(query, "lease_seconds", 30.0)
        return cls(url, **kwargs)

    # ------------------------------------------------------------------ helpers
    def _k(self, *parts: object) -> str:
        return ":".join([self.prefix, *map(str, parts)])

    def _payload_key(self, rollout: int, attempt: int | None, rank: int) -> str:
        return self._k("r", rollout, f"a{attempt or 0}", "p", rank)

    def _retry(self, op: Callable[[], T], key: str, *, retry_seconds: float | None = None) -> T:
        """Run `op`, retrying transient errors with exponential backoff; StoreError naming url and key otherwise."""
        limit = self.retry_seconds if retry_seconds is None else retry_seconds
        deadline = time.monotonic() + limit
        delays = backoff(initial=0.05, maximum=2.0, factor=2.0)
        while True:
            try:
                return op()
            except self._transient as exc:
                if time.monotonic() >= deadline:
                    raise StoreError(
                        f"store {self.url}: key {key}: server unreachable for {limit:g} s: {exc}"
                    ) from exc
                time.sleep(min(next(delays), max(0.0, deadline - time.monotonic())))
            except self._redis.RedisError as exc:
                raise StoreError(f"store {self.url}: key {key}: {exc.__class__.__name__}: {exc}") from exc

    def _get(self, key: str) -> bytes | None:
        return self._retry(lambda: self.client.get(key), key)

    def _get_json(self, key: str) -> Any:
        data = self._get(key)
        return None if data is None else decode_json(data, where=f"store {self.url}: key {key}")

    # ------------------------------------------------------------------ fencing
    def _check_epoch(self, raw: bytes | None, *, create: bool) -> tuple[bytes | None, str | None]:
        """(value to SET as the new epoch or None, the id to adopt once the write succeeded); StoreDataLost when the
        epoch this handle saw vanished or changed."""
        key = self._k("epoch")
        if raw is None:
            if self._epoch is not None:
                raise lost(self.url, f"key {key} is gone (this process saw epoch {self._epoch})")
            if not create:
                return None, None
            epoch = new_epoch()
            return encode_json(epoch), epoch["id"]
        value = decode_json(raw, where=f"store {self.url}: key {key}")
        if not isinstance(value, dict) or not isinstance(value.get("id"), str):
            raise CorruptPayload(f"store {self.url}: key {key}: epoch must be a JSON object with a string id")
        if self._epoch is not None and value["id"] != self._epoch:
            raise lost(self.url, f"its epoch changed from {self._epoch} to {value['id']} (the store was emptied and "
                                 "started again)")
        return None, value["id"]

    def _check_attempt(self, raw: bytes | None, op: str) -> int | None:
        current = None if raw is None else stored_int(raw, where=f"store {self.url}: key {self._k('attempt')}",
                                                      field="attempt")
        if self.attempt is not None and current is not None and current > self.attempt:
            raise stale(self.url, op, self.attempt, current)
        return current

    def _check_writer(self, raw: bytes | None, op: str) -> None:
        if self._lost_claim is not None and self._owner is not None:
            raise conflict(self.url, self._lost_claim, self._owner, lost=True)
        if raw is None:
            return  # no claim (or its lease ran out while the server was away): nobody else writes
        owner = Owner.from_json(decode_json(raw, where=f"store {self.url}: key {self._k('writer')}"),
                                where=f"store {self.url}: key {self._k('writer')}")
        if self._owner is not None and owner.token == self._owner.token:
            return
        if owner.attempt is not None and self.attempt is not None and owner.attempt > self.attempt:
            raise stale(self.url, op, self.attempt, owner.attempt)
        if self._owner is not None:
            raise conflict(self.url, owner, self._owner, lost=True)
        if not owner.dead_here():
            raise conflict(self.url, owner, Owner.me(self.attempt))

    def _guarded(self, op: str, key: str, fill: Callable[[Any], Any], *, writer: bool = False,
                 watch: tuple[str, ...] = ()) -> Any:
        """Run `fill(pipe)` (queueing commands on a MULTI pipeline) as one transaction that commits only if the
        epoch, the current attempt and (with `writer`) the writer claim pass their checks when it commits; `fill`
        may return `False` to skip the transaction (it then sees the watched keys' immediate values)."""
        e_key, a_key, w_key = self._k("epoch"), self._k("attempt"), self._k("writer")

        def tx() -> Any:
            with self.client.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        pipe.watch(e_key, a_key, w_key, *watch)
                        epoch, current, claim = pipe.mget(e_key, a_key, w_key)
                        new, adopt = self._check_epoch(epoch, create=True)
                        self._check_attempt(current, op)
                        if writer:
                            self._check_writer(claim, op)
                        skip = fill(pipe) is False
                        if skip:
                            pipe.unwatch()
                            return False
                        if new is not None:
                            pipe.set(e_key, new)
                        result = pipe.execute()
                        self._epoch = self._epoch or adopt
                        return result
                    except self._redis.WatchError:
                        continue

        return self._retry(tx, key)

    def enter_attempt(self) -> int:
        if self.attempt is None:
            raise ValueError("enter_attempt: this store handle has no attempt (open_store(url, attempt=N))")

        def fill(pipe: Any) -> None:
            pipe.multi()
            pipe.set(self._k("attempt"), self.attempt)

        self._guarded("opening the store", self._k("attempt"), fill)
        return self.attempt

    def claim_writer(self) -> dict[str, Any]:
        me = self._owner or Owner.me(self.attempt)
        w_key = self._k("writer")

        def fill(pipe: Any) -> None:
            raw = pipe.get(w_key)
            if raw is not None:
                owner = Owner.from_json(decode_json(raw, where=f"store {self.url}: key {w_key}"),
                                        where=f"store {self.url}: key {w_key}")
                newer = owner.attempt is not None and (self.attempt is None or owner.attempt > self.attempt)
                if newer:
                    raise stale(self.url, "claiming the writer", self.attempt or 0, owner.attempt)
                same = owner.attempt == self.attempt
                if owner.token != me.token and same and not owner.dead_here():
                    raise conflict(self.url, owner, me)
            pipe.multi()
            if self.attempt is not None:
                pipe.set(self._k("attempt"), self.attempt)
            pipe.set(w_key, encode_json(me.to_json()), px=int(self.lease_seconds * 1000))

        # the writer check is done by `fill` itself (it may take over an older attempt's claim)
        self._guarded("claiming the writer", w_key, fill)
        self._owner = me
        self._lost_claim = None
        if self._renewer is None:
            self._stop.clear()
            self._renewer = threading.Thread(target=self._renew_loop, name="trainingrun-store-lease", daemon=True)
            self._renewer.start()
        return me.to_json()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_seconds / 3):
            try:
                self._renew()
            except Exception:  # noqa: BLE001 - the next guarded write reports what is wrong
                pass

    def _renew(self) -> None:
        """Keep our claim alive: extend its lease; re-claim it if the lease ran out (server away for a while) and
        nobody took it; remember who did if someone did (the next writer operation then fails)."""
        owner, w_key = self._owner, self._k("writer")
        if owner is None:
            return
        with self.client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(w_key, self._k("epoch"))
                raw, epoch = pipe.mget(w_key, self._k("epoch"))
                self._check_epoch(epoch, create=False)
                if raw is not None:
                    current = Owner.from_json(decode_json(raw, where=w_key), where=w_key)
                    if current.token != owner.token:
                        self._lost_claim = current
                        pipe.unwatch()
                        return
                pipe.multi()
                pipe.set(w_key, encode_json(owner.to_json()), px=int(self.lease_seconds * 1000))
                pipe.execute()
            except self._redis.WatchError:
                pass

    def writer(self) -> dict[str, Any] | None:
        """The current writer claim's owner record (None when nobody holds one)."""
        value = self._get_json(self._k("writer"))
        return None if value is None else Owner.from_json(value, where=self._k("writer")).to_json()

    def epoch(self) -> str | None:
        """The store's epoch id (None before the store was first written); StoreDataLost if it changed."""
        _, adopt = self._check_epoch(self._get(self._k("epoch")), create=False)
        self._epoch = self._epoch or adopt
        return self._epoch

    def _probe_epoch(self, raw: bytes | None) -> None:
        _, adopt = self._check_epoch(raw, create=False)
        self._epoch = self._epoch or adopt

    # ------------------------------------------------------------------ writer
    def is_committed(self, rollout: int) -> bool:
        key = self._k("r", check_rollout(rollout), "commit")
        return bool(self._retry(lambda: self.client.exists(key), key))

    def publish_rollout(
        self, rollout: int, payloads: dict[int, RankPayload], schedule: dict[str, Any], *, _after_payloads=None
    ) -> bool:
        """Publish atomically; returns False (and writes nothing) if the rollout is already committed.

        `_after_payloads` is a test hook called after the payloads are written, before the commit transaction.
        """
        dp = check_publish(rollout, payloads, schedule)
        schedule_bytes = encode_json(schedule, where="schedule")
        commit_key = self._k("r", rollout, "commit")
        if self.is_committed(rollout):
            return False
        self._guarded(f"publishing rollout {rollout}", commit_key, lambda pipe: False, writer=True)
        parts_key = self._k("r", rollout, "parts")
        for rank in range(dp):
            key = self._payload_key(rollout, self.attempt, rank)
            data = b"".join(encode_payload_parts(payloads[rank]))
            if len(data) > MAX_VALUE_BYTES:
                raise StoreError(
                    f"store {self.url}: key {key}: payload of {len(data)} bytes exceeds Redis' 512 MiB value limit;"
                    " use more data-parallel ranks or fewer samples per rollout"
                )

            def put(key: str = key, data: bytes = data) -> None:
                pipe = self.client.pipeline(transaction=False)
                pipe.sadd(parts_key, key)
                pipe.set(key, data)
                pipe.execute()

            self._retry(put, key)
        if _after_payloads is not None:
            _after_payloads()
        marker = Marker.for_schedule(rollout, dp, self.attempt, schedule_bytes)

        def commit(pipe: Any) -> bool | None:
            if pipe.exists(commit_key):
                return False  # committed meanwhile (a replayed transaction after a lost reply, or another writer)
            pipe.multi()
            pipe.set(self._k("r", rollout, "schedule"), schedule_bytes)
            pipe.set(commit_key, marker.encode())
            pipe.zadd(self._k("committed"), {str(rollout): rollout})
            return None

        result = self._guarded(f"committing rollout {rollout}", commit_key, commit, writer=True, watch=(commit_key,))
        return result is not False

    def finish(self, num_rollouts: int) -> None:
        check_rollout(num_rollouts, "num_rollouts")
        key = self._k("finished")
        value = encode_json({"num_rollouts": num_rollouts})

        def fill(pipe: Any) -> None:
            pipe.multi()
            pipe.set(key, value)

        self._guarded("finishing the stream", key, fill, writer=True)

    def _finished(self, raw: bytes | None) -> int | None:
        if raw is None:
            return None
        where = f"store {self.url}: key {self._k('finished')}"
        value = decode_json(raw, where=where)
        return stored_int(value.get("num_rollouts") if isinstance(value, dict) else value, where=where,
                          field="num_rollouts")

    def finished(self) -> int | None:
        return self._finished(self._get(self._k("finished")))

    def _marker(self, raw: bytes | None, rollout: int) -> Marker | None:
        if raw is None:
            return None
        return Marker.decode(raw, where=f"store {self.url}: key {self._k('r', rollout, 'commit')}")

    def pending_rollouts(self) -> int:
        key = self._k("committed")

        def read() -> tuple[Any, list[Any], list[int]]:
            pipe = self.client.pipeline(transaction=False)
            pipe.get(self._k("epoch"))
            pipe.zrange(key, 0, -1)
            epoch, members = pipe.execute()
            ks = [stored_int(m, where=f"store {self.url}: key {key}", field="member") for m in members]
            pipe = self.client.pipeline(transaction=False)
            for k in ks:
                pipe.get(self._k("r", k, "commit"))
                pipe.scard(self._k("r", k, "acks"))
            return epoch, (pipe.execute() if ks else []), ks

        epoch, res, ks = self._retry(read, key)
        self._probe_epoch(epoch)
        pending = 0
        for i, k in enumerate(ks):
            marker = self._marker(res[2 * i], k)
            if marker is not None and res[2 * i + 1] < marker.dp_size:
                pending += 1
        return pending

    # ------------------------------------------------------------------ readers
    def _released(self, raw: bytes | None = None, *, fetch: bool = True) -> int:
        if raw is None and fetch:
            raw = self._get(self._k("released"))
        return 0 if raw is None else stored_int(raw, where=f"store {self.url}: key {self._k('released')}",
                                                field="released")

    def wait_rollout(self, rollout: int, timeout: float | None = None) -> bool:
        check_rollout(rollout)
        key = self._k("r", rollout, "commit")
        deadline = None if timeout is None else time.monotonic() + timeout

        def check() -> bool | None:
            def probe() -> tuple[Any, ...]:
                pipe = self.client.pipeline(transaction=False)
                pipe.exists(key)
                pipe.get(self._k("finished"))
                pipe.get(self._k("released"))
                pipe.get(self._k("epoch"))
                return tuple(pipe.execute())

            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            retry = self.retry_seconds if left is None else min(self.retry_seconds, left)
            try:
                exists, finished, released, epoch = self._retry(probe, key, retry_seconds=retry)
            except StoreError as exc:
                if isinstance(exc.__cause__, self._transient) and deadline is not None and time.monotonic() >= deadline:
                    return None  # unreachable until our own timeout: report the timeout below
                raise
            self._probe_epoch(epoch)
            if exists:
                return True
            if rollout < self._released(released, fetch=False):
                raise RolloutReleased(f"store {self.url}: rollout {rollout} was released (deleted) after every rank acked it")
            done = self._finished(finished)
            if done is not None and rollout >= done:
                return False
            return None

        return poll(check, timeout, f"rollout {rollout} in store {self.url} (key {key})", max_interval=0.1)

    def _require_committed(self, rollout: int) -> Marker:
        key = self._k("r", check_rollout(rollout), "commit")
        marker = self._marker(self._get(key), rollout)
        if marker is None:
            self.epoch()
            raise StoreError(f"store {self.url}: rollout {rollout} is not committed (key {key}); wait_rollout first")
        if marker.rollout != rollout:
            raise CorruptPayload(f"store {self.url}: key {key}: commit marker names rollout {marker.rollout}")
        return marker

    def _gone(self, rollout: int, key: str) -> StoreError:
        """A committed rollout's part is missing: released meanwhile, or the store lost it (e.g. evicted)."""
        self.epoch()
        if rollout < self._released() or not self.is_committed(rollout):
            return RolloutReleased(f"store {self.url}: rollout {rollout} was released (deleted) while being read")
        return lost(self.url, f"rollout {rollout} is committed but key {key} is missing")

    def payload_key(self, rollout: int, rank: int) -> str:
        """The key of the committed payload of `rank` (for tools and tests)."""
        return self._payload_key(rollout, self._require_committed(rollout).attempt, rank)

    def read_schedule(self, rollout: int) -> dict[str, Any]:
        marker = self._require_committed(rollout)
        key = self._k("r", rollout, "schedule")
        data = self._get(key)
        if data is None:
            raise self._gone(rollout, key)
        where = f"store {self.url}: key {key}"
        marker.check_schedule(data, where=where)
        value = decode_json(data, where=where)
        if not isinstance(value, dict):
            raise CorruptPayload(f"{where}: the schedule is not a JSON object")
        return value

    def read_payload(self, rollout: int, rank: int) -> RankPayload:
        marker = self._require_committed(rollout)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < marker.dp_size:
            raise StoreError(f"store {self.url}: rollout {rollout} has no payload for rank {rank!r} (dp_size "
                             f"{marker.dp_size})")
        key = self._payload_key(rollout, marker.attempt, rank)
        data = self._get(key)
        if data is None:
            raise self._gone(rollout, key)
        return decode_payload(data, where=f"store {self.url}: key {key}")

    def ack(self, rollout: int, rank: int) -> None:
        key = self._k("r", check_rollout(rollout), "acks")

        def fill(pipe: Any) -> None:
            pipe.multi()
            pipe.sadd(key, rank)

        self._guarded(f"acknowledging rollout {rollout}", key, fill)

    def release_upto(self, rollout: int) -> None:
        check_rollout(rollout)
        key = self._k("committed")
        members = self._retry(lambda: self.client.zrangebyscore(key, 0, rollout - 1), key)
        ks = [stored_int(m, where=f"store {self.url}: key {key}", field="member") for m in members]
        upto = rollout
        for k in ks:
            marker = self._marker(self._get(self._k("r", k, "commit")), k)
            acks = self._retry(lambda: self.client.scard(self._k("r", k, "acks")), self._k("r", k, "acks"))
            if marker is None or acks < marker.dp_size:
                upto = min(upto, k)
                continue
            parts_key = self._k("r", k, "parts")
            parts = self._retry(lambda: self.client.smembers(parts_key), parts_key)

            def delete(pipe: Any, k: int = k, parts: set = parts, parts_key: str = parts_key) -> None:
                pipe.multi()
                pipe.delete(self._k("r", k, "commit"))  # invisible first
                pipe.zrem(self._k("committed"), str(k))
                pipe.delete(self._k("r", k, "schedule"), self._k("r", k, "acks"), parts_key, *parts)

            self._guarded(f"releasing rollout {k}", self._k("r", k, "*"), delete)
        rkey = self._k("released")

        def mark(pipe: Any) -> None:
            released = self._released(pipe.get(rkey), fetch=False)
            pipe.multi()
            pipe.set(rkey, max(upto, released))

        self._guarded(f"releasing rollouts below {rollout}", rkey, mark, watch=(rkey,))

    # ------------------------------------------------------------------ weights
    def _chunk_key(self, version: int, attempt: int | None, i: int) -> str:
        return self._k("w", version, f"a{attempt or 0}", "c", i)

    def publish_weights(self, version: int, arrays: dict[str, Any], meta: dict[str, Any], *,
                        _after_tensors=None) -> bool:
        """Publish weight version `version` atomically (chunks under this attempt, then meta + marker + index in one
        guarded transaction: a trainer of an older attempt is refused); False (nothing written) when committed.

        `_after_tensors` is a test hook called after the chunks are written, before the commit transaction."""
        check_weights(version, arrays, meta)
        ckey, parts_key = self._k("w", version, "commit"), self._k("w", version, "parts")
        if self._retry(lambda: self.client.exists(ckey), ckey):
            return False
        meta_bytes = encode_json(meta, where="meta")
        self._guarded(f"publishing weight version {version}", ckey, lambda pipe: False)
        data = memoryview(b"".join(encode_arrays_parts(arrays)))
        chunks = max(1, -(-len(data) // WEIGHT_CHUNK_BYTES))
        for i in range(chunks):
            key = self._chunk_key(version, self.attempt, i)
            piece = data[i * WEIGHT_CHUNK_BYTES : (i + 1) * WEIGHT_CHUNK_BYTES]

            def put(key: str = key, piece: memoryview = piece) -> None:
                pipe = self.client.pipeline(transaction=False)
                pipe.sadd(parts_key, key)
                pipe.set(key, piece.tobytes())
                pipe.execute()

            self._retry(put, key)
        if _after_tensors is not None:
            _after_tensors()
        marker = WeightsMarker.for_meta(version, self.attempt, len(data), chunks, meta_bytes)

        def commit(pipe: Any) -> bool | None:
            if pipe.exists(ckey):
                return False  # committed meanwhile (a replayed transaction after a lost reply)
            pipe.multi()
            pipe.set(self._k("w", version, "meta"), meta_bytes)
            pipe.set(ckey, marker.encode())
            pipe.zadd(self._k("weights"), {str(version): version})
            return None

        result = self._guarded(f"committing weight version {version}", ckey, commit, watch=(ckey,))
        return result is not False

    def _weight_members(self, key: str, raw: list[Any]) -> list[int]:
        return [stored_int(m, where=f"store {self.url}: key {key}", field="member") for m in raw]

    def latest_weights(self) -> int | None:
        key = self._k("weights")
        self.epoch()
        top = self._weight_members(key, self._retry(lambda: self.client.zrevrange(key, 0, 0), key))
        return top[0] if top else None

    def _weights_gone(self, version: int, key: str) -> StoreError:
        self.epoch()
        if not self._retry(lambda: self.client.exists(self._k("w", version, "commit")), key):
            return StoreError(f"store {self.url}: weight version {version} was released while being read")
        return lost(self.url, f"weight version {version} is committed but key {key} is missing")

    def read_weights(self, version: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(arrays, meta) of a committed version, every piece checked (marker, meta CRC, size, header, checksums);
        StoreError when it is not (or no longer) committed, CorruptPayload naming the key when damaged."""
        check_rollout(version, "version")
        ckey, mkey = self._k("w", version, "commit"), self._k("w", version, "meta")

        def probe() -> tuple[Any, Any]:
            pipe = self.client.pipeline(transaction=False)
            pipe.get(ckey)
            pipe.get(mkey)
            return tuple(pipe.execute())

        raw, meta_bytes = self._retry(probe, ckey)
        if raw is None:
            self.epoch()
            raise StoreError(f"store {self.url}: weight version {version} is not committed (key {ckey})")
        marker = WeightsMarker.decode(raw, where=f"store {self.url}: key {ckey}")
        if marker.version != version:
            raise CorruptPayload(f"store {self.url}: key {ckey}: commit marker names version {marker.version}")
        if meta_bytes is None:
            raise self._weights_gone(version, mkey)
        marker.check_meta(meta_bytes, where=f"store {self.url}: key {mkey}")
        meta = decode_json(meta_bytes, where=f"store {self.url}: key {mkey}")
        if not isinstance(meta, dict):
            raise CorruptPayload(f"store {self.url}: key {mkey}: weight meta is not a JSON object")
        keys = [self._chunk_key(version, marker.attempt, i) for i in range(marker.chunks)]

        def fetch() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            return pipe.execute()

        pieces = self._retry(fetch, keys[0])
        for key, piece in zip(keys, pieces):
            if piece is None:
                raise self._weights_gone(version, key)
        data = b"".join(pieces)
        where = f"store {self.url}: key {self._chunk_key(version, marker.attempt, '*')}"
        if len(data) != marker.nbytes:
            raise CorruptPayload(f"{where}: {len(data)} bytes stored, its commit marker records {marker.nbytes}")
        return decode_arrays(data, where=where), meta

    def release_weights_below(self, version: int) -> None:
        """Delete committed versions < `version` (commit marker first: a reader never sees half a version);
        fenced like every write."""
        check_rollout(version, "version")
        key = self._k("weights")
        old = self._weight_members(key, self._retry(lambda: self.client.zrangebyscore(key, 0, version - 1), key))
        for v in old:
            parts_key = self._k("w", v, "parts")
            parts = self._retry(lambda: self.client.smembers(parts_key), parts_key)

            def delete(pipe: Any, v: int = v, parts: set = parts, parts_key: str = parts_key) -> None:
                pipe.multi()
                pipe.delete(self._k("w", v, "commit"))  # invisible first
                pipe.zrem(self._k("weights"), str(v))
                pipe.delete(self._k("w", v, "meta"), parts_key, *parts)

            self._guarded(f"releasing weight version {v}", self._k("w", v, "*"), delete)
        if not old:  # nothing to delete: still refuse a fenced-off caller, like every write
            self._guarded(f"releasing weight versions below {version}", key, lambda pipe: False)

    # ------------------------------------------------------------------ shared state
    def put_json(self, key: str, value: dict[str, Any]) -> None:
        rkey = self._k("kv", check_key(key))
        data = encode_json(value, where=f"put_json({key!r})")

        def fill(pipe: Any) -> None:
            pipe.multi()
            pipe.set(rkey, data)

        self._guarded(f"writing {key}", rkey, fill)

    def get_json(self, key: str) -> dict[str, Any] | None:
        return self._get_json(self._k("kv", check_key(key)))

    def close(self) -> None:
        """Stop renewing and release the writer claim if this handle still holds it; close the connection."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
            self._renewer = None
        owner, self._owner = self._owner, None
        if owner is not None:
            w_key = self._k("writer")
            try:
                with self.client.pipeline(transaction=True) as pipe:
                    pipe.watch(w_key)
                    raw = pipe.get(w_key)
                    if raw is not None and Owner.from_json(decode_json(raw, where=w_key), where=w_key).token == owner.token:
                        pipe.multi()
                        pipe.delete(w_key)
                        pipe.execute()
            except Exception:  # noqa: BLE001 - best effort: the lease runs out by itself
                pass
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing a dead connection
            pass

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r})"
