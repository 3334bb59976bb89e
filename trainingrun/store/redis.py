"""`redis://host:port/db` store (redis-py), the cluster default.

Keys (prefix P = "trainingrun", or `?prefix=NAME` in the URL, so several runs can share one server):

    P:epoch                 {"id", "created", "host"}: set once, by the first write (inside its transaction)
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
    P:w:<v>:a<N>:p:<o0001-000003>:<i>  a version in parts (`store/parts.py`): piece i of owner 1's part 3
    P:w:<v>:a<N>:o:<owner>  that owner's record (its parts, its meta, or its error)
                            (both in P:w:<v>:parts; P:w:<v>:meta then holds the parts index the marker commits)
    P:wparts                sorted set of the versions parts were written for (committed or not): release's list
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
writes, the rollout's engine reads) follow the same protocol (`_publish`), fenced by the epoch and the attempt (no
writer claim: the trainer is not the rollout writer). A release deletes every releasable rollout (or version) in
one guarded transaction, commit markers first. A version in parts: each owner SETs its parts' pieces and its record
under its attempt (each recorded in the `parts` set, the version in `P:wparts`); the committing rank reads the records
and the pieces' sizes in one round trip each (`parts.parts_plan`) and commits the index as a weight version's meta, or,
when an owner failed, deletes this attempt's keys of the version and raises `IncompleteWeights` naming it.

This module lays the keys out and performs the I/O, each call in one round trip where it can (pipelines; retries,
transactions and the lease thread: `redis_io.py`); every decision is a rule of `common.py`, the same the file backend
follows. `wait_rollout` keeps polling through a server restart until its own timeout; a server that comes back
without its data is `StoreDataLost`. URL options: `?prefix=NAME`, `?retry_seconds=60` (how long transient errors are
retried), `?lease_seconds=30` (the writer claim's lease).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from trainingrun.contract.errors import StoreError
from trainingrun.contract.payload import RankPayload
from trainingrun.store import common
from trainingrun.store import parts as _parts
from trainingrun.store.base import IncompleteWeights
from trainingrun.store.redis_io import Connection, Lease, url_options
from trainingrun.store.wire import (decode_arrays, decode_json, decode_payload, encode_arrays_parts, encode_json,
                                    encode_payload_parts)

MAX_VALUE_BYTES = 512 * 1024 * 1024  # Redis' limit of one string value
WEIGHT_CHUNK_BYTES = 64 * 1024 * 1024  # weights are stored in pieces of this size (any model size fits)


class RedisStore:
    """A Store on a Redis server. See the module docstring for keys, atomicity, fencing and retries."""

    def __init__(self, url: str, *, prefix: str = "trainingrun", retry_seconds: float = 60.0, socket_timeout: float = 30,
                 lease_seconds: float = 30.0, attempt: int | None = None):
        self.url = url
        self.prefix = prefix
        self.lease_seconds = lease_seconds
        self.attempt = common.check_attempt(attempt)
        self._conn = Connection(url, retry_seconds=retry_seconds, socket_timeout=socket_timeout)
        self._epoch: str | None = None  # the epoch id this handle has seen
        self._owner: common.Owner | None = None  # our writer claim, while held
        self._lost_claim: common.Owner | None = None  # who took the claim from us (seen by the lease thread)
        self._lease: Lease | None = None

    @classmethod
    def from_url(cls, url: str, *, attempt: int | None = None) -> RedisStore:
        return cls(url, attempt=attempt, **url_options(url))

    @property
    def client(self) -> Any:
        """The redis-py client (for tools and tests)."""
        return self._conn.client

    @property
    def retry_seconds(self) -> float:
        """How long transient errors are retried (a reader that must not wait, the operator, lowers it)."""
        return self._conn.retry_seconds

    @retry_seconds.setter
    def retry_seconds(self, value: float) -> None:
        self._conn.retry_seconds = value

    # ------------------------------------------------------------------ keys
    def _k(self, *parts: object) -> str:
        return ":".join([self.prefix, *map(str, parts)])

    def _payload_key(self, rollout: int, attempt: int | None, rank: int) -> str:
        return self._k("r", rollout, f"a{attempt or 0}", "p", rank)

    def _chunk_key(self, version: int, attempt: int | None, i: int | str) -> str:
        return self._k("w", version, f"a{attempt or 0}", "c", i)

    def _where(self, key: str) -> str:
        return f"store {self.url}: key {key}"

    def _get(self, key: str) -> bytes | None:
        return self._conn.call(key, "get", key)

    def _members(self, key: str, raw: list[Any]) -> list[int]:
        return [common.stored_int(m, where=self._where(key), field="member") for m in raw]

    # ------------------------------------------------------------------ fencing
    def _adopt(self, raw: bytes | None) -> str | None:
        """Check the epoch's stored value against the one this handle saw (StoreDataLost when it vanished or
        changed); adopt it when this handle saw none yet. Returns the id."""
        found = common.epoch_id(raw, self._epoch, url=self.url, where=f"key {self._k('epoch')}")
        self._epoch = self._epoch or found
        return self._epoch

    def _owner_from(self, raw: bytes | None) -> common.Owner | None:
        where = self._where(self._k("writer"))
        return None if raw is None else common.Owner.from_json(decode_json(raw, where=where), where=where)

    def _guarded(self, op: str, key: str, fill: Any, *, writer: bool = False, watch: tuple[str, ...] = ()) -> Any:
        """Run `fill(pipe)` (queueing commands on a MULTI pipeline) as one transaction that commits only if the
        epoch, the current attempt and (with `writer`) the writer claim pass their checks when it commits; `fill`
        may return `False` to skip the transaction (it then sees the watched keys' immediate values)."""
        e_key, a_key, w_key = self._k("epoch"), self._k("attempt"), self._k("writer")

        def body(pipe: Any, values: list[Any]) -> Any:
            epoch, current, claim = values[:3]
            found = common.epoch_id(epoch, self._epoch, url=self.url, where=f"key {e_key}")
            common.check_current(self.attempt, None if current is None else common.stored_int(
                current, where=self._where(a_key), field="attempt"), url=self.url, op=op)
            if writer:
                common.check_writer(self._owner_from(claim), self._owner or common.Owner.me(self.attempt),
                                    held=self._owner is not None, url=self.url, op=op, lost_to=self._lost_claim)
            if fill(pipe) is False:
                pipe.unwatch()
                return False
            if found is None:  # the store's first write gives it its epoch
                found = (epoch := common.new_epoch())["id"]
                pipe.set(e_key, encode_json(epoch))
            result = pipe.execute()
            self._epoch = self._epoch or found
            return result

        return self._conn.transaction(key, (e_key, a_key, w_key, *watch), body)

    def _write(self, op: str, key: str, *commands: tuple[Any, ...], writer: bool = False) -> None:
        """`commands` ((name, *args), ...) as one guarded transaction (see `_guarded`)."""
        def fill(pipe: Any) -> None:
            pipe.multi()
            for name, *args in commands:
                getattr(pipe, name)(*args)

        self._guarded(op, key, fill, writer=writer)

    def enter_attempt(self) -> int:
        attempt = common.require_attempt(self.attempt)
        self._write("opening the store", self._k("attempt"), ("set", self._k("attempt"), attempt))
        return attempt

    def claim_writer(self) -> dict[str, Any]:
        me = self._owner or common.Owner.me(self.attempt)
        w_key = self._k("writer")

        def fill(pipe: Any) -> None:
            common.may_claim(self._owner_from(pipe.get(w_key)), me, url=self.url)  # raises unless `me` may (re)claim
            pipe.multi()
            if self.attempt is not None:
                pipe.set(self._k("attempt"), self.attempt)
            pipe.set(w_key, encode_json(me.to_json()), px=int(self.lease_seconds * 1000))

        # the writer check is `common.may_claim` in `fill` (it may take over an older attempt's claim)
        self._guarded("claiming the writer", w_key, fill)
        self._owner = me
        self._lost_claim = None
        if self._lease is None:
            self._lease = Lease(self._renew, self.lease_seconds)
        return me.to_json()

    def _renew(self) -> None:
        """Keep our claim alive: extend its lease; re-claim it if the lease ran out (server away for a while) and
        nobody took it; remember who did if someone did (the next writer operation then fails)."""
        owner, w_key, e_key = self._owner, self._k("writer"), self._k("epoch")
        if owner is None:
            return

        def body(pipe: Any, values: list[Any]) -> None:
            common.epoch_id(values[1], self._epoch, url=self.url, where=f"key {e_key}")
            current = self._owner_from(values[0])
            if current is not None and not common.holds(current, owner):
                self._lost_claim = current
                pipe.unwatch()
                return
            pipe.multi()
            pipe.set(w_key, encode_json(owner.to_json()), px=int(self.lease_seconds * 1000))
            pipe.execute()

        self._conn.transaction(w_key, (w_key, e_key), body, retry=False)

    def writer(self) -> dict[str, Any] | None:
        """The current writer claim's owner record (None when nobody holds one)."""
        owner = self._owner_from(self._get(self._k("writer")))
        return None if owner is None else owner.to_json()

    def epoch(self) -> str | None:
        """The store's epoch id (None before the store was first written); StoreDataLost if it changed."""
        return self._adopt(self._get(self._k("epoch")))

    # ------------------------------------------------------------------ writer
    def is_committed(self, rollout: int) -> bool:
        key = self._k("r", common.check_rollout(rollout), "commit")
        return bool(self._conn.call(key, "exists", key))

    def _publish(self, what: str, base: tuple[Any, ...], pieces: Iterator[tuple[str, bytes]], doc: tuple[str, bytes],
                 marker: bytes, index: tuple[str, int], *, writer: bool, hook: Callable[[], None] | None) -> bool:
        """The commit protocol of rollouts and weight versions (keys `P:<base>:...`): False (nothing written) when
        committed; else the fencing checks, each piece SET under this attempt's key (and recorded in the `parts` set,
        deleted on release), `hook()` (tests), then the document (schedule / meta), the commit `marker` and the
        `index` entry in one guarded transaction (False when someone committed meanwhile: theirs stands)."""
        ckey, parts_key = self._k(*base, "commit"), self._k(*base, "parts")
        if self._conn.call(ckey, "exists", ckey):
            return False
        self._guarded(f"publishing {what}", ckey, lambda pipe: False, writer=writer)
        for key, data in pieces:
            self._conn.batch(key, ("sadd", parts_key, key), ("set", key, data))
        if hook is not None:
            hook()

        def commit(pipe: Any) -> bool | None:
            if pipe.exists(ckey):
                return False  # committed meanwhile (a replayed transaction after a lost reply, or another writer)
            pipe.multi()
            pipe.set(self._k(*base, doc[0]), doc[1])
            pipe.set(ckey, marker)
            pipe.zadd(self._k(index[0]), {str(index[1]): index[1]})
            return None

        return self._guarded(f"committing {what}", ckey, commit, writer=writer, watch=(ckey,)) is not False

    def publish_rollout(
        self, rollout: int, payloads: dict[int, RankPayload], schedule: dict[str, Any], *, _after_payloads=None
    ) -> bool:
        """Publish atomically; returns False (and writes nothing) if the rollout is already committed.

        `_after_payloads` is a test hook called after the payloads are written, before the commit transaction.
        """
        schedule_bytes, marker = common.publish_plan(rollout, payloads, schedule, self.attempt)

        def pieces() -> Iterator[tuple[str, bytes]]:  # encoded one at a time, after the fencing checks
            for rank in range(marker.dp_size):
                key = self._payload_key(rollout, self.attempt, rank)
                data = b"".join(encode_payload_parts(payloads[rank]))
                if len(data) > MAX_VALUE_BYTES:
                    raise StoreError(f"store {self.url}: key {key}: payload of {len(data)} bytes exceeds Redis' 512 "
                                     "MiB value limit; use more data-parallel ranks or fewer samples per rollout")
                yield key, data

        return self._publish(f"rollout {rollout}", ("r", rollout), pieces(), ("schedule", schedule_bytes),
                             marker.encode(), ("committed", rollout), writer=True, hook=_after_payloads)

    def finish(self, num_rollouts: int) -> None:
        key = self._k("finished")
        value = encode_json({"num_rollouts": common.check_rollout(num_rollouts, "num_rollouts")})
        self._write("finishing the stream", key, ("set", key, value), writer=True)

    def _finished(self, raw: bytes | None) -> int | None:
        where = self._where(self._k("finished"))
        value = None if raw is None else decode_json(raw, where=where)
        return None if value is None else common.stored_count(value, where=where, field="num_rollouts")

    def finished(self) -> int | None:
        return self._finished(self._get(self._k("finished")))

    def _ledger(self, below: int | None = None, *, parts: bool = False) -> tuple[common.Ledger, list[set[bytes]]]:
        """The committed rollouts (those below `below`) with their markers and how many ranks acked each, and with
        `parts` the payload keys written for each; two pipelined round trips, the epoch checked on the first."""
        key = self._k("committed")

        epoch, members = self._conn.batch(key, ("get", self._k("epoch")),
                                          ("zrangebyscore", key, 0, "+inf" if below is None else below - 1))
        self._adopt(epoch)
        ks = self._members(key, members)
        fields = [("get", "commit"), ("scard", "acks")] + ([("smembers", "parts")] if parts else [])
        res = self._conn.batch(key, *[(op, self._k("r", k, name)) for k in ks for op, name in fields]) if ks else []
        n = 3 if parts else 2
        ledger = [(k, self._marker(res[n * i], k), res[n * i + 1]) for i, k in enumerate(ks)]
        return ledger, [res[n * i + 2] for i in range(len(ks))] if parts else []

    def _marker(self, raw: bytes | None, rollout: int) -> common.Marker | None:
        return None if raw is None else common.Marker.decode(raw, where=self._where(self._k("r", rollout, "commit")))

    def pending_rollouts(self) -> int:
        return common.pending_count(self._ledger()[0])

    # ------------------------------------------------------------------ readers
    def _released(self, raw: bytes | None) -> int:
        return 0 if raw is None else common.stored_count(raw, where=self._where(self._k("released")), field="released")

    def wait_rollout(self, rollout: int, timeout: float | None = None) -> bool:
        key = self._k("r", common.check_rollout(rollout), "commit")
        deadline = None if timeout is None else time.monotonic() + timeout

        def check() -> bool | None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            retry = self.retry_seconds if left is None else min(self.retry_seconds, left)
            try:
                exists, finished, released, epoch = self._conn.batch(
                    key, ("exists", key), ("get", self._k("finished")), ("get", self._k("released")),
                    ("get", self._k("epoch")), retry_seconds=retry)
            except StoreError as exc:
                out_of_time = deadline is not None and time.monotonic() >= deadline
                if isinstance(exc.__cause__, self._conn.transient) and out_of_time:
                    return None  # unreachable until our own timeout: report the timeout below
                raise
            self._adopt(epoch)
            return common.wait_verdict(rollout, committed=bool(exists), released=lambda: self._released(released),
                                       finished=lambda: self._finished(finished), url=self.url)

        return common.poll(check, timeout, f"rollout {rollout} in store {self.url} (key {key})", max_interval=0.1)

    def _require_committed(self, rollout: int) -> common.Marker:
        key = self._k("r", common.check_rollout(rollout), "commit")
        raw = self._get(key)
        if raw is None:
            self.epoch()  # a store that lost its data says so, not "not committed"
        return common.committed_marker(raw, rollout, url=self.url, where=f"key {key}")

    def _gone(self, rollout: int, key: str) -> StoreError:
        """A committed rollout's part is missing: released meanwhile, or the store lost it (e.g. evicted)."""
        self.epoch()
        released, exists = self._conn.batch(key, ("get", self._k("released")),
                                            ("exists", self._k("r", rollout, "commit")))
        return common.part_missing(rollout, f"key {key}", released=self._released(released), committed=bool(exists),
                                   url=self.url)

    def payload_key(self, rollout: int, rank: int) -> str:
        """The key of the committed payload of `rank` (for tools and tests)."""
        return self._payload_key(rollout, self._require_committed(rollout).attempt, rank)

    def read_schedule(self, rollout: int) -> dict[str, Any]:
        marker = self._require_committed(rollout)
        key = self._k("r", rollout, "schedule")
        data = self._get(key)
        if data is None:
            raise self._gone(rollout, key)
        return common.committed_json(marker, data, where=self._where(key))

    def read_payload(self, rollout: int, rank: int) -> RankPayload:
        marker = self._require_committed(rollout)
        key = self._payload_key(rollout, marker.attempt, common.payload_rank(marker, rank, url=self.url))
        data = self._get(key)
        if data is None:
            raise self._gone(rollout, key)
        return decode_payload(data, where=self._where(key))

    def ack(self, rollout: int, rank: int) -> None:
        key = self._k("r", common.check_rollout(rollout), "acks")
        self._write(f"acknowledging rollout {rollout}", key, ("sadd", key, rank))

    def release_upto(self, rollout: int) -> None:
        """One guarded transaction deletes every releasable rollout (commit marker first) and raises the mark."""
        common.check_rollout(rollout)
        rkey = self._k("released")
        ledger, parts = self._ledger(below=rollout, parts=True)

        def fill(pipe: Any) -> bool | None:
            delete, upto = common.release_plan(rollout, ledger, self._released(pipe.get(rkey)))
            if not delete and upto is None:
                return False
            pipe.multi()
            for (k, _, _), keys in zip(ledger, parts):
                if k in delete:
                    pipe.delete(self._k("r", k, "commit"))  # invisible first
                    pipe.zrem(self._k("committed"), str(k))
                    pipe.delete(self._k("r", k, "schedule"), self._k("r", k, "acks"), self._k("r", k, "parts"), *keys)
            if upto is not None:
                pipe.set(rkey, upto)
            return None

        self._guarded(f"releasing rollouts below {rollout}", rkey, fill, watch=(rkey,))

    # ------------------------------------------------------------------ weights
    def publish_weights(self, version: int, arrays: dict[str, Any], meta: dict[str, Any], *,
                        _after_tensors=None) -> bool:
        """Publish weight version `version` atomically (chunks under this attempt, then meta + marker + index in one
        guarded transaction: a trainer of an older attempt is refused); False (nothing written) when committed.

        `_after_tensors` is a test hook called after the chunks are written, before the commit transaction."""
        common.check_weights(version, arrays, meta)
        if self._conn.call(self._k("w", version, "commit"), "exists", self._k("w", version, "commit")):
            return False  # before encoding: a re-publish of a committed version costs nothing
        parts, meta_bytes, marker = common.weights_plan(version, arrays, meta, self.attempt,
                                                        piece_bytes=WEIGHT_CHUNK_BYTES)
        data, size = memoryview(b"".join(parts)), WEIGHT_CHUNK_BYTES
        pieces = ((self._chunk_key(version, self.attempt, i), data[i * size : (i + 1) * size].tobytes())
                  for i in range(marker.chunks))
        return self._publish(f"weight version {version}", ("w", version), pieces, ("meta", meta_bytes),
                             marker.encode(), ("weights", version), writer=False, hook=_after_tensors)

    def _own_keys(self, version: int) -> list[bytes]:
        """This attempt's keys of weight version `version` (parts and records of a publish not committed)."""
        mine = self._k("w", version, f"a{self.attempt or 0}", "").encode()
        parts_key = self._k("w", version, "parts")
        return [k for k in self._conn.call(parts_key, "smembers", parts_key) if bytes(k).startswith(mine)]

    def _drop_own(self, version: int) -> None:
        keys = self._own_keys(version)
        if keys:
            parts_key = self._k("w", version, "parts")
            self._conn.batch(parts_key, ("delete", *keys), ("srem", parts_key, *keys))

    def begin_weights(self, version: int) -> bool:
        ckey = self._k("w", common.check_rollout(version, "version"), "commit")
        if self._conn.call(ckey, "exists", ckey):
            return False
        self._guarded(f"publishing weight version {version}", ckey, lambda pipe: False)
        self._drop_own(version)  # a publish of this attempt that never committed
        return True

    def _set_pieces(self, version: int, pieces: list[tuple[str, bytes | memoryview]]) -> None:
        """SET each (key, value), recorded in the version's parts set and the version in `wparts` (release's list)."""
        parts_key = self._k("w", version, "parts")
        for key, data in pieces:
            self._conn.batch(key, ("sadd", parts_key, key), ("zadd", self._k("wparts"), {str(version): version}),
                             ("set", key, data))

    def write_weights_part(self, version: int, owner: int, index: int, arrays: dict[str, Any]) -> dict[str, Any]:
        _parts.check_part(version, owner, index, arrays)
        name = _parts.part_name(owner, index)
        data = memoryview(b"".join(encode_arrays_parts(arrays)))
        size = WEIGHT_CHUNK_BYTES
        chunks = max(1, -(-data.nbytes // size))
        self._guarded(f"publishing weight version {version}", self._k("w", version, "commit"), lambda pipe: False)
        self._set_pieces(version, [(self._part_key(version, self.attempt, name, i), data[i * size:(i + 1) * size])
                                   for i in range(chunks)])
        return {"name": name, "nbytes": data.nbytes, "chunks": chunks}

    def _part_key(self, version: int, attempt: int | None, name: str, i: int | str) -> str:
        return self._k("w", version, f"a{attempt or 0}", "p", name, i)

    def write_weights_owner(self, version: int, owner: int, *, parts: list[dict[str, Any]] | None = None,
                            meta: dict[str, Any] | None = None, error: str | None = None) -> None:
        data = _parts.owner_record(version, owner, parts, meta, error)
        self._guarded(f"publishing weight version {version}", self._k("w", version, "commit"), lambda pipe: False)
        self._set_pieces(version, [(self._k("w", version, f"a{self.attempt or 0}", "o", owner), data)])

    def commit_weights(self, version: int, owners: int, meta: dict[str, Any]) -> bool:
        ckey = self._k("w", common.check_rollout(version, "version"), "commit")
        if self._conn.call(ckey, "exists", ckey):
            return False
        rkeys = [self._k("w", version, f"a{self.attempt or 0}", "o", o) for o in range(owners)]
        records = self._conn.batch(ckey, *[("get", k) for k in rkeys]) if rkeys else []
        named = [p for raw in records if raw is not None for p in _named_parts(raw)]
        keys = [self._part_key(version, self.attempt, p["name"], i) for p in named for i in range(p["chunks"])]
        lengths = iter(self._conn.batch(ckey, *[("strlen", k) for k in keys]) if keys else [])
        sizes = {}
        for p in named:  # a missing piece has length 0: the part is then missing
            got = [next(lengths) for _ in range(p["chunks"])]
            sizes[p["name"]] = sum(got) if all(got) else None
        try:
            index, marker = _parts.parts_plan(version, records, meta, self.attempt, url=self.url,
                                              stored=lambda p: sizes.get(p["name"]))
        except IncompleteWeights:
            self._drop_own(version)  # the failed publish's parts: never committed
            raise
        return self._publish(f"weight version {version}", ("w", version), iter(()), ("meta", index),
                             marker.encode(), ("weights", version), writer=False, hook=None)

    def latest_weights(self) -> int | None:
        key = self._k("weights")
        self.epoch()
        top = self._members(key, self._conn.call(key, "zrevrange", key, 0, 0))
        return top[0] if top else None

    def _weights_gone(self, version: int, key: str) -> StoreError:
        self.epoch()
        committed = self._conn.call(key, "exists", self._k("w", version, "commit"))
        return common.weights_missing(version, f"key {key}", committed=bool(committed), url=self.url)

    def read_weights(self, version: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(arrays, meta) of a committed version, every piece checked (marker, meta CRC, size, header, checksums);
        StoreError when it is not (or no longer) committed, CorruptPayload naming the key when damaged."""
        ckey, mkey = self._k("w", common.check_rollout(version, "version"), "commit"), self._k("w", version, "meta")
        raw, meta_bytes = self._conn.batch(ckey, ("get", ckey), ("get", mkey))
        if raw is None:
            self.epoch()
        marker = common.committed_weights(raw, version, url=self.url, where=f"key {ckey}")
        if meta_bytes is None:
            raise self._weights_gone(version, mkey)
        if marker.parts:
            return self._read_parts(version, marker, meta_bytes)
        meta = common.committed_json(marker, meta_bytes, where=self._where(mkey))
        keys = [self._chunk_key(version, marker.attempt, i) for i in range(marker.chunks)]
        pieces = self._conn.batch(keys[0], *[("get", key) for key in keys])
        for key, piece in zip(keys, pieces):
            if piece is None:
                raise self._weights_gone(version, key)
        data = b"".join(pieces)
        where = self._where(self._chunk_key(version, marker.attempt, "*"))
        common.check_weights_size(len(data), marker, where=where)
        return decode_arrays(data, where=where), meta

    def _read_parts(self, version: int, marker: common.WeightsMarker, index: bytes) -> tuple[dict, dict[str, Any]]:
        """A version in parts, assembled: the index (checked against the marker), then every part (its pieces in
        one round trip), each checked (size, header, checksums); no array in two parts."""
        meta, described = _parts.committed_parts(marker, index, where=self._where(self._k("w", version, "meta")))
        arrays: dict[str, Any] = {}
        for part in described:
            keys = [self._part_key(version, marker.attempt, part["name"], i) for i in range(part["chunks"])]
            pieces = self._conn.batch(keys[0], *[("get", key) for key in keys])
            for key, piece in zip(keys, pieces):
                if piece is None:
                    raise self._weights_gone(version, key)
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            where = self._where(self._part_key(version, marker.attempt, part["name"], "*"))
            _parts.check_part_size(len(data), part, where=where)
            _parts.join_part(arrays, decode_arrays(data, where=where), where=where)
        return arrays, meta

    def release_weights_below(self, version: int) -> None:
        """Delete weight versions < `version` in one transaction: the committed ones (commit marker first: a reader
        never sees half a version) with their parts, and the parts of those never committed (`wparts`: a publish
        that failed or died); fenced like every write (a fenced-off caller is refused even when nothing is to
        delete)."""
        common.check_rollout(version, "version")
        key, wparts = self._k("weights"), self._k("wparts")
        committed, written = self._conn.batch(key, ("zrangebyscore", key, 0, version - 1),
                                              ("zrangebyscore", wparts, 0, version - 1))
        old = sorted(set(self._members(key, committed)) | set(self._members(wparts, written)))
        parts = self._conn.batch(key, *[("smembers", self._k("w", v, "parts")) for v in old]) if old else []

        def fill(pipe: Any) -> bool | None:
            if not old:
                return False
            pipe.multi()
            for v, keys in zip(old, parts):
                pipe.delete(self._k("w", v, "commit"))  # invisible first
                pipe.zrem(key, str(v))
                pipe.zrem(wparts, str(v))
                pipe.delete(self._k("w", v, "meta"), self._k("w", v, "parts"), *keys)
            return None

        self._guarded(f"releasing weight versions below {version}", key, fill)

    # ------------------------------------------------------------------ shared state
    def put_json(self, key: str, value: dict[str, Any]) -> None:
        rkey = self._k("kv", common.check_key(key))
        data = encode_json(value, where=f"put_json({key!r})")
        self._write(f"writing {key}", rkey, ("set", rkey, data))

    def get_json(self, key: str) -> dict[str, Any] | None:
        rkey = self._k("kv", common.check_key(key))
        data = self._get(rkey)
        return None if data is None else decode_json(data, where=self._where(rkey))

    def close(self) -> None:
        """Stop renewing and release the writer claim if this handle still holds it; close the connection."""
        if self._lease is not None:
            self._lease.stop()
            self._lease = None
        owner, self._owner = self._owner, None
        w_key = self._k("writer")

        def release(pipe: Any, values: list[Any]) -> None:
            if common.holds(self._owner_from(values[0]), owner):
                pipe.multi()
                pipe.delete(w_key)
                pipe.execute()

        if owner is not None:
            try:
                self._conn.transaction(w_key, (w_key,), release, retry=False)
            except Exception:  # noqa: BLE001 - best effort: the lease runs out by itself
                pass
        self._conn.close()

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r})"


def _named_parts(raw: bytes) -> list[dict[str, Any]]:
    """The well-formed part descriptors an owner's stored record names (for the commit's size check; the record
    itself is judged by `parts.parts_plan`)."""
    try:
        record = decode_json(raw, where="owner record")
    except StoreError:
        return []
    named = record.get("parts") if isinstance(record, dict) else None
    return [p for p in named if isinstance(p, dict) and isinstance(p.get("name"), str)
            and isinstance(p.get("chunks"), int) and 1 <= p["chunks"] <= 1 << 24] if isinstance(named, list) else []
