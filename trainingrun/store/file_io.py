"""The file store's I/O primitives on a local or shared volume (no flock anywhere): writes through a temporary file,
fsync and rename (or, for names that must never be overwritten, a hard link that fails if the name exists), reads
that refuse anything but a regular file without blocking on it (a FIFO at a store path), bounded reads, listings,
read-only maps of immutable payload files, and the wording of OS errors (a full or read-only volume, permission
denied) as `StoreError`s naming the store and the path. `file.py` lays the store out on top of these."""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from trainingrun.contract.errors import CorruptPayload, StoreError
from trainingrun.store.wire import PAYLOAD_SPEC, Header, Spec, decode_json, header_span, parse_header

MAX_JSON_BYTES = 1 << 30  # a stored JSON value (the largest are schedules of huge rollouts)
_REASONS = {
    errno.ENOSPC: "no space left on the volume (the volume is full)",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EACCES: "permission denied (check the volume's owner/mode and the pod's securityContext)",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "the volume is mounted read-only",
}


def _write_all(fd: int, chunk: bytes | memoryview) -> None:
    """Write every byte of `chunk` to `fd` (os.write may write less than asked)."""
    view = memoryview(chunk).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


class Volume:
    """The I/O of one file store (`url` goes into every error; `fsync=False` skips fsync: safe against a process
    crash, not a node crash)."""

    def __init__(self, url: str, *, fsync: bool = True):
        self.url = url
        self.fsync = fsync

    def error(self, op: str, path: Path, exc: OSError) -> StoreError:
        """`exc` as a StoreError naming the store, the path and the reason; `.errno` tells a full disk apart."""
        reason = _REASONS.get(exc.errno or 0, exc.strerror or str(exc))
        err = StoreError(f"store {self.url}: cannot {op} {path}: {reason} [{exc.__class__.__name__}: {exc}]")
        err.errno = exc.errno  # type: ignore[attr-defined]  # lets callers tell a full disk from other failures
        return err

    def retire(self, path: Path) -> None:
        """Move `path` aside (one rename wins; gone already is fine): a dead owner's claim before it is taken over."""
        try:
            os.rename(path, path.with_name(f".stale.{path.name}.{secrets.token_hex(4)}"))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self.error("write", path, exc) from exc

    def listdir(self, path: Path) -> list[str]:
        """The names in directory `path` ([] when it does not exist)."""
        try:
            return os.listdir(path)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self.error("list", path, exc) from exc

    def fsync_dir(self, path: Path) -> None:
        if not self.fsync:
            return
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise self.error("sync", path, exc) from exc

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
            raise self.error("write", path, exc) from exc
        return tmp

    def write_atomic(self, path: Path, chunks: list[bytes | memoryview]) -> None:
        """Write `chunks` to `path` via a temporary file + fsync + rename; on error nothing is left behind."""
        tmp = self._write_tmp(path, chunks)
        try:
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise self.error("write", path, exc) from exc

    def create_once(self, path: Path, chunks: list[bytes | memoryview]) -> bool:
        """Create `path` with `chunks` unless it exists (hard link of a temporary file: atomic, never overwrites);
        True if this call created it."""
        tmp = self._write_tmp(path, chunks)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            raise self.error("write", path, exc) from exc
        finally:
            tmp.unlink(missing_ok=True)

    def open_regular(self, path: Path) -> tuple[int, int] | None:
        """(a read-only descriptor, the size) of the regular file at `path`, None if there is none; a FIFO, device,
        socket or directory there is refused (CorruptPayload) without blocking on it."""
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self.error("read", path, exc) from exc
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            mode = st.st_mode
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
            raise CorruptPayload(f"store {self.url}: {path} is {kind}: refused (the store writes only regular files)")
        return fd, st.st_size

    def read(self, path: Path, limit: int = MAX_JSON_BYTES) -> bytes | None:
        """The bytes of the regular file at `path` (None: none there); CorruptPayload when larger than `limit`."""
        opened = self.open_regular(path)
        if opened is None:
            return None
        fd, size = opened
        try:
            if size > limit:
                raise CorruptPayload(f"store {self.url}: {path} is {size} bytes, more than the {limit} a stored value "
                                     "may have: refused")
            chunks, got = [], 0
            while got <= limit:  # to the end of the file (it may have grown since fstat), never more than limit + 1
                chunk = os.read(fd, min(max(size - got, 0) + 1, limit + 1 - got))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        except OSError as exc:
            raise self.error("read", path, exc) from exc
        finally:
            os.close(fd)

    def read_json(self, path: Path) -> Any:
        data = self.read(path)
        return None if data is None else decode_json(data, where=f"store {self.url}: {path}")

    def map_arrays(self, path: Path, *, spec: Spec | None = PAYLOAD_SPEC,
                   check_size: Callable[[int], None] | None = None) -> tuple[memoryview, Header] | None:
        """The whole file of encoded arrays at `path` (None: no file there), read-only, with its checked header.
        `check_size(size)` (when given) vets the file's size first; then the header is read and checked: a file
        whose size differs from what the header accounts for is refused before it is mapped or read whole. Payload
        and weight files are immutable once written (temp file + rename; deletion unlinks), so they are
        memory-mapped with the pages populated up front: no copy out of the page cache, and the decoded arrays are
        views of the mapping (it lives as long as they do). Falls back to one read where mmap cannot be used. The
        header comes back parsed, so the decoder does not parse it again."""
        opened = self.open_regular(path)
        if opened is None:
            return None
        fd, size = opened
        where = f"store {self.url}: {path}"
        try:
            if check_size is not None:
                check_size(size)
            return _map(fd, size, where, spec)
        except OSError as exc:
            raise self.error("read", path, exc) from exc
        finally:
            os.close(fd)


def _map(fd: int, size: int, where: str, spec: Spec | None) -> tuple[memoryview, Header]:
    head = os.pread(fd, 4096, 0)  # the header of a rank payload fits; a longer one is read once more
    span = header_span(head)
    if span > len(head):
        head = os.pread(fd, min(span, size), 0)
    header = parse_header(head, where=where, spec=spec)
    if header.total != size:
        raise CorruptPayload(
            f"{where}: payload file is {size} bytes but its header accounts for {header.total}"
            + (" (truncated write?)" if size < header.total else ": refused before reading it"))
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if size and populate:
        try:
            return memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ)), header
        except (OSError, ValueError):
            pass  # e.g. a filesystem without mmap support
    buf = np.empty(size, dtype=np.uint8)  # not zero-filled, unlike bytearray
    view, got = memoryview(buf), 0
    while got < size:
        n = os.preadv(fd, [view[got:]], got)
        if n == 0:
            break
        got += n
    return view[:got], header
