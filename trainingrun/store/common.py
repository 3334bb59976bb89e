"""Helpers shared by the store backends: argument checks, polling with backoff, key names, the commit marker, the
writer's identity, and the wording of the fencing and lost-data errors (the same on both backends)."""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainingrun.contract.errors import CorruptPayload
from trainingrun.contract.payload import RankPayload
from trainingrun.store.base import StaleAttempt, StoreDataLost, StoreTimeout, WriterConflict
from trainingrun.store.wire import check_payload, decode_json, encode_json

KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
MAX_ATTEMPT = 2**31 - 1


def check_key(key: str) -> str:
    """Keys of put_json/get_json: 1-128 characters of [A-Za-z0-9_.-], not starting with '.' or '-' (the whole key:
    a trailing newline is not allowed either)."""
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise ValueError(f"key: must be 1-128 characters of [A-Za-z0-9_.-] starting with a letter or digit, got {key!r}")
    return key


def check_rollout(rollout: int, name: str = "rollout") -> int:
    if isinstance(rollout, bool) or not isinstance(rollout, int) or rollout < 0:
        raise ValueError(f"{name}: must be an int >= 0, got {rollout!r}")
    return rollout


def check_publish(rollout: int, payloads: dict[int, RankPayload], schedule: dict[str, Any]) -> int:
    """Validate a publish_rollout call; return dp_size. ValueError names the field."""
    check_rollout(rollout)
    if not isinstance(schedule, dict):
        raise ValueError(f"schedule: must be a dict, got {type(schedule).__name__}")
    dp = schedule.get("dp_size")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"schedule.dp_size: must be an int >= 1, got {dp!r}")
    if schedule.get("rollout", rollout) != rollout:
        raise ValueError(f"schedule.rollout: {schedule.get('rollout')!r} != rollout {rollout}")
    if sorted(payloads) != list(range(dp)):
        raise ValueError(f"payloads: must have exactly the ranks 0..{dp - 1} (schedule.dp_size), got {sorted(payloads)}")
    for rank, payload in payloads.items():
        check_payload(payload, where=f"payloads[{rank}]")
    return dp


def check_weights(version: int, arrays: dict, meta: dict) -> None:
    """Validate a publish_weights call. ValueError names the field."""
    check_rollout(version, "version")
    if not isinstance(arrays, dict) or not arrays:
        raise ValueError("arrays: must be a non-empty dict of numpy arrays")
    for name, arr in arrays.items():
        if not isinstance(name, str) or not isinstance(arr, np.ndarray):
            raise ValueError(f"arrays[{name!r}]: must be a numpy array under a string name")
    if not isinstance(meta, dict):
        raise ValueError(f"meta: must be a dict, got {type(meta).__name__}")


def backoff(initial: float = 0.01, maximum: float = 0.25, factor: float = 1.5) -> Iterator[float]:
    """Sleep intervals: initial, ×factor each time, capped at maximum."""
    delay = initial
    while True:
        yield delay
        delay = min(delay * factor, maximum)


def poll(check: Callable[[], Any], timeout: float | None, what: str, *, max_interval: float = 0.25) -> Any:
    """Call `check()` until it returns something other than None; StoreTimeout naming `what` after `timeout` s."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for delay in backoff(maximum=max_interval):
        result = check()
        if result is not None:
            return result
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreTimeout(f"timed out after {timeout:g} s waiting for {what}")
            delay = min(delay, left)
        time.sleep(delay)
    raise AssertionError("unreachable")


def check_attempt(attempt: Any) -> int | None:
    """A handle's attempt: None (unfenced) or an int in [0, 2^31-1]; ValueError naming it otherwise."""
    if attempt is None:
        return None
    if isinstance(attempt, bool) or not isinstance(attempt, int) or not 0 <= attempt <= MAX_ATTEMPT:
        raise ValueError(f"attempt: must be an int in [0, {MAX_ATTEMPT}] (TRAININGRUN_ATTEMPT), got {attempt!r}")
    return attempt


def stored_int(value: Any, *, where: str, field: str, minimum: int = 0, maximum: int = 2**63 - 1) -> int:
    """An integer field read back from the store; CorruptPayload naming `where` and the field when it is anything
    else (wrong type, a float, a huge number). Raw bytes (a Redis string) must be a plain decimal integer."""
    if isinstance(value, bytes):
        text = value.decode("ascii", "replace")
        value = int(text) if re.fullmatch(r"-?[0-9]{1,20}", text) else text
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise CorruptPayload(f"{where}: {field} must be an integer in [{minimum}, {maximum}], got {value!r:.80}")
    return value


