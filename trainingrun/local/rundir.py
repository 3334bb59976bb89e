"""Run directories: what `trainingrun run --out DIR` may do with DIR, and the lock that keeps one launcher per DIR.

Safety rules (`check_out_dir`, `spec_change`, `clear_for_fresh`):
  * `--out` naming a file, or a directory that is neither empty nor a run directory (no `run.yaml`), is refused
    with one line; nothing is written.
  * An earlier run in DIR with a different spec is refused, showing the difference, unless `--resume` (continue its
    checkpoints with the changed spec, e.g. more rollouts) or `--fresh` (delete the earlier run's files and start
    over) says what to do. `--fresh` deletes only inside a run directory. A spec that differs only in
    `trainer.replicas` (another `--trainers`) resumes without `--resume` (`resize_only`): resizing continues the
    run exactly.

The lock:

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

import difflib
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

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


# Files and directories a run directory may hold (trainingrun.local: run.yaml, logs/, raw/, store/, checkpoints/, ...)
RUN_MARKERS = ("run.yaml", "summary.json", "pids.json", "metrics.jsonl", LOCK_FILE)


def is_run_dir(path: Path) -> bool:
    return any((path / m).exists() for m in RUN_MARKERS)


def check_out_dir(path: Path) -> str | None:
    """None when `path` may be a run directory (absent, empty or a run directory), else the one-line reason."""
    if path.exists() and not path.is_dir():
        return f"--out {path}: is a file, not a directory"
    if path.is_dir() and not is_run_dir(path) and any(path.iterdir()):
        return (f"--out {path}: the directory is not empty and is not a run directory (no run.yaml); "
                "use an empty or new directory")
    return None


def spec_change(path: Path, spec_text: str, max_lines: int = 40) -> str | None:
    """The unified difference between DIR/run.yaml and `spec_text`, or None when equal or there is no run.yaml."""
    try:
        old = (path / "run.yaml").read_text()
    except OSError:
        return None
    if old == spec_text:
        return None
    diff = list(difflib.unified_diff(old.splitlines(), spec_text.splitlines(), f"{path / 'run.yaml'} (earlier run)",
                                     "the spec given now", lineterm="", n=1))
    if len(diff) > max_lines:
        diff = diff[:max_lines] + [f"... ({len(diff) - max_lines} more lines)"]
    return "\n".join(diff)


def resize_only(path: Path, spec_text: str) -> tuple[int, int] | None:
    """(earlier, now) `spec.trainer.replicas` when DIR/run.yaml differs from `spec_text` in nothing else: the run is
    being resized (another `--trainers`), which continues it exactly (elastic data parallelism, docs/trainer.md)."""
    try:
        old, new = yaml.safe_load((path / "run.yaml").read_text()), yaml.safe_load(spec_text)
        before, after = old["spec"]["trainer"]["replicas"], new["spec"]["trainer"]["replicas"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    if before == after:
        return None
    old["spec"]["trainer"]["replicas"] = after
    return (before, after) if old == new else None


def clear_for_fresh(path: Path) -> list[str]:
    """`--fresh`: delete everything in the run directory `path` but the lock this launcher holds; the names deleted."""
    if not is_run_dir(path):
        return []
    removed = []
    for entry in sorted(path.iterdir()):
        if entry.name == LOCK_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        removed.append(entry.name)
    return removed
