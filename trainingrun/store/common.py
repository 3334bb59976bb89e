"""The rules both store backends follow, written once and free of I/O: argument checks, polling, the stored values'
checks (epoch, counters, commit markers of rollouts and weight versions), the writer's identity, the fencing
decisions (current attempt, the writer claim, the check before a writer's operation), the stream's decisions (the
wait verdict, committed / released / lost classification of a missing part, pending rollouts, the release low-water
mark) and the wording of their errors.

A backend (`file.py`, `redis.py`) reads what a decision needs (in one round trip where it can), calls the rule here
and performs the write it allows; so the two backends cannot drift apart on what they decide, only on how they store
it. `where` in these functions is the location as messages name it: a path (file store) or "key K" (Redis)."""

from __future__ import annotations

import functools
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

from trainingrun.contract.env import ROLE_ATTEMPT_ENV, RUN_ENV
from trainingrun.contract.errors import CorruptPayload, StoreError
from trainingrun.contract.payload import RankPayload
from trainingrun.store.base import RolloutReleased, StaleAttempt, StoreDataLost, StoreTimeout, WriterConflict
from trainingrun.store.wire import check_payload, decode_json, encode_arrays_parts, encode_json

KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
MAX_ATTEMPT = 2**31 - 1
MAX_PARTS = 1 << 20  # parts of one weight version (buckets of all owners)


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


def publish_plan(rollout: int, payloads: dict[int, RankPayload], schedule: dict[str, Any],
                 attempt: int | None) -> tuple[bytes, Marker]:
    """A checked publish_rollout call (ValueError naming the field) as what it commits: (the schedule's bytes, the
    commit marker naming `attempt`'s payloads)."""
    dp = check_publish(rollout, payloads, schedule)
    data = encode_json(schedule, where="schedule")
    return data, Marker.for_schedule(rollout, dp, attempt, data)