# ------------------------------------------------------------------------------------------------ commit marker
@dataclass(frozen=True)
class Marker:
    """The commit marker of a rollout: written last, the only thing readers decide visibility by. It names the
    attempt whose payloads (and, on files, schedule) it commits (an unfenced writer writes as attempt 0) and carries
    the schedule's CRC-32 and its own check value, so a damaged marker or schedule is detected, not trusted."""

    rollout: int
    dp_size: int
    attempt: int
    schedule_crc: int

    @classmethod
    def for_schedule(cls, rollout: int, dp_size: int, attempt: int | None, schedule: bytes) -> Marker:
        return cls(rollout, dp_size, attempt or 0, zlib.crc32(schedule))

    def encode(self) -> bytes:
        body = {"rollout": self.rollout, "dp_size": self.dp_size, "attempt": self.attempt,
                "schedule_crc": self.schedule_crc}
        return encode_json({**body, "check": _marker_check(body)})

    @classmethod
    def decode(cls, data: bytes, *, where: str) -> Marker:
        d = _checked_marker(data, ("rollout", "dp_size", "attempt", "schedule_crc"), where=where)
        return cls(rollout=stored_int(d["rollout"], where=where, field="rollout"),
                   dp_size=stored_int(d["dp_size"], where=where, field="dp_size", minimum=1, maximum=1 << 20),
                   attempt=stored_int(d["attempt"], where=where, field="attempt", maximum=MAX_ATTEMPT),
                   schedule_crc=stored_int(d["schedule_crc"], where=where, field="schedule_crc", maximum=2**32 - 1))

    def check_schedule(self, data: bytes, *, where: str) -> None:
        if zlib.crc32(data) != self.schedule_crc:
            raise CorruptPayload(f"{where}: schedule fails the CRC-32 its commit marker records (corrupted bytes)")


@dataclass(frozen=True)
class WeightsMarker:
    """The commit marker of a weight version (`publish_weights`), the same protocol as a rollout's: written last,
    never overwritten, the only thing readers decide visibility by. It names the attempt whose tensors it commits
    (they live under that attempt, so a fenced-off trainer cannot overwrite them), their size in bytes and in
    pieces (Redis chunks; 1 file on the file store), the CRC-32 of the version's meta JSON and its own check value."""

    version: int
    attempt: int
    nbytes: int
    chunks: int
    meta_crc: int

    @classmethod
    def for_meta(cls, version: int, attempt: int | None, nbytes: int, chunks: int, meta: bytes) -> WeightsMarker:
        return cls(version, attempt or 0, nbytes, chunks, zlib.crc32(meta))

    def encode(self) -> bytes:
        body = {"version": self.version, "attempt": self.attempt, "nbytes": self.nbytes, "chunks": self.chunks,
                "meta_crc": self.meta_crc}
        return encode_json({**body, "check": _marker_check(body)})

    @classmethod
    def decode(cls, data: bytes, *, where: str) -> WeightsMarker:
        d = _checked_marker(data, ("version", "attempt", "nbytes", "chunks", "meta_crc"), where=where)
        return cls(version=stored_int(d["version"], where=where, field="version"),
                   attempt=stored_int(d["attempt"], where=where, field="attempt", maximum=MAX_ATTEMPT),
                   nbytes=stored_int(d["nbytes"], where=where, field="nbytes"),
                   chunks=stored_int(d["chunks"], where=where, field="chunks", minimum=1, maximum=1 << 24),
                   meta_crc=stored_int(d["meta_crc"], where=where, field="meta_crc", maximum=2**32 - 1))

    def check_meta(self, data: bytes, *, where: str) -> None:
        if zlib.crc32(data) != self.meta_crc:
            raise CorruptPayload(f"{where}: weight meta fails the CRC-32 its commit marker records (corrupted bytes)")


def _marker_check(body: dict[str, Any]) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()) ^ 0x7472


