"""`file://` store: a directory on a local volume (or a shared one; no flock: O_EXCL creates, links and renames
only; immutable payload files are read through read-only memory maps).

Layout under the root directory:

    EPOCH                                      {"id", "created", "host"}: created once, never rewritten
    attempts/00000003                          one empty file per attempt that used the store; the largest is current
    writer/00000003.json                       the rollout writer's claim for attempt 3 (owner identity)
    rollouts/00000007/a00000003/rank-00000.bin rank payloads written by attempt 3 (wire format)
    rollouts/00000007/a00000003/schedule.json  the schedule (JSON)
    rollouts/00000007/COMMIT                   commit marker (`common.Marker`: rollout, dp_size, attempt, schedule
                                               CRC-32, check value), linked into place last, never overwritten
    acks/00000007/rank-00000                   one empty file per acknowledging rank
    weights/00000003/a00000002/tensors.bin     weight version 3 written by attempt 2: named arrays (wire format)
    weights/00000003/a00000002/meta.json       its metadata (JSON)
    weights/00000003/COMMIT                    its commit marker (`common.WeightsMarker`: version, attempt, bytes,
                                               meta CRC-32, check value), linked into place last, never overwritten
    kv/<key>.json                              put_json/get_json
    FINISHED                                   {"num_rollouts": n}, written by finish(n)
    RELEASED                                   {"upto": k}: rollouts < k may have been deleted

Every file is written as a temporary file in the same directory (`.tmp.<name>.<pid>.<random>`), fsync'ed, and
renamed over its final name (or, for COMMIT, EPOCH and writer claims, hard-linked: the link fails if the name exists,
so the first one wins and nothing is overwritten); a reader sees the old file or the new one, never a half-written
one. The commit marker is linked after the payloads and the schedule (and their directory) were fsync'ed, so a
reader that sees COMMIT sees the whole rollout. A writer killed before the marker leaves files without COMMIT, which
readers ignore; a re-publish writes them again and commits. Payloads and schedule live in a directory of the
writer's attempt, so a fenced-off writer of an older attempt can never overwrite what a newer one committed. Weight
versions (trainer rank 0 writes, the rollout's engine reads) follow the same protocol (`_commit_directory`), fenced by
the epoch and the attempt (the trainer is no rollout writer: it holds no writer claim).

Fencing: every write first checks the epoch (a changed or vanished EPOCH is `StoreDataLost`), the current attempt
(a newer one is `StaleAttempt`) and, for the writer's operations, the writer claim (`WriterConflict`). The checks
run just before each write, not atomically with it (no locks on a shared volume); COMMIT's link is atomic.

Query options: `file:///path?fsync=0` skips fsync (faster; safe against process crashes, not against a node crash).
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np

from trainingrun.contract.errors import CorruptPayload, StoreError
from trainingrun.contract.payload import RankPayload
from trainingrun.store.base import RolloutReleased
from trainingrun.store.common import (
    Marker,
    Owner,
    WeightsMarker,
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
    PAYLOAD_SPEC,
    header_span,
    parse_header,
)

COMMIT = "COMMIT"
SCHEDULE = "schedule.json"
MAX_JSON_BYTES = 1 << 30  # a stored JSON value (the largest are schedules of huge rollouts)


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def _write_all(fd: int, chunk: bytes | memoryview) -> None:
    """Write every byte of `chunk` to `fd` (os.write may write less than asked)."""
    view = memoryview(chunk).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


class FileStore:
    """A Store in a directory. See the module docstring for the layout, atomicity and fencing."""

    def __init__(self, root: str | Path, *, url: str | None = None, fsync: bool = True, attempt: int | None = None):
        self.root = Path(root)
        self.url = url or f"file://{self.root}"
        self.fsync = fsync
        self.attempt = check_attempt(attempt)
        self._epoch: str | None = None  # the epoch id this handle has seen (None: not yet)
        self._owner: Owner | None = None  # our writer claim, while held
        try:
            if self.root.exists() and not self.root.is_dir():
                raise StoreError(f"store {self.url}: {self.root} exists and is not a directory")
            for sub in ("rollouts", "acks", "kv", "attempts", "writer", "weights"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._error("open", self.root, exc) from exc

    @classmethod
    def from_url(cls, url: str, *, attempt: int | None = None) -> FileStore:
        parts = urlsplit(url)
        path = unquote(parts.netloc + parts.path)
        if not path:
            raise ValueError(f"store url: {url!r} has no path (use file:///abs/path or file://relative/path)")
        root = Path(path) if path.startswith("/") else Path.cwd() / path
        query = parse_qs(parts.query)
        fsync = query.get("fsync", ["1"])[-1] not in ("0", "false", "no")
        return cls(root, url=url, fsync=fsync, attempt=attempt)

    # ------------------------------------------------------------------ helpers
    def _error(self, op: str, path: Path, exc: OSError) -> StoreError:
        reason = {
            errno.ENOSPC: "no space left on the volume (the volume is full)",
            errno.EDQUOT: "the disk quota is exhausted",
            errno.EACCES: "permission denied (check the volume's owner/mode and the pod's securityContext)",
            errno.EPERM: "operation not permitted",
            errno.EROFS: "the volume is mounted read-only",
        }.get(exc.errno or 0, exc.strerror or str(exc))
        err = StoreError(f"store {self.url}: cannot {op} {path}: {reason} [{exc.__class__.__name__}: {exc}]")
        err.errno = exc.errno  # type: ignore[attr-defined]  # lets callers tell a full disk from other failures
        return err

    def _rdir(self, rollout: int) -> Path:
        return self.root / "rollouts" / f"{rollout:08d}"

    def _ddir(self, rollout: int, attempt: int | None) -> Path:
        """Where attempt `attempt` writes rollout `rollout`'s payloads and schedule (unfenced: attempt 0)."""
        return self._rdir(rollout) / f"a{attempt or 0:08d}"

    def _adir(self, rollout: int) -> Path:
        return self.root / "acks" / f"{rollout:08d}"

    def _fsync_dir(self, path: Path) -> None:
        if not self.fsync:
            return
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._error("sync", path, exc) from exc

    def _write_tmp(self, path: Path, chunks: list[bytes | memoryview]) -> Path:
        """A fsync'ed temporary file beside `path` holding `chunks`; nothing is left behind on error."""
        tmp = path.with_name(f".tmp.{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for chunk in chunks:
                    _write_all(fd, chunk)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise self._error("write", path, exc) from exc
        return tmp

    def _write_atomic(self, path: Path, chunks: list[bytes | memoryview]) -> None:
        """Write `chunks` to `path` via a temporary file + fsync + rename; on error nothing is left behind."""
        tmp = self._write_tmp(path, chunks)
        try:
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise self._error("write", path, exc) from exc

    def _create_once(self, path: Path, chunks: list[bytes | memoryview]) -> bool:
        """Create `path` with `chunks` unless it exists (hard link of a temporary file: atomic, never overwrites);
        True if this call created it."""
        tmp = self._write_tmp(path, chunks)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            raise self._error("write", path, exc) from exc
        finally:
            tmp.unlink(missing_ok=True)

    def _open_regular(self, path: Path) -> int | None:
        """A read-only descriptor of the regular file at `path`, None if there is none; a FIFO, device, socket or
        directory there is refused (CorruptPayload) without blocking on it."""
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._error("read", path, exc) from exc
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
            raise CorruptPayload(f"store {self.url}: {path} is {kind}: refused (the store writes only regular files)")
        return fd

    def _read(self, path: Path, limit: int = MAX_JSON_BYTES) -> bytes | None:
        fd = self._open_regular(path)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise CorruptPayload(f"store {self.url}: {path} is {size} bytes, more than the {limit} a stored value "
                                     "may have: refused")
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read(limit + 1)
        except OSError as exc:
            raise self._error("read", path, exc) from exc
        finally:
            os.close(fd)

    def _read_json(self, path: Path) -> Any:
        data = self._read(path)
        return None if data is None else decode_json(data, where=f"store {self.url}: {path}")

    def _marker(self, rollout: int) -> Marker | None:
        path = self._rdir(rollout) / COMMIT
        data = self._read(path, limit=4096)
        return None if data is None else Marker.decode(data, where=f"store {self.url}: {path}")

    def _committed(self, sub: str = "rollouts") -> list[int]:
        """The committed rollouts (or, with sub="weights", weight versions) in ascending order."""
        try:
            names = os.listdir(self.root / sub)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self._error("list", self.root / sub, exc) from exc
        return sorted(int(n) for n in names if len(n) == 8 and n.isdigit()
                      and (self.root / sub / n / COMMIT).exists())

    def _acks(self, rollout: int) -> set[int]:
        try:
            names = os.listdir(self._adir(rollout))
        except FileNotFoundError:
            return set()
        except OSError as exc:
            raise self._error("list", self._adir(rollout), exc) from exc
        return {int(n[5:]) for n in names if n.startswith("rank-") and n[5:].isdigit()}

    # ------------------------------------------------------------------ fencing
    def _epoch_id(self, *, create: bool) -> str | None:
        """Check the store's epoch against the one this handle saw (StoreDataLost when it vanished or changed);
        with `create`, a store that never had one gets one. Returns the id."""
        path = self.root / "EPOCH"
        if self._epoch is not None and not self.root.is_dir():
            raise lost(self.url, f"its directory {self.root} is gone (this process saw epoch {self._epoch})")
        value = self._read_json(path)
        if value is None:
            if self._epoch is not None:
                raise lost(self.url, f"its epoch file {path} is gone (this process saw epoch {self._epoch})")
            if not create:
                return None
            self._create_once(path, [encode_json(new_epoch())])
            value = self._read_json(path)
        if not isinstance(value, dict) or not isinstance(value.get("id"), str):
            raise CorruptPayload(f"store {self.url}: {path}: epoch must be a JSON object with a string id")
        if self._epoch is None:
            self._epoch = value["id"]
        elif value["id"] != self._epoch:
            raise lost(self.url, f"its epoch changed from {self._epoch} to {value['id']} (the store was emptied "
                                 "and started again)")
        return self._epoch

    def _current_attempt(self) -> int | None:
        try:
            names = os.listdir(self.root / "attempts")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._error("list", self.root / "attempts", exc) from exc
        attempts = [int(n) for n in names if len(n) == 8 and n.isdigit()]
        return max(attempts) if attempts else None

    def _claims(self) -> list[tuple[int, Path]]:
        try:
            names = os.listdir(self.root / "writer")
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self._error("list", self.root / "writer", exc) from exc
        return sorted((int(n[:8]), self.root / "writer" / n) for n in names
                      if len(n) == 13 and n[:8].isdigit() and n.endswith(".json"))

    def _claim_owner(self, path: Path) -> Owner | None:
        value = self._read_json(path)
        return None if value is None else Owner.from_json(value, where=f"store {self.url}: {path}")

    def _guard(self, op: str, *, writer: bool = False) -> None:
        """Before a write: the epoch, the current attempt and (for the writer's operations) the writer claim."""
        self._epoch_id(create=True)
        if self.attempt is not None:
            current = self._current_attempt()
            if current is not None and current > self.attempt:
                raise stale(self.url, op, self.attempt, current)
        if writer:
            claims = self._claims()
            if not claims:
                return
            _, path = claims[-1]
            owner = self._claim_owner(path)
            if owner is None:
                return
            if self._owner is not None:
                if owner.token != self._owner.token:
                    if owner.attempt is not None and self.attempt is not None and owner.attempt > self.attempt:
                        raise stale(self.url, op, self.attempt, owner.attempt)
                    raise conflict(self.url, owner, self._owner, lost=True)
            elif not owner.dead_here():
                raise conflict(self.url, owner, Owner.me(self.attempt))

    def enter_attempt(self) -> int:
        if self.attempt is None:
            raise ValueError("enter_attempt: this store handle has no attempt (open_store(url, attempt=N))")
        self._epoch_id(create=True)
        current = self._current_attempt()
        if current is not None and current > self.attempt:
            raise stale(self.url, "opening the store", self.attempt, current)
        path = self.root / "attempts" / f"{self.attempt:08d}"
        if not path.exists():
            self._create_once(path, [b""])
        return self.attempt

    def claim_writer(self) -> dict[str, Any]:
        if self.attempt is not None:
            self.enter_attempt()
        else:
            self._epoch_id(create=True)
        me = self._owner or Owner.me(self.attempt)
        path = self.root / "writer" / f"{self.attempt or 0:08d}.json"
        for _ in range(5):
            claims = self._claims()
            if claims and self.attempt is not None and claims[-1][0] > self.attempt:
                raise stale(self.url, "claiming the writer", self.attempt, claims[-1][0])
            if self._create_once(path, [encode_json(me.to_json())]):
                break
            owner = self._claim_owner(path)
            if owner is None:
                continue  # released meanwhile: try again
            if owner.token == me.token:
                break
            if not owner.dead_here():
                raise conflict(self.url, owner, me)
            try:  # a dead owner's claim: move it aside (one rename wins), then claim
                os.rename(path, path.with_name(f".stale.{path.name}.{secrets.token_hex(4)}"))
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise self._error("write", path, exc) from exc
        else:
            raise StoreError(f"store {self.url}: could not claim the writer ({path}): it kept changing")
        self._owner = me
        for attempt, older in self._claims():  # claims of older attempts are superseded
            if attempt < (self.attempt or 0):
                older.unlink(missing_ok=True)
        return me.to_json()

    def writer(self) -> dict[str, Any] | None:
        """The current writer claim's owner record (None when nobody holds one)."""
        claims = self._claims()
        owner = self._claim_owner(claims[-1][1]) if claims else None
        return None if owner is None else owner.to_json()

    def epoch(self) -> str | None:
        """The store's epoch id (None before the store was first written)."""
        return self._epoch_id(create=False)

    # ------------------------------------------------------------------ writer
    def is_committed(self, rollout: int) -> bool:
        return (self._rdir(check_rollout(rollout)) / COMMIT).exists()

    def publish_rollout(
        self, rollout: int, payloads: dict[int, RankPayload], schedule: dict[str, Any], *, _after_payloads=None
    ) -> bool:
        """Publish atomically; returns False (and writes nothing) if the rollout is already committed.

        `_after_payloads` is a test hook called after the payloads and schedule are written, before the commit.
        """
        dp = check_publish(rollout, payloads, schedule)
        schedule_bytes = encode_json(schedule, where="schedule")
        files = [(_rank_file(rank), lambda rank=rank: encode_payload_parts(payloads[rank])) for rank in range(dp)]
        marker = Marker.for_schedule(rollout, dp, self.attempt, schedule_bytes)
        return self._commit_directory(self._rdir(rollout), [*files, (SCHEDULE, lambda: [schedule_bytes])],
                                      marker.encode(), f"rollout {rollout}", writer=True, hook=_after_payloads)

    def _commit_directory(self, d: Path, files: list, marker: bytes, what: str, *, writer: bool, hook=None) -> bool:
        """The commit protocol of rollouts and weight versions: False (nothing written) when `d` is committed; else
        the fencing checks, each file (name, () -> chunks) written atomically into this attempt's directory inside
        `d` (temporary files of a killed writer removed first), that directory fsynced, the checks again, then the
        COMMIT `marker` linked into `d` (never overwritten: False when someone committed meanwhile, theirs stands)
        and `d` fsynced. `writer`: the rollout writer's claim is checked too. `hook` runs before the marker (tests)."""
        if (d / COMMIT).exists():
            return False
        ddir = d / f"a{self.attempt or 0:08d}"
        self._guard(f"publishing {what}", writer=writer)
        try:
            ddir.mkdir(parents=True, exist_ok=True)
            for stale_tmp in [*ddir.glob(".tmp.*"), *d.glob(".tmp.*")]:
                stale_tmp.unlink(missing_ok=True)
        except OSError as exc:
            raise self._error("create", ddir, exc) from exc
        for name, chunks in files:
            self._write_atomic(ddir / name, chunks())
        if hook is not None:
            hook()
        self._fsync_dir(ddir)
        self._guard(f"committing {what}", writer=writer)
        if not self._create_once(d / COMMIT, [marker]):
            return False  # committed meanwhile by someone else: theirs stands
        self._fsync_dir(d)
        return True

    def finish(self, num_rollouts: int) -> None:
        check_rollout(num_rollouts, "num_rollouts")
        self._guard("finishing the stream", writer=True)
        self._write_atomic(self.root / "FINISHED", [encode_json({"num_rollouts": num_rollouts})])

    def finished(self) -> int | None:
        """num_rollouts given to finish(), or None while the stream is open."""
        path = self.root / "FINISHED"
        value = self._read_json(path)
        if value is None:
            return None
        return stored_int(value.get("num_rollouts") if isinstance(value, dict) else value,
                          where=f"store {self.url}: {path}", field="num_rollouts")

    def pending_rollouts(self) -> int:
        self._epoch_id(create=False)
        count = 0
        for k in self._committed():
            marker = self._marker(k)
            if marker is None:  # released meanwhile
                continue
            if len(self._acks(k)) < marker.dp_size:
                count += 1
        return count

    # ------------------------------------------------------------------ readers
    def _released(self) -> int:
        path = self.root / "RELEASED"
        value = self._read_json(path)
        if value is None:
            return 0
        return stored_int(value.get("upto") if isinstance(value, dict) else value,
                          where=f"store {self.url}: {path}", field="upto")

    def wait_rollout(self, rollout: int, timeout: float | None = None) -> bool:
        check_rollout(rollout)
        marker = self._rdir(rollout) / COMMIT

        def check() -> bool | None:
            self._epoch_id(create=False)
            if marker.exists():
                return True
            if rollout < self._released():
                raise RolloutReleased(f"store {self.url}: rollout {rollout} was released (deleted) after every rank acked it")
            done = self.finished()
            if done is not None and rollout >= done:
                return False
            return None

        # polls back off to 50 ms (a few stat calls): an on-policy loop waits here once per rollout, and a 250 ms cap
        # added ~0.12 s per rollout to the demo's ~0.65 s
        return poll(check, timeout, f"rollout {rollout} in store {self.url} (key {marker})", max_interval=0.05)

    def _require_committed(self, rollout: int) -> Marker:
        check_rollout(rollout)
        marker = self._marker(rollout)
        if marker is None:
            self._epoch_id(create=False)
            path = self._rdir(rollout) / COMMIT
            raise StoreError(f"store {self.url}: rollout {rollout} is not committed (key {path}); wait_rollout first")
        if marker.rollout != rollout:
            raise CorruptPayload(f"store {self.url}: {self._rdir(rollout) / COMMIT}: commit marker names rollout "
                                 f"{marker.rollout}")
        return marker

    def _gone(self, rollout: int, path: Path) -> StoreError:
        """A committed rollout's part is missing: released meanwhile, or the store lost it."""
        self._epoch_id(create=False)
        if rollout < self._released() or not (self._rdir(rollout) / COMMIT).exists():
            return RolloutReleased(f"store {self.url}: rollout {rollout} was released (deleted) while being read")
        return lost(self.url, f"rollout {rollout} is committed but {path} is missing")

    def payload_path(self, rollout: int, rank: int) -> Path:
        """Where the committed payload of `rank` lives (for tools and tests)."""
        return self._ddir(rollout, self._require_committed(rollout).attempt) / _rank_file(rank)

    def read_schedule(self, rollout: int) -> dict[str, Any]:
        marker = self._require_committed(rollout)
        path = self._ddir(rollout, marker.attempt) / SCHEDULE
        data = self._read(path)
        if data is None:
            raise self._gone(rollout, path)
        where = f"store {self.url}: {path}"
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
        path = self._ddir(rollout, marker.attempt) / _rank_file(rank)
        fd = self._open_regular(path)
        if fd is None:
            raise self._gone(rollout, path)
        where = f"store {self.url}: {path}"
        try:
            buf = _map_or_read(fd, where)
        except OSError as exc:
            raise self._error("read", path, exc) from exc
        finally:
            os.close(fd)
        return decode_payload(buf, where=where)

    def ack(self, rollout: int, rank: int) -> None:
        check_rollout(rollout)
        self._guard(f"acknowledging rollout {rollout}")
        adir = self._adir(rollout)
        path = adir / f"rank-{rank:05d}"
        try:
            adir.mkdir(parents=True, exist_ok=True)
            path.touch()
        except OSError as exc:
            raise self._error("write", path, exc) from exc

    def release_upto(self, rollout: int) -> None:
        check_rollout(rollout)
        self._guard(f"releasing rollouts below {rollout}")
        released = self._released()
        upto = rollout
        for k in self._committed():
            if k >= rollout:
                break
            marker = self._marker(k)
            if marker is None or len(self._acks(k)) < marker.dp_size:
                upto = min(upto, k)
                continue
            try:
                (self._rdir(k) / COMMIT).unlink(missing_ok=True)  # invisible first, then delete
                shutil.rmtree(self._rdir(k), ignore_errors=True)
                shutil.rmtree(self._adir(k), ignore_errors=True)
            except OSError as exc:
                raise self._error("delete", self._rdir(k), exc) from exc
        # RELEASED marks the low-water mark below which every rollout is gone (not just some).
        if upto > released:
            self._write_atomic(self.root / "RELEASED", [encode_json({"upto": upto})])

    # ------------------------------------------------------------------ weights
    def _wdir(self, version: int) -> Path:
        return self.root / "weights" / f"{version:08d}"

    def publish_weights(self, version: int, arrays: dict[str, np.ndarray], meta: dict[str, Any], *,
                        _after_tensors=None) -> bool:
        """Publish weight version `version` atomically (tensors, meta, then COMMIT; fenced by the epoch and the
        attempt: a trainer of an older attempt is refused); False (nothing written) when already committed.

        `_after_tensors` is a test hook called after tensors and meta are written, before the commit."""
        check_weights(version, arrays, meta)
        meta_bytes = encode_json(meta, where="meta")
        if (self._wdir(version) / COMMIT).exists():
            return False
        parts = encode_arrays_parts(arrays)
        nbytes = sum(memoryview(p).nbytes for p in parts)
        marker = WeightsMarker.for_meta(version, self.attempt, nbytes, 1, meta_bytes)
        return self._commit_directory(self._wdir(version), [("tensors.bin", lambda: parts),
                                                            ("meta.json", lambda: [meta_bytes])],
                                      marker.encode(), f"weight version {version}", writer=False, hook=_after_tensors)

    def latest_weights(self) -> int | None:
        self._epoch_id(create=False)
        versions = self._committed("weights")
        return versions[-1] if versions else None

    def _weights_gone(self, version: int, path: Path) -> StoreError:
        """A committed version's part is missing: released meanwhile, or the store lost it."""
        self._epoch_id(create=False)
        if not (self._wdir(version) / COMMIT).exists():
            return StoreError(f"store {self.url}: weight version {version} was released while being read")
        return lost(self.url, f"weight version {version} is committed but {path} is missing")

    def weights_path(self, version: int) -> Path:
        """Where the tensors of a committed weight version live (for tools and tests)."""
        return self._wdir(version) / f"a{self._weights_marker(version).attempt:08d}" / "tensors.bin"

    def _weights_marker(self, version: int) -> WeightsMarker:
        path = self._wdir(check_rollout(version, "version")) / COMMIT
        data = self._read(path, limit=4096)
        if data is None:
            self._epoch_id(create=False)
            raise StoreError(f"store {self.url}: weight version {version} is not committed (key {path})")
        marker = WeightsMarker.decode(data, where=f"store {self.url}: {path}")
        if marker.version != version or marker.chunks != 1:
            raise CorruptPayload(f"store {self.url}: {path}: commit marker names version {marker.version} in "
                                 f"{marker.chunks} pieces")
        return marker

    def read_weights(self, version: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(arrays, meta) of a committed version, every tensor checked (marker, meta CRC, header, size, checksums);
        StoreError when it is not (or no longer) committed, CorruptPayload naming the path when damaged."""
        marker = self._weights_marker(version)
        ddir = self._wdir(version) / f"a{marker.attempt:08d}"
        meta_path, path = ddir / "meta.json", ddir / "tensors.bin"
        meta_bytes = self._read(meta_path)
        if meta_bytes is None:
            raise self._weights_gone(version, meta_path)
        marker.check_meta(meta_bytes, where=f"store {self.url}: {meta_path}")
        meta = decode_json(meta_bytes, where=f"store {self.url}: {meta_path}")
        if not isinstance(meta, dict):
            raise CorruptPayload(f"store {self.url}: {meta_path}: weight meta is not a JSON object")
        fd = self._open_regular(path)
        if fd is None:
            raise self._weights_gone(version, path)
        where = f"store {self.url}: {path}"
        try:
            if os.fstat(fd).st_size != marker.nbytes:
                raise CorruptPayload(f"{where}: {os.fstat(fd).st_size} bytes, but its commit marker records "
                                     f"{marker.nbytes}")
            buf = _map_or_read(fd, where, spec=None)
        except OSError as exc:
            raise self._error("read", path, exc) from exc
        finally:
            os.close(fd)
        return decode_arrays(buf, where=where), meta

    def release_weights_below(self, version: int) -> None:
        """Delete committed versions < `version` (commit marker first: a reader never sees half a version);
        fenced like every write."""
        check_rollout(version, "version")
        self._guard(f"releasing weight versions below {version}")
        for v in self._committed("weights"):
            if v >= version:
                break
            try:
                (self._wdir(v) / COMMIT).unlink(missing_ok=True)  # invisible first, then delete
                shutil.rmtree(self._wdir(v), ignore_errors=True)
            except OSError as exc:
                raise self._error("delete", self._wdir(v), exc) from exc

    # ------------------------------------------------------------------ shared state
    def put_json(self, key: str, value: dict[str, Any]) -> None:
        data = encode_json(value, where=f"put_json({key!r})")
        path = self.root / "kv" / f"{check_key(key)}.json"
        self._guard(f"writing {key}")
        self._write_atomic(path, [data])

    def get_json(self, key: str) -> dict[str, Any] | None:
        return self._read_json(self.root / "kv" / f"{check_key(key)}.json")

    def close(self) -> None:
        """Release the writer claim if this handle holds it."""
        owner, self._owner = self._owner, None
        if owner is None:
            return
        path = self.root / "writer" / f"{self.attempt or 0:08d}.json"
        try:
            current = self._claim_owner(path)
            if current is not None and current.token == owner.token:
                path.unlink(missing_ok=True)
        except (StoreError, OSError):
            pass  # best effort: a dead owner's claim is taken over by the next writer of its attempt

    def __repr__(self) -> str:
        return f"FileStore({self.url!r})"


def _map_or_read(fd: int, where: str, *, spec: Any = PAYLOAD_SPEC) -> memoryview:
    """The whole payload file, read-only. Its header is read first and checked: a file whose size differs from what
    the header accounts for is refused before it is mapped or read whole. Payload files are immutable once written
    (temp file + rename; deletion unlinks), so they are memory-mapped with the pages populated up front: no copy out
    of the page cache, and the decoded arrays are views of the mapping (it lives as long as they do). Falls back to
    one read where mmap cannot be used."""
    size = os.fstat(fd).st_size
    span = header_span(os.pread(fd, 16, 0))
    prefix = os.pread(fd, min(span, size), 0)
    _, _, total = parse_header(prefix, where=where, spec=spec)
    if total != size:
        raise CorruptPayload(
            f"{where}: payload file is {size} bytes but its header accounts for {total}"
            + (" (truncated write?)" if size < total else ": refused before reading it"))
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if size and populate:
        try:
            return memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ))
        except (OSError, ValueError):
            pass  # e.g. a filesystem without mmap support
    buf = np.empty(size, dtype=np.uint8)  # not zero-filled, unlike bytearray
    view, got = memoryview(buf), 0
    while got < size:
        n = os.preadv(fd, [view[got:]], got)
        if n == 0:
            break
        got += n
    return view[:got]