def weights_plan(version: int, arrays: dict[str, np.ndarray], meta: dict[str, Any], attempt: int | None, *,
                 piece_bytes: int | None = None) -> tuple[list[memoryview | bytes], bytes, WeightsMarker]:
    """What publish_weights commits (after `check_weights`): (the encoded tensors as byte chunks, the meta's bytes,
    the commit marker), the tensors stored as one piece or, with `piece_bytes`, in pieces of that size."""
    parts = encode_arrays_parts(arrays)
    meta_bytes = encode_json(meta, where="meta")
    nbytes = sum(memoryview(p).nbytes for p in parts)
    chunks = 1 if piece_bytes is None else max(1, -(-nbytes // piece_bytes))
    return parts, meta_bytes, WeightsMarker.for_meta(version, attempt, nbytes, chunks, meta_bytes)


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


def require_attempt(attempt: int | None) -> int:
    """`enter_attempt` needs a fenced handle: its attempt, ValueError for an unfenced one."""
    if attempt is None:
        raise ValueError("enter_attempt: this store handle has no attempt (open_store(url, attempt=N))")
    return attempt


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


def stored_count(value: Any, *, where: str, field: str) -> int:
    """A counter record read back from the store (`FINISHED` {"num_rollouts": n}, `RELEASED` {"upto": k}, or the
    bare number): the integer, CorruptPayload naming `where` and the field otherwise."""
    return stored_int(value.get(field) if isinstance(value, dict) else value, where=where, field=field)


def epoch_id(raw: bytes | None, seen: str | None, *, url: str, where: str) -> str | None:
    """The store's epoch id from its stored bytes; None when the store has none (yet) and this handle saw none.
    StoreDataLost when the epoch this handle saw (`seen`) is gone or changed: the store lost its data; CorruptPayload
    when the bytes are not an epoch record."""
    if raw is None:
        if seen is not None:
            raise lost(url, f"{where} is gone (this process saw epoch {seen})")
        return None
    value = decode_json(raw, where=f"store {url}: {where}")
    if not isinstance(value, dict) or not isinstance(value.get("id"), str):
        raise CorruptPayload(f"store {url}: {where}: epoch must be a JSON object with a string id")
    if seen is not None and value["id"] != seen:
        raise lost(url, f"its epoch changed from {seen} to {value['id']} (the store was emptied and started again)")
    return value["id"]


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

    DOCUMENT = "schedule"  # the JSON document it commits, by its CRC-32 (`committed_json`)

    @property
    def document_crc(self) -> int:
        return self.schedule_crc

    @classmethod
    def for_schedule(cls, rollout: int, dp_size: int, attempt: int | None, schedule: bytes) -> Marker:
        return cls(rollout, dp_size, attempt or 0, zlib.crc32(schedule))

    def encode(self) -> bytes:
        body = {"rollout": self.rollout, "dp_size": self.dp_size, "attempt": self.attempt,
                "schedule_crc": self.schedule_crc}
        return encode_json({**body, "check": _marker_check(body)})

    @classmethod
    def decode(cls, data: bytes, *, where: str) -> Marker:
        return _decoded(cls, bytes(data), where)

    @classmethod
    def _decode(cls, data: bytes, where: str) -> Marker:
        d = _checked_marker(data, ("rollout", "dp_size", "attempt", "schedule_crc"), where=where)
        return cls(rollout=stored_int(d["rollout"], where=where, field="rollout"),
                   dp_size=stored_int(d["dp_size"], where=where, field="dp_size", minimum=1, maximum=1 << 20),
                   attempt=stored_int(d["attempt"], where=where, field="attempt", maximum=MAX_ATTEMPT),
                   schedule_crc=stored_int(d["schedule_crc"], where=where, field="schedule_crc", maximum=2**32 - 1))


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
    parts: int = 0  # > 0: written in parts (`commit_weights`), the document names them; 0: one blob

    @property
    def DOCUMENT(self) -> str:  # noqa: N802 - the name `committed_json` reads of every marker
        return "weight parts index" if self.parts else "weight meta"

    @property
    def document_crc(self) -> int:
        return self.meta_crc

    @classmethod
    def for_meta(cls, version: int, attempt: int | None, nbytes: int, chunks: int, meta: bytes) -> WeightsMarker:
        return cls(version, attempt or 0, nbytes, chunks, zlib.crc32(meta))

    def encode(self) -> bytes:
        body = {"version": self.version, "attempt": self.attempt, "nbytes": self.nbytes, "chunks": self.chunks,
                "meta_crc": self.meta_crc, **({"parts": self.parts} if self.parts else {})}
        return encode_json({**body, "check": _marker_check(body)})

    @classmethod
    def decode(cls, data: bytes, *, where: str) -> WeightsMarker:
        return _decoded(cls, bytes(data), where)

    @classmethod
    def _decode(cls, data: bytes, where: str) -> WeightsMarker:
        d = _checked_marker(data, ("version", "attempt", "nbytes", "chunks", "meta_crc"), where=where,
                            optional=("parts",))
        return cls(version=stored_int(d["version"], where=where, field="version"),
                   attempt=stored_int(d["attempt"], where=where, field="attempt", maximum=MAX_ATTEMPT),
                   nbytes=stored_int(d["nbytes"], where=where, field="nbytes"),
                   chunks=stored_int(d["chunks"], where=where, field="chunks", minimum=1, maximum=1 << 24),
                   meta_crc=stored_int(d["meta_crc"], where=where, field="meta_crc", maximum=2**32 - 1),
                   parts=stored_int(d.get("parts", 0), where=where, field="parts", maximum=MAX_PARTS))


# ------------------------------------------------------------------------------------------------ what a marker commits
def committed_marker(raw: bytes | None, rollout: int, *, url: str, where: str) -> Marker:
    """The commit marker of `rollout` from its stored bytes (`where`: its location). StoreError when there is none
    (not committed: the caller checks the epoch first, so lost data is reported as such); CorruptPayload when it is
    damaged or names another rollout."""
    if raw is None:
        raise StoreError(f"store {url}: rollout {rollout} is not committed ({where}); wait_rollout first")
    marker = Marker.decode(raw, where=f"store {url}: {where}")
    if marker.rollout != rollout:
        raise CorruptPayload(f"store {url}: {where}: commit marker names rollout {marker.rollout}")
    return marker


def payload_rank(marker: Marker, rank: Any, *, url: str) -> int:
    """`rank` when the committed rollout has a payload for it; StoreError naming the dp size otherwise."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < marker.dp_size:
        raise StoreError(f"store {url}: rollout {marker.rollout} has no payload for rank {rank!r} (dp_size "
                         f"{marker.dp_size})")
    return rank


def committed_json(marker: Marker | WeightsMarker, data: bytes, *, where: str) -> dict[str, Any]:
    """The JSON document a marker commits (a rollout's schedule, a weight version's meta) from its stored bytes: the
    CRC-32 the marker records, strict JSON, an object; CorruptPayload naming `where` otherwise."""
    if zlib.crc32(data) != marker.document_crc:
        raise CorruptPayload(f"{where}: {marker.DOCUMENT} fails the CRC-32 its commit marker records (corrupted bytes)")
    value = decode_json(data, where=where)
    if not isinstance(value, dict):
        raise CorruptPayload(f"{where}: the {marker.DOCUMENT} is not a JSON object")
    return value


def committed_weights(raw: bytes | None, version: int, *, url: str, where: str,
                      chunks: int | None = None) -> WeightsMarker:
    """The commit marker of weight version `version` (`chunks`: the number of pieces the backend stores it in, when
    fixed). StoreError when it is not committed; CorruptPayload when damaged or naming another version."""
    if raw is None:
        raise StoreError(f"store {url}: weight version {version} is not committed ({where})")
    marker = WeightsMarker.decode(raw, where=f"store {url}: {where}")
    if marker.version != version or (chunks is not None and marker.chunks != chunks):
        raise CorruptPayload(f"store {url}: {where}: commit marker names version {marker.version} in "
                             f"{marker.chunks} pieces")
    return marker


def check_weights_size(size: int, marker: WeightsMarker, *, where: str) -> None:
    """The tensors' stored size must be the marker's (checked before anything is decoded)."""
    if size != marker.nbytes:
        raise CorruptPayload(f"{where}: {size} bytes stored, but its commit marker records {marker.nbytes}")


@functools.lru_cache(maxsize=256)
def _decoded(cls: Any, data: bytes, where: str) -> Any:
    """A marker decoded from exactly these bytes: every read reads the bytes again, and the same bytes give the same
    (immutable) marker, so the checks run once per distinct value (a damaged value is re-read and refused each time:
    errors are not cached). Readers read one rollout's marker once per rank and again for its schedule."""
    return cls._decode(data, where)


def _marker_check(body: dict[str, Any]) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()) ^ 0x7472


def _checked_marker(data: bytes, keys: tuple[str, ...], *, where: str, optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """A commit marker's JSON object with exactly `keys` (and those of `optional` it has) + its check value;
    CorruptPayload naming `where` when it is not JSON, lacks the check value (an older trainingrun wrote it) or
    fails it."""
    d = decode_json(data, where=where)
    if not isinstance(d, dict):
        raise CorruptPayload(f"{where}: commit marker must be a JSON object, got {type(d).__name__}")
    if "check" not in d:
        raise CorruptPayload(f"{where}: commit marker without a check value: written by an older trainingrun or "
                             "by something else; resume this run with the version that wrote it, or use a fresh "
                             "store")
    body = {k: d.get(k) for k in (*keys, *(k for k in optional if k in d))}
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
    generation: int = 0  # the writer's generation within its attempt (TRAININGRUN_ROLE_ATTEMPT: a rollout restarted alone)

    @classmethod
    def me(cls, attempt: int | None) -> Owner:
        pid = os.getpid()
        raw = os.environ.get(ROLE_ATTEMPT_ENV, "")
        return cls(token=secrets.token_hex(8), attempt=attempt, host=socket.gethostname(), pid=pid,
                   pid_start=_process_start(pid), run=os.environ.get(RUN_ENV), since=time.time(),
                   generation=int(raw) if raw.isascii() and raw.isdigit() else 0)

    def to_json(self) -> dict[str, Any]:
        return {"token": self.token, "attempt": self.attempt, "host": self.host, "pid": self.pid,
                "pid_start": self.pid_start, "run": self.run, "since": self.since, "generation": self.generation}

    @classmethod
    def from_json(cls, d: Any, *, where: str) -> Owner:
        if not isinstance(d, dict):
            raise CorruptPayload(f"{where}: writer claim must be a JSON object, got {type(d).__name__}")
        try:
            attempt = d.get("attempt")
            return cls(token=str(d["token"]), attempt=None if attempt is None else stored_int(
                attempt, where=where, field="attempt", maximum=MAX_ATTEMPT), host=str(d["host"]),
                pid=stored_int(d["pid"], where=where, field="pid", maximum=2**31), pid_start=d.get("pid_start"),
                run=d.get("run"), since=float(d.get("since", 0.0)),
                generation=stored_int(d.get("generation", 0), where=where, field="generation", maximum=MAX_ATTEMPT))
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptPayload(f"{where}: writer claim is malformed: {exc}") from None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        run = f" of run {self.run}" if self.run else ""
        generation = f" (generation {self.generation})" if self.generation else ""
        return f"pid {self.pid} on {self.host}{run}, attempt {_attempt_text(self.attempt)}{generation}, since {when}"

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


def holds(current: Owner | None, mine: Owner | None) -> bool:
    """Whether the claim stored now (`current`) is this handle's own (`mine`)."""
    return current is not None and mine is not None and current.token == mine.token


# ------------------------------------------------------------------------------------------------ fencing rules
def check_current(attempt: int | None, current: int | None, *, url: str, op: str) -> None:
    """Before any write of a handle of `attempt`: StaleAttempt when the store's current attempt is newer (an
    unfenced handle, attempt None, is never refused by attempt)."""
    if attempt is not None and current is not None and current > attempt:
        raise stale(url, op, attempt, current)


def may_claim(current: Owner | None, me: Owner, *, url: str,
              dead: Callable[[Owner], bool] = Owner.dead_here) -> bool:
    """The writer-claim decision, for `me` claiming while `current` holds the claim (None: nobody). True when `me`
    holds it already; False when `me` may write its claim (over `current`'s); else it raises:

    | current                                   | verdict                                   |
    |-------------------------------------------|-------------------------------------------|
    | none, or `me` itself                      | claim (False) / already held (True)       |
    | of a newer attempt                        | StaleAttempt: `me` is fenced off          |
    | of an older attempt                       | take it over (False)                      |
    | same attempt, an older generation         | take it over (False): a rollout restarted |
    |                                           | alone replaces its predecessor at once    |
    | same attempt, a newer generation          | WriterConflict naming it                  |
    | same attempt and generation, alive        | WriterConflict naming it                  |
    | same attempt and generation, dead         | take it over (False)                      |

    An unfenced handle (attempt None) counts as attempt 0, the attempt it writes as. A generation is the writer's
    TRAININGRUN_ROLE_ATTEMPT (0 when unset, and for claims written before generations existed); an older generation
    that took the claim back would be refused (WriterConflict, exit 78), and one that held it fails its next write."""
    if current is None or current.token == me.token:
        return current is not None
    mine, theirs = me.attempt or 0, current.attempt or 0
    if theirs > mine:
        raise stale(url, "claiming the writer", mine, theirs)
    if theirs == mine and (current.generation > me.generation or
                           (current.generation == me.generation and not dead(current))):
        raise conflict(url, current, me)
    return False


def check_writer(current: Owner | None, me: Owner, *, held: bool, url: str, op: str, lost_to: Owner | None = None,
                 dead: Callable[[Owner], bool] = Owner.dead_here) -> None:
    """Before a writer's operation (publish, finish) of `me` (`held`: whether `me` claimed the store), with
    `current` the claim stored now and `lost_to` an owner seen taking the claim from `me` meanwhile (the Redis
    lease thread): passes when nobody holds the claim, when `me` holds it, or (for a handle that never claimed)
    when its holder is dead; else raises

    * WriterConflict (lost) when `me` held the claim and another owner has it (or `lost_to` took it),
    * StaleAttempt when the claim's owner is of a newer attempt than `me` (both fenced),
    * WriterConflict when `me` never claimed and a live owner holds the claim."""
    if held and lost_to is not None:
        raise conflict(url, lost_to, me, lost=True)
    if current is None or (held and current.token == me.token):
        return
    if current.attempt is not None and me.attempt is not None and current.attempt > me.attempt:
        raise stale(url, op, me.attempt, current.attempt)
    if held:
        raise conflict(url, current, me, lost=True)
    if not dead(current):
        raise conflict(url, current, me)


# ------------------------------------------------------------------------------------------------ stream rules
def wait_verdict(rollout: int, *, committed: bool, released: Callable[[], int], finished: Callable[[], int | None],
                 url: str) -> bool | None:
    """One poll of `wait_rollout`: True when `rollout` is committed, False when the stream finished before it, None
    to keep waiting; RolloutReleased when it was deleted (below the release low-water mark). `released()` and
    `finished()` give the stored counters (0 / None when absent) and are asked only when the verdict needs them: a
    committed rollout is read whatever they hold."""
    if committed:
        return True
    if rollout < released():
        raise RolloutReleased(f"store {url}: rollout {rollout} was released (deleted) after every rank acked it")
    done = finished()
    if done is not None and rollout >= done:
        return False
    return None


def part_missing(rollout: int, where: str, *, committed: bool, released: int, url: str) -> StoreError:
    """What it means that a part of committed `rollout` (its payload or schedule at `where`) is missing: released
    meanwhile (below the low-water mark, or no longer committed) is RolloutReleased; still committed is lost data."""
    if rollout < released or not committed:
        return RolloutReleased(f"store {url}: rollout {rollout} was released (deleted) while being read")
    return lost(url, f"rollout {rollout} is committed but {where} is missing")


def weights_missing(version: int, where: str, *, committed: bool, url: str) -> StoreError:
    """The same for a part of a committed weight version: released meanwhile, or lost data."""
    if not committed:
        return StoreError(f"store {url}: weight version {version} was released while being read")
    return lost(url, f"weight version {version} is committed but {where} is missing")


Ledger = list[tuple[int, Marker | None, int]]  # committed rollouts ascending: (k, its marker or None, ranks acked)


def pending_count(ledger: Ledger) -> int:
    """Committed rollouts not yet acknowledged by every rank their marker names (None: released meanwhile)."""
    return sum(1 for _, marker, acks in ledger if marker is not None and acks < marker.dp_size)


def release_plan(rollout: int, ledger: Ledger, released: int) -> tuple[list[int], int | None]:
    """`release_upto(rollout)`: (the rollouts to delete: below `rollout` and acked by every rank, the new low-water
    mark or None when it stays at `released`). The mark is the oldest rollout below `rollout` that stays (not fully
    acked), so every rollout below the mark is gone, never just some."""
    delete, upto = [], rollout
    for k, marker, acks in ledger:
        if k >= rollout:
            break
        if marker is None or acks < marker.dp_size:
            upto = min(upto, k)
        else:
            delete.append(k)
    return delete, (upto if upto > released else None)


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
