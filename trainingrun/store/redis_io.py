"""The Redis store's I/O primitives (redis-py): the URL and its options, the connection, retries of transient errors
(ConnectionError, TimeoutError, a server still loading its data) with exponential backoff for `retry_seconds`,
plain pipelines (several commands in one round trip), WATCH/MULTI/EXEC transactions, and the writer claim's lease
thread. Anything else, or running out of retries, is a `StoreError` naming the store URL and the key. `redis.py`
lays the store out on top of these."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from trainingrun.contract.errors import StoreError
from trainingrun.store.common import backoff, check_key

T = TypeVar("T")


def _seconds(query: dict[str, list[str]], name: str, default: float) -> float:
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


def url_options(url: str) -> dict[str, Any]:
    """The store options of a redis:// URL (`?prefix=NAME&retry_seconds=S&lease_seconds=S`); ValueError naming the
    URL option when one is malformed."""
    query = parse_qs(urlsplit(url).query)
    options: dict[str, Any] = {}
    if "prefix" in query:
        try:
            options["prefix"] = check_key(query["prefix"][-1])
        except ValueError as exc:
            raise ValueError(f"store url: prefix: {exc}") from None
    options["retry_seconds"] = _seconds(query, "retry_seconds", 60.0)
    options["lease_seconds"] = _seconds(query, "lease_seconds", 30.0)
    return options


class Connection:
    """One Redis server for one store handle: every call names `url` and the key in its errors."""

    def __init__(self, url: str, *, retry_seconds: float, socket_timeout: float):
        import redis  # deferred: redis (the `store` extra)

        self.redis = redis
        self.url = url
        self.retry_seconds = retry_seconds
        parts = urlsplit(url)
        try:
            db = int(parts.path.strip("/") or 0)
            port = parts.port or 6379
        except ValueError:
            raise ValueError(f"store url: {url!r}: expected redis://host:port/db with an integer port and db") from None
        if not parts.hostname:
            raise ValueError(f"store url: {url!r} has no host (expected redis://host:port/db)")
        self.client = redis.Redis(host=parts.hostname, port=port, db=db, password=parts.password,
                                  username=parts.username, socket_timeout=socket_timeout, socket_connect_timeout=5)
        self.transient = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)

    def retry(self, op: Callable[[], T], key: str, *, retry_seconds: float | None = None) -> T:
        """Run `op`, retrying transient errors with exponential backoff; StoreError naming url and key otherwise."""
        limit = self.retry_seconds if retry_seconds is None else retry_seconds
        deadline = time.monotonic() + limit
        delays = backoff(initial=0.05, maximum=2.0, factor=2.0)
        while True:
            try:
                return op()
            except self.transient as exc:
                if time.monotonic() >= deadline:
                    raise StoreError(f"store {self.url}: key {key}: server unreachable for {limit:g} s: {exc}") from exc
                time.sleep(min(next(delays), max(0.0, deadline - time.monotonic())))
            except self.redis.RedisError as exc:
                raise StoreError(f"store {self.url}: key {key}: {exc.__class__.__name__}: {exc}") from exc

    def batch(self, key: str, *commands: tuple[Any, ...], retry_seconds: float | None = None) -> list[Any]:
        """Several commands ((name, *args), ...) in one round trip (a plain pipeline), retried like every call."""
        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for name, *args in commands:
                getattr(pipe, name)(*args)
            return pipe.execute()

        return self.retry(run, key, retry_seconds=retry_seconds)

    def call(self, key: str, name: str, *args: Any) -> Any:
        """One command (`name` of redis-py's client), retried."""
        return self.retry(lambda: getattr(self.client, name)(*args), key)

    def transaction(self, key: str, watch: tuple[str, ...], body: Callable[[Any, list[Any]], Any], *,
                    retry: bool = True) -> Any:
        """`body(pipe, values)` with the `watch` keys watched and `values` their values: it checks them, reads more
        through `pipe` if it must, then queues its writes after `pipe.multi()` and returns `pipe.execute()`'s
        result (or returns without MULTI to write nothing). Run again when a watched key changed before EXEC;
        transient errors retried (`retry=False`: one try, errors raised as they are)."""
        def tx() -> Any:
            with self.client.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        pipe.watch(*watch)
                        return body(pipe, pipe.mget(*watch))
                    except self.redis.WatchError:
                        continue

        return self.retry(tx, key) if retry else tx()

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing a dead connection
            pass


class Lease:
    """Calls `renew()` every `seconds / 3` on a daemon thread until `stop()`: keeps the writer claim's lease alive
    while the writer lives (an exception in `renew` is dropped: the next guarded write reports what is wrong)."""

    def __init__(self, renew: Callable[[], None], seconds: float):
        self._renew, self._seconds = renew, seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="trainingrun-store-lease", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._seconds / 3):
            try:
                self._renew()
            except Exception:  # noqa: BLE001 - see the class docstring
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
