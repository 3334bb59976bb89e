"""Log lines of the rollout and trainer processes of a local run: a timestamp on every line, and Megatron's known
start-up warnings once per run instead of once per rank.

`install_timestamps()` (called by the `rollout` / `trainer` entrypoints when the launcher sets
TRAININGRUN_LOG_TIMESTAMPS=1) wraps the process's stdout and stderr so every line starts with the local date and time,
`2026-11-30 22:45:01 `; Python warnings and tracebacks go through the same wrappers. Output written by C code
straight to the file descriptors (rare: gloo, CUDA) is not stamped. In a cluster the container runtime stamps lines
(`kubectl logs --timestamps`), so the operator does not set the variable.

`quiet_known_warnings(rank)`: on every rank but 0, Python warnings that megatron-core prints identically on every
rank when it starts (Transformer Engine / Apex missing, deprecated defaults) are ignored; rank 0 still shows them.
"""

from __future__ import annotations

import io
import sys
import threading
import time
import warnings

from trainingrun.contract.env import ProcessEnv
from trainingrun.contract.errors import ConfigError

# Messages megatron-core (0.16) warns about at import/model-build time, the same on every rank.
KNOWN_STARTUP_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
)


class TimestampedWriter(io.TextIOBase):
    """A text stream that writes each line of its output to `raw` prefixed with the current time."""

    def __init__(self, raw, clock=time.time):
        self.raw = raw
        self.clock = clock
        self._at_line_start = True
        self._lock = threading.Lock()

    def _stamp(self) -> str:
        t = self.clock()
        return time.strftime("%Y-%m-%d %H:%M:%S ", time.localtime(t))

    def write(self, text: str) -> int:
        if not text:
            return 0
        with self._lock:
            out = []
            for piece in text.splitlines(keepends=True):
                if self._at_line_start:
                    out.append(self._stamp())
                out.append(piece)
                self._at_line_start = piece.endswith("\n")
            self.raw.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self.raw.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.raw.fileno()

    @property
    def encoding(self):  # noqa: D102 - as the wrapped stream
        return getattr(self.raw, "encoding", "utf-8")

    def writable(self) -> bool:
        return True


def install_timestamps(environ=None) -> bool:
    """Stamp this process's stdout/stderr lines when TRAININGRUN_LOG_TIMESTAMPS=1; True if installed."""
    try:
        wanted = ProcessEnv.from_environ(environ).log_timestamps
    except ConfigError:  # a malformed variable: the program reports it (exit 78), unstamped
        wanted = False
    if not wanted or isinstance(sys.stderr, TimestampedWriter):
        return False
    sys.stdout = TimestampedWriter(sys.stdout)
    sys.stderr = TimestampedWriter(sys.stderr)
    return True


def quiet_known_warnings(rank: int) -> None:
    """On ranks other than 0, ignore megatron-core's known start-up warnings (rank 0 shows them once)."""
    if rank == 0:
        return
    for pattern in KNOWN_STARTUP_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
