"""`trainingrun logs RUN_DIR [PROCESS] [-f] [--attempt K] [--tail N]`: a local run's process logs.

Logs live in `RUN_DIR/logs/`: `launcher.log` (the launcher's own events), and per process `<name>.log` for attempt
0 and `<name>.attempt<k>.log` after the k-th restart. PROCESS is a process name (`rollout`, `trainer-0`, ...,
`launcher`); without it, every process of the attempt is shown, each line prefixed with `[name]`. The attempt is
the newest unless `--attempt` names one. `-f` keeps printing new lines (and switches to a newer attempt's logs when
the run restarts) until the run's launcher has exited, like `kubectl logs -f`.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from trainingrun.local.report import LineTail
from trainingrun.local.rundir import live_owner

_LOG_RE = re.compile(r"^(?P<name>.+?)(?:\.attempt(?P<attempt>\d+))?\.log$")
FOLLOW_POLL_SECONDS = 0.25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory of `trainingrun run` (e.g. runs/tiny)")
    parser.add_argument("process", metavar="PROCESS", nargs="?",
                        help="process name: rollout, trainer-0, ..., launcher (default: all)")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing new lines while the run is live")
    parser.add_argument("--attempt", type=int, metavar="K", help="attempt to show (default: the newest)")
    parser.add_argument("--tail", type=int, metavar="N", help="only the last N lines of each log")


def log_files(log_dir: Path) -> dict[int, dict[str, Path]]:
    """attempt -> {process name: log path}. `launcher.log` spans every attempt (listed under each)."""
    out: dict[int, dict[str, Path]] = {}
    launcher = None
    for p in sorted(log_dir.glob("*.log")) if log_dir.is_dir() else []:
        m = _LOG_RE.match(p.name)
        if not m:
            continue
        if m["name"] == "launcher" and m["attempt"] is None:
            launcher = p
            continue
        out.setdefault(int(m["attempt"] or 0), {})[m["name"]] = p
    if launcher is not None:
        for procs in out.values() or [out.setdefault(0, {})]:
            procs["launcher"] = launcher
    return out


def _select(run_dir: Path, process: str | None, attempt: int | None) -> tuple[int, dict[str, Path]]:
    files = log_files(run_dir / "logs")
    if not files:
        raise LookupError(f"{run_dir / 'logs'}: no logs (is {run_dir} a run directory?)")
    a = max(files) if attempt is None else attempt
    if a not in files:
        raise LookupError(f"attempt {a}: no logs; attempts with logs: {', '.join(map(str, sorted(files)))}")
    procs = files[a]
    if process is not None:
        if process not in procs:
            raise LookupError(f"{process}: no such process in attempt {a}; processes: {', '.join(sorted(procs))}")
        procs = {process: procs[process]}
    return a, procs


class _Follower:
    """One log file from its start (or its last `tail` lines), each line prefixed with `prefix`."""

    def __init__(self, path: Path, prefix: str, tail: int | None):
        self.path, self.prefix = path, prefix
        start = 0
        if tail is not None:
            data = path.read_bytes() if path.exists() else b""
            lines = data.split(b"\n")
            keep = lines[-(tail + 1):] if tail else [lines[-1]]
            start = len(data) - len(b"\n".join(keep))
        self.tail = LineTail(path, start)

    def lines(self, final: bool = False) -> list[str]:
        return [self.prefix + p.decode("utf-8", "replace") for p in self.tail.lines(final)]


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    try:
        attempt, procs = _select(run_dir, args.process, args.attempt)
    except LookupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.tail is not None and args.tail < 0:
        print("error: --tail: must be >= 0", file=sys.stderr)
        return 1
    prefix = len(procs) > 1
    followers = {n: _Follower(p, f"[{n}] " if prefix else "", args.tail) for n, p in procs.items()}
    out = sys.stdout
    try:
        while True:
            live = args.follow and live_owner(run_dir) is not None
            for f in followers.values():
                for line in f.lines(final=not live):
                    out.write(line + "\n")
            out.flush()
            if not live:
                return 0
            if args.attempt is None:  # a restart: follow the new attempt's logs from their start
                newest, new_procs = _select(run_dir, args.process, None)
                if newest != attempt:
                    attempt = newest
                    for n, p in new_procs.items():
                        if n not in followers or followers[n].path != p:
                            for line in followers[n].lines(final=True) if n in followers else []:
                                out.write(line + "\n")
                            followers[n] = _Follower(p, f"[{n}] " if prefix else "", None)
            time.sleep(FOLLOW_POLL_SECONDS)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `trainingrun logs ... | head`
        return 0
