"""`file://` store: a directory, also on a shared ReadWriteMany volume (no locks, no flock; immutable payload
files are read through read-only memory maps).

Layout under the root directory:

    rollouts/00000007/rank-00000.bin   rank payloads (wire format)
    rollouts/00000007/schedule.json    the schedule (JSON)
    rollouts/00000007/COMMIT           commit marker, written last: {"rollout", "dp_size"}
    acks/00000007/rank-00000           one empty file per acknowledging rank
    kv/<key>.json                      put_json/get_json
    FINISHED                           {"num_rollouts": n}, written by finish(n)
    RELEASED                           {"upto": k}: rollouts < k may have been deleted

Every file is written as a temporary file in the same directory (`.tmp.<name>.<pid>.<random>`), fsync'ed, and
renamed over its final name; rename within a directory is atomic on local file systems and NFS, so a reader sees the
old file or the new one, never a half-written one. The commit marker is renamed into place after the payloads and
the schedule (and the directory) were fsync'ed, so a reader that sees COMMIT sees the whole rollout. A writer killed
before the marker leaves a directory without COMMIT, which readers ignore; a re-publish overwrites it and commits.
Temporary files left by a killed writer are removed by the next publish of that rollout.

Query options: `file:///path?fsync=0` skips fsync (faster; safe against process crashes, not against a node crash).
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np

from trainingrun.store.base import RankPayload, RolloutReleased, StoreError
from trainingrun.store.common import check_key, check_publish, check_rollout, poll
from trainingrun.store.wire import decode_json, decode_payload, encode_json, encode_payload_parts

COMMIT = "COMMIT"
SCHEDULE = "schedule.json"


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def _write_all(fd: int, chunk: bytes | memoryview) -> None:
    """Write every byte of `chunk` to `fd` (os.write may write less than asked)."""
    view = memoryview(chunk).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


class FileStore:
    """A Store in a directory. See the module docstring for the layout and the atomicity argument."""

    def __init__(self, root: str | Path, *, url: str | None = None, fsync: bool = True):
        self.root = Path(root)
        self.url = url or f"file://{self.root}"
        self.fsync = fsync
        try:
            for sub in ("rollouts", "acks", "kv"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._error("open", self.root, exc) from exc

    @classmethod
    def from_url(cls, url: str) -> FileStore:
        parts = urlsplit(url)
        path = unquote(parts.netloc + parts.path)
        if not path:
            raise ValueError(f"store url: {url!r} has no path (use file:///abs/path or file://relative/path)")
        root = Path(path) if path.startswith("/") else Path.cwd() / path
        query = parse_qs(parts.query)
        fsync = query.get("fsync", ["1"])[-1] not in ("0", "false", "no")
        return cls(root, url=url, fsync=fsync)

    # ------------------------------------------------------------------ helpers
    def _error(self, op: str, path: Path, exc: OSError) -> StoreError:
        reason = {
            errno.ENOSPC: "the volume is full",
            errno.EDQUOT: "the disk quota is exhausted",
            errno.EACCES: "permission denied (check the volume's owner/mode and the pod's securityContext)",
            errno.EPERM: "operation not permitted",
            errno.EROFS: "the volume is mounted read-only",
        }.get(exc.errno or 0, exc.strerror or str(exc))
        return StoreError(f"store {self.url}: cannot {op} {path}: {reason} [{exc.__class__.__name__}: {exc}]")

    def _rdir(self, rollout: int) -> Path:
        return self.root / "rollouts" / f"{rollout:08d}"

    def _adir(self, rollout: int) -> Path:
        return self.root / "acks" / f"{rollout:08d}"

    def _fsync_dir(self, path: Path) -> None:
        if not self.fsync:
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_atomic(self, path: Path, chunks: list[bytes | memoryview]) -> None:
        """Write `chunks` to `path` via a temporary file + fsync + rename; on error nothing is left behind."""
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
            os.replace(tmp, path)
        except OSError as exc:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise self._error("write", path, exc) from exc

    def _read(self, path: Path) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._error("read", path, exc) from exc

    def _read_json(self, path: Path) -> Any:
        data = self._read(path)
        return None if data is None else decode_json(data, where=f"store {self.url}: {path}")

    def _committed(self) -> list[int]:
        try:
            names = os.listdir(self.root / "rollouts")
        except OSError as exc:
            raise self._error("list", self.root / "rollouts", exc) from exc
        out = []
        for name in names:
            if name.isdigit() and (self.root / "rollouts" / name / COMMIT).exists():
                out.append(int(name))
        return sorted(out)

    def _acks(self, rollout: int) -> set[int]:
        try:
            return {int(n[5:]) for n in os.listdir(self._adir(rollout)) if n.startswith("rank-")}
        except FileNotFoundError:
            return set()
        except OSError as exc:
            raise self._error("list", self._adir(rollout), exc) from exc

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
        rdir = self._rdir(rollout)
        if (rdir / COMMIT).exists():
            return False
        try:
            rdir.mkdir(parents=True, exist_ok=True)
            for stale in rdir.glob(".tmp.*"):
                stale.unlink(missing_ok=True)
        except OSError as exc:
            raise self._error("create", rdir, exc) from exc
        for rank in range(dp):
            self._write_atomic(rdir / _rank_file(rank), encode_payload_parts(payloads[rank]))
        self._write_atomic(rdir / SCHEDULE, [schedule_bytes])
        if _after_payloads is not None:
            _after_payloads()
        try:
            self._fsync_dir(rdir)
        except OSError as exc:
            raise self._error("sync", rdir, exc) from exc
        self._write_atomic(rdir / COMMIT, [encode_json({"rollout": rollout, "dp_size": dp})])
        try:
            self._fsync_dir(rdir)
        except OSError as exc:
            raise self._error("sync", rdir, exc) from exc
        return True

    def finish(self, num_rollouts: int) -> None:
        check_rollout(num_rollouts, "num_rollouts")
        self._write_atomic(self.root / "FINISHED", [encode_json({"num_rollouts": num_rollouts})])

    def finished(self) -> int | None:
        """num_rollouts given to finish(), or None while the stream is open."""
        value = self._read_json(self.root / "FINISHED")
        return None if value is None else int(value["num_rollouts"])

    def pending_rollouts(self) -> int:
        count = 0
        for k in self._committed():
            commit = self._read_json(self._rdir(k) / COMMIT)
            if commit is None:  # released meanwhile
                continue
            if len(self._acks(k)) < int(commit["dp_size"]):
                count += 1
        return count

    # ------------------------------------------------------------------ readers
    def _released(self) -> int:
        value = self._read_json(self.root / "RELEASED")
        return 0 if value is None else int(value["upto"])

    def wait_rollout(self, rollout: int, timeout: float | None = None) -> bool:
        check_rollout(rollout)
        marker = self._rdir(rollout) / COMMIT

        def check() -> bool | None:
            if marker.exists():
                return True
            if rollout < self._released():
                raise RolloutReleased(f"store {self.url}: rollout {rollout} was released (deleted) after every rank acked it")
            done = self.finished()
            if done is not None and rollout >= done:
                return False
            return None

        return poll(check, timeout, f"rollout {rollout} in store {self.url} (key {marker})")

    def _require_committed(self, rollout: int) -> Path:
        rdir = self._rdir(check_rollout(rollout))
        if not (rdir / COMMIT).exists():
            raise StoreError(f"store {self.url}: rollout {rollout} is not committed (key {rdir / COMMIT}); wait_rollout first")
        return rdir

    def read_schedule(self, rollout: int) -> dict[str, Any]:
        path = self._require_committed(rollout) / SCHEDULE
        value = self._read_json(path)
        if not isinstance(value, dict):
            raise StoreError(f"store {self.url}: {path} is missing or not a JSON object")
        return value

    def read_payload(self, rollout: int, rank: int) -> RankPayload:
        path = self._require_committed(rollout) / _rank_file(rank)
        try:
            with open(path, "rb", buffering=0) as f:
                buf = _map_or_read(f)
        except FileNotFoundError:
            raise StoreError(f"store {self.url}: rollout {rollout} has no payload for rank {rank} ({path})") from None
        except OSError as exc:
            raise self._error("read", path, exc) from exc
        return decode_payload(buf, where=f"store {self.url}: {path}")

    def ack(self, rollout: int, rank: int) -> None:
        check_rollout(rollout)
        adir = self._adir(rollout)
        path = adir / f"rank-{rank:05d}"
        try:
            adir.mkdir(parents=True, exist_ok=True)
            path.touch()
        except OSError as exc:
            raise self._error("write", path, exc) from exc

    def release_upto(self, rollout: int) -> None:
        check_rollout(rollout)
        released = self._released()
        upto = rollout
        for k in self._committed():
            if k >= rollout:
                break
            commit = self._read_json(self._rdir(k) / COMMIT)
            if commit is None or len(self._acks(k)) < int(commit["dp_size"]):
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

    # ------------------------------------------------------------------ shared state
    def put_json(self, key: str, value: dict[str, Any]) -> None:
        data = encode_json(value, where=f"put_json({key!r})")
        self._write_atomic(self.root / "kv" / f"{check_key(key)}.json", [data])

    def get_json(self, key: str) -> dict[str, Any] | None:
        return self._read_json(self.root / "kv" / f"{check_key(key)}.json")

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"FileStore({self.url!r})"


def _map_or_read(f) -> memoryview:
    """The whole file, read-only. Payload files are immutable once written (temp file + rename; deletion unlinks),
    so they are memory-mapped with the pages populated up front: no copy out of the page cache, and the decoded
    arrays are views of the mapping (it lives as long as they do). Falls back to one read where mmap cannot be used.
    """
    size = os.fstat(f.fileno()).st_size
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if size and populate:
        try:
            return memoryview(mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ))
        except (OSError, ValueError):
            pass  # e.g. a filesystem without mmap support
    buf = np.empty(size, dtype=np.uint8)  # not zero-filled, unlike bytearray
    got = f.readinto(buf)
    return memoryview(buf)[:got]