def _checked_marker(data: bytes, keys: tuple[str, ...], *, where: str) -> dict[str, Any]:
    """A commit marker's JSON object with exactly `keys` + its check value; CorruptPayload naming `where` when it is
    not JSON, lacks the check value (an older trainingrun wrote it) or fails it."""
    d = decode_json(data, where=where)
    if not isinstance(d, dict):
        raise CorruptPayload(f"{where}: commit marker must be a JSON object, got {type(d).__name__}")
    if "check" not in d:
        raise CorruptPayload(f"{where}: commit marker without a check value: written by an older trainingrun or "
                             "by something else; resume this run with the version that wrote it, or use a fresh "
                             "store")
    body = {k: d.get(k) for k in keys}
    if d["check"] != _marker_check(body) or set(d) != {*body, "check"}:
        raise CorruptPayload(f"{where}: commit marker fails its check value (damaged or altered)")
    return d


# ------------------------------------------------------------------------------------------------ identities
def _process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def new_epoch() -> dict[str, Any]:
    """A fresh store epoch: written once when a store is first used; a store that loses its data loses it too."""
    return {"id": secrets.token_hex(8), "created": time.time(), "host": socket.gethostname()}


@dataclass(frozen=True)
class Owner:
    """Who holds a writer claim: enough to name it in an error and to tell whether it is still alive."""

    token: str
    attempt: int | None
    host: str
    pid: int
    pid_start: int | None
    run: str | None
    since: float

    @classmethod
    def me(cls, attempt: int | None) -> Owner:
        pid = os.getpid()
        return cls(token=secrets.token_hex(8), attempt=attempt, host=socket.gethostname(), pid=pid,
                   pid_start=_process_start(pid), run=os.environ.get("TRAININGRUN_RUN"), since=time.time())

    def to_json(self) -> dict[str, Any]:
        return {"token": self.token, "attempt": self.attempt, "host": self.host, "pid": self.pid,
                "pid_start": self.pid_start, "run": self.run, "since": self.since}

    @classmethod
    def from_json(cls, d: Any, *, where: str) -> Owner:
        if not isinstance(d, dict):
            raise CorruptPayload(f"{where}: writer claim must be a JSON object, got {type(d).__name__}")
        try:
            attempt = d.get("attempt")
            return cls(token=str(d["token"]), attempt=None if attempt is None else stored_int(
                attempt, where=where, field="attempt", maximum=MAX_ATTEMPT), host=str(d["host"]),
                pid=stored_int(d["pid"], where=where, field="pid", maximum=2**31), pid_start=d.get("pid_start"),
                run=d.get("run"), since=float(d.get("since", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptPayload(f"{where}: writer claim is malformed: {exc}") from None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        run = f" of run {self.run}" if self.run else ""
        return f"pid {self.pid} on {self.host}{run}, attempt {_attempt_text(self.attempt)}, since {when}"

    def dead_here(self) -> bool:
        """True when the owner ran on this host and that process is gone (or its pid was reused)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        start = _process_start(self.pid)
        return self.pid_start is not None and start is not None and start != self.pid_start


def _attempt_text(attempt: int | None) -> str:
    return "unset" if attempt is None else str(attempt)


# ------------------------------------------------------------------------------------------------ error wording
def stale(url: str, op: str, attempt: int, current: int) -> StaleAttempt:
    return StaleAttempt(
        f"store {url}: {op} refused: this process belongs to attempt {attempt}, but the store's current attempt is "
        f"{current} (the run was restarted; a process of an older attempt may not write). If this is a new run "
        "reusing an old store, give it a fresh store (another redis db or ?prefix=NAME, or a new store.url)",
        attempt=attempt, current=current)


def conflict(url: str, owner: Owner, me: Owner, *, lost: bool = False) -> WriterConflict:
    what = ("this writer lost its claim on the store to another writer" if lost
            else "another rollout writer of the same attempt already holds the store")
    return WriterConflict(
        f"store {url}: {what}: {owner.describe()}; refused for {me.describe()}. One rollout writer per store "
        "(prefix): stop the other one, or give this run its own store (another redis db or ?prefix=NAME, or a new "
        "store.url)", owner=owner.to_json())


def lost(url: str, what: str) -> StoreDataLost:
    return StoreDataLost(
        f"store {url} lost its data: {what}. The store was emptied while the run used it (a Redis server restarted "
        "without persistence, keys evicted under memory pressure, or the store directory removed). To continue: "
        "run it again (`trainingrun run` with the same --out, or the operator's next attempt): the trainers resume "
        "from their newest checkpoint and the rollout re-creates the rollouts from there; to keep it from happening, "
        "give Redis persistence (appendonly yes, or store.managed with a volume) and maxmemory-policy noeviction"
    )
