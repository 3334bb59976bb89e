"""`redis://host:port/db` store (redis-py), the cluster default.

Keys (prefix P = "trainingrun", or `?prefix=NAME` in the URL, so several runs can share one server):

    P:r:<k>:p:<rank>    rank payload (wire format, one string value)
    P:r:<k>:schedule    the schedule (JSON)
    P:r:<k>:commit      commit marker {"rollout", "dp_size"} (JSON), written last
    P:committed         sorted set of committed rollouts (score = member = k)
    P:r:<k>:acks        set of ranks that acknowledged rollout k
    P:kv:<key>          put_json/get_json
    P:finished          {"num_rollouts": n}
    P:released          k: rollouts < k may have been deleted

Atomicity: the payloads are written first (pipelined SETs); then schedule, commit marker and the `committed` entry go
in one MULTI/EXEC transaction. A writer that dies before EXEC leaves payload keys without a commit marker, which
readers never look at; a re-publish overwrites them and commits. Readers decide visibility by the commit marker only.

Transient errors (ConnectionError, TimeoutError, a server still loading its data) are retried with exponential
backoff for up to `retry_seconds` (URL option `?retry_seconds=60`); anything else, or running out of retries, raises
StoreError naming the URL and key. `wait_rollout` keeps polling through a server restart until its own timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from trainingrun.store.base import RankPayload, RolloutReleased, StoreError
from trainingrun.store.common import backoff, check_key, check_publish, check_rollout, poll
from trainingrun.store.wire import decode_json, decode_payload, encode_json, encode_payload_parts

T = TypeVar("T")
MAX_VALUE_BYTES = 512 * 1024 * 1024  # Redis' limit of one string value


class RedisStore:
    """A Store on a Redis server. See the module docstring for keys, atomicity and retries."""

    def __init__(self, url: str, *, prefix: str = "trainingrun", retry_seconds: float = 60.0, socket_timeout: float = 30):
        import redis  # the `store` extra

        self._redis = redis
        self.url = url
        self.prefix = prefix
        self.retry_seconds = retry_seconds
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

    @classmethod
    def from_url(cls, url: str) -> RedisStore:
        query = parse_qs(urlsplit(url).query)
        kwargs: dict[str, Any] = {}
        if "prefix" in query:
            kwargs["prefix"] = check_key(query["prefix"][-1])
        if "retry_seconds" in query:
            try:
                kwargs["retry_seconds"] = float(query["retry_seconds"][-1])
            except ValueError:
                raise ValueError(f"store url: retry_seconds must be a number, got {query['retry_seconds'][-1]!r}") from None
        return cls(url, **kwargs)

    # ------------------------------------------------------------------ helpers
    def _k(self, *parts: object) -> str:
        return ":".join([self.prefix, *map(str, parts)])

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
        if self.is_committed(rollout):
            return False
        for rank in range(dp):
            key = self._k("r", rollout, "p", rank)
            data = b"".join(encode_payload_parts(payloads[rank]))
            if len(data) > MAX_VALUE_BYTES:
                raise StoreError(
                    f"store {self.url}: key {key}: payload of {len(data)} bytes exceeds Redis' 512 MiB value limit;"
                    " use more data-parallel ranks or fewer samples per rollout"
                )
            self._retry(lambda: self.client.set(key, data), key)
        if _after_payloads is not None:
            _after_payloads()
        commit = encode_json({"rollout": rollout, "dp_size": dp})

        def commit_tx() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.set(self._k("r", rollout, "schedule"), schedule_bytes)
            pipe.set(self._k("r", rollout, "commit"), commit)
            pipe.zadd(self._k("committed"), {str(rollout): rollout})
            pipe.execute()

        # Replaying the transaction after a lost reply is harmless: it sets the same values again.
        self._retry(commit_tx, self._k("r", rollout, "commit"))
        return True

    def finish(self, num_rollouts: int) -> None:
        check_rollout(num_rollouts, "num_rollouts")
        key = self._k("finished")
        value = encode_json({"num_rollouts": num_rollouts})
        self._retry(lambda: self.client.set(key, value), key)

    def finished(self) -> int | None:
        value = self._get_json(self._k("finished"))
        return None if value is None else int(value["num_rollouts"])

    def pending_rollouts(self) -> int:
        key = self._k("committed")
        members = self._retry(lambda: self.client.zrange(key, 0, -1), key)
        if not members:
            return 0
        ks = [int(m) for m in members]

        def counts() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for k in ks:
                pipe.get(self._k("r", k, "commit"))
                pipe.scard(self._k("r", k, "acks"))
            return pipe.execute()

        res = self._retry(counts, self._k("r", "*", "acks"))
        pending = 0
        for i, k in enumerate(ks):
            commit, acks = res[2 * i], res[2 * i + 1]
            if commit is None:
                continue
            dp = int(decode_json(commit, where=f"store {self.url}: key {self._k('r', k, 'commit')}")["dp_size"])
            if acks < dp:
                pending += 1
        return pending

    # ------------------------------------------------------------------ readers
    def _released(self) -> int:
        value = self._get(self._k("released"))
        return 0 if value is None else int(value)

    def wait_rollout(self, rollout: int, timeout: float | None = None) -> bool:
        check_rollout(rollout)
        key = self._k("r", rollout, "commit")
        deadline = None if timeout is None else time.monotonic() + timeout

        def check() -> bool | None:
            def probe() -> tuple[Any, Any, Any]:
                pipe = self.client.pipeline(transaction=False)
                pipe.exists(key)
                pipe.get(self._k("finished"))
                pipe.get(self._k("released"))
                return tuple(pipe.execute())

            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            retry = self.retry_seconds if left is None else min(self.retry_seconds, left)
            try:
                exists, finished, released = self._retry(probe, key, retry_seconds=retry)
            except StoreError as exc:
                if isinstance(exc.__cause__, self._transient) and deadline is not None and time.monotonic() >= deadline:
                    return None  # unreachable until our own timeout: report the timeout below
                raise
            if exists:
                return True
            if released is not None and rollout < int(released):
                raise RolloutReleased(f"store {self.url}: rollout {rollout} was released (deleted) after every rank acked it")
            if finished is not None:
                done = int(decode_json(finished, where=f"store {self.url}: key {self._k('finished')}")["num_rollouts"])
                if rollout >= done:
                    return False
            return None

        return poll(check, timeout, f"rollout {rollout} in store {self.url} (key {key})", max_interval=0.1)

    def _require_committed(self, rollout: int) -> None:
        if not self.is_committed(rollout):
            key = self._k("r", rollout, "commit")
            raise StoreError(f"store {self.url}: rollout {rollout} is not committed (key {key}); wait_rollout first")

    def read_schedule(self, rollout: int) -> dict[str, Any]:
        self._require_committed(rollout)
        key = self._k("r", rollout, "schedule")
        value = self._get_json(key)
        if not isinstance(value, dict):
            raise StoreError(f"store {self.url}: key {key} is missing or not a JSON object")
        return value

    def read_payload(self, rollout: int, rank: int) -> RankPayload:
        self._require_committed(rollout)
        key = self._k("r", rollout, "p", rank)
        data = self._get(key)
        if data is None:
            raise StoreError(f"store {self.url}: rollout {rollout} has no payload for rank {rank} (key {key})")
        return decode_payload(data, where=f"store {self.url}: key {key}")

    def ack(self, rollout: int, rank: int) -> None:
        key = self._k("r", check_rollout(rollout), "acks")
        self._retry(lambda: self.client.sadd(key, rank), key)

    def release_upto(self, rollout: int) -> None:
        check_rollout(rollout)
        key = self._k("committed")
        ks = [int(m) for m in self._retry(lambda: self.client.zrangebyscore(key, 0, rollout - 1), key)]
        upto = rollout
        for k in ks:
            commit = self._get_json(self._k("r", k, "commit"))
            acks = self._retry(lambda: self.client.scard(self._k("r", k, "acks")), self._k("r", k, "acks"))
            if commit is None or acks < int(commit["dp_size"]):
                upto = min(upto, k)
                continue
            dp = int(commit["dp_size"])

            def delete() -> None:
                pipe = self.client.pipeline(transaction=True)
                pipe.delete(self._k("r", k, "commit"))  # invisible first
                pipe.zrem(self._k("committed"), str(k))
                pipe.delete(self._k("r", k, "schedule"), self._k("r", k, "acks"))
                pipe.delete(*[self._k("r", k, "p", r) for r in range(dp)])
                pipe.execute()

            self._retry(delete, self._k("r", k, "*"))
        rkey = self._k("released")
        self._retry(lambda: self.client.set(rkey, max(upto, self._released())), rkey)

    # ------------------------------------------------------------------ shared state
    def put_json(self, key: str, value: dict[str, Any]) -> None:
        rkey = self._k("kv", check_key(key))
        data = encode_json(value, where=f"put_json({key!r})")
        self._retry(lambda: self.client.set(rkey, data), rkey)

    def get_json(self, key: str) -> dict[str, Any] | None:
        return self._get_json(self._k("kv", check_key(key)))

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing a dead connection
            pass

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r})"
