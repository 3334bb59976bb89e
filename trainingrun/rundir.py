"""The run-directory lock: one live `trainingrun run` per run directory.

The launcher holds an exclusive `flock` on `DIR/launcher.lock` for as long as it runs, and writes its identity
(pid, host, start time, command line) into the file. A second launcher on the same directory fails to take the lock
at once and is refused with a message naming the owner. The kernel releases a flock when its holder dies, even by
SIGKILL, so a crashed launcher never leaves a stale lock behind; the file itself stays (with the last owner's
identity) and is simply locked again by the next run. `trainingrun status` asks the same lock whether a run is live.
Children do not inherit the lock (subprocess closes inherited descriptors).

The lock is for one machine's filesystem (flock on NFS depends on the server); a cluster run's single writer is the
store's claim, not this file.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOCK_FILE = "launcher.lock"


class RunDirBusy(RuntimeError):
    """Another live launcher holds the run directory."""

    def __init__(self, run_dir: Path, owner: dict[str, Any]):
        self.run_dir = run_dir
        self.owner = owner
        super().__init__(f"{run_dir} is in use by another `trainingrun run`: {describe_owner(owner)}; wait for it to "
                         "finish or stop it (Ctrl-C in its terminal, or kill -TERM its pid), or use another --out")


def describe_owner(owner: dict[str, Any]) -> str:
    if not owner:
        return "owner unknown (the lock file is empty)"
    started = owner.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}, started {when}"


def read_owner(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / LOCK_FILE).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass
class RunDirLock:
    """`with RunDirLock(dir):` holds the directory's lock; RunDirBusy if another live launcher holds it."""

    run_dir: Path
    _fd: int | None = None

    def acquire(self) -> RunDirLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirBusy(self.run_dir, read_owner(self.run_dir)) from None
        except BaseException:
            os.close(fd)
            raise
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "argv": sys.argv}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock; the file stays with the last owner's identity
            self._fd = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def live_owner(run_dir: Path) -> dict[str, Any] | None:
    """The identity of the launcher that holds `run_dir` now, or None when no live launcher holds it."""
    path = run_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return read_owner(run_dir) or {"pid": None}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
