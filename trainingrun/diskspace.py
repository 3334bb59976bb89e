"""A full volume (ENOSPC, an exhausted quota) told apart from other failures, in one place.

A full disk is not fixed by restarting: every attempt would fail the same way. So the run's processes turn it into
one clear line and exit 78 (the run stops at once, `failure_policy`), and the local launcher, which writes on the
same volume, checks it whenever a process failed, stops the run cleanly, and says so — also when the failing
process could not even write its own message. Full means less than 1 MiB available, or, on the volume holding the
checkpoints, less than the newest checkpoint takes: the next one would not fit (a rank that met the full volume
removes its partial checkpoint, so the space it held is free again when the launcher looks).
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable
from pathlib import Path

NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# a volume with less than this available counts as full: a checkpoint or a log line no longer fits
FULL_BELOW_BYTES = 1 << 20


# "[Errno 28] No space left on device" inside the message of an exception that wrapped the OSError as text (the
# worker processes of Megatron's checkpoint writer report "Worker failure: [Errno 28] ..."; the errno is gone)
_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]")


def no_space(exc: BaseException | None) -> OSError | None:
    """The OSError saying "no space left" (or "quota exceeded") that caused `exc`, following its causes.

    Also found: an errno attribute (e.g. a StoreError carrying it), the failures of a checkpoint writer that gathers
    its ranks' exceptions (torch's `CheckpointException.failures`: {rank: (exception, stack)}), and an OSError that a
    writer turned into text (`[Errno 28] No space left on device` in the message)."""
    todo: list[BaseException] = [] if exc is None else [exc]
    seen: set[int] = set()
    while todo:
        exc = todo.pop(0)
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
            return exc
        if getattr(exc, "errno", None) in NO_SPACE_ERRNOS:
            return OSError(exc.errno, str(exc))
        m = _ERRNO_IN_TEXT.search(str(exc)) if exc.args else None
        if m and int(m.group(1)) in NO_SPACE_ERRNOS:
            return OSError(int(m.group(1)), os.strerror(int(m.group(1))))
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                inner = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(inner, BaseException):
                    todo.append(inner)
        for nxt in (exc.__cause__, exc.__context__):
            if nxt is not None:
                todo.append(nxt)
    return None


def _statvfs(path: str | Path) -> tuple[os.statvfs_result, Path] | None:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return os.statvfs(p), p
    except OSError:
        return None


def _volume_line(path: str | Path, st: os.statvfs_result, needed: str = "") -> str:
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return (f"no space left on the volume holding {Path(path)} ({_size(free)} free of {_size(total)}{needed}): free "
            "some space and run the same command again to resume from the last checkpoint")


def full_volume(paths: Iterable[str | Path], below: int = FULL_BELOW_BYTES, *, what: str = "") -> str | None:
    """A message naming the first of `paths` whose volume has less than `below` bytes available, else None.

    `what`: what needs the `below` bytes (e.g. "a checkpoint"), said in the message."""
    seen: set[int] = set()
    for path in paths:
        found = _statvfs(path)
        if found is None or found[0].f_fsid in seen:
            continue
        st = found[0]
        seen.add(st.f_fsid)
        if st.f_bavail * st.f_frsize < below:
            return _volume_line(path, st, f"; {what} takes {_size(below, than=st.f_bavail * st.f_frsize)}" if what
                                else "")
    return None


def usage(path: str | Path) -> int:
    """Bytes the files under `path` take on their volume (allocated blocks, as `du` counts; 0 when it is gone)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:  # removed meanwhile (a checkpoint being pruned)
                continue
    return total


def describe(exc: BaseException, fallback_paths: Iterable[str | Path] = ()) -> str | None:
    """One line for an exception caused by a full volume (None when it was not): the volume of the path the errno
    names, or the first full volume among `fallback_paths` (a library that reports a failed write without its
    errno, e.g. torch.save)."""
    err = no_space(exc)
    if err is None:
        return full_volume(fallback_paths)
    filename = getattr(err, "filename", None)
    found = _statvfs(filename) if filename else None
    if found is not None:
        return _volume_line(filename, found[0])
    return full_volume(fallback_paths) or (
        f"no space left on device ({err.strerror or err}): free some space and run the same command again to resume "
        "from the last checkpoint")


def _size(n: float, than: float | None = None) -> str:
    """`n` in binary units; in bytes when it would read the same as `than` (free 1.7 MiB, a checkpoint needs 1.7)."""
    if than is not None and than != n and _size(n) == _size(than):
        return f"{n:.0f} B (free: {than:.0f} B)"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
