"""`trainingrun scale RUN_DIR --replicas N [--wait]`: resize the engine pool of a local run while it runs (the local
counterpart of `kubectl scale tr/NAME --replicas N`: spec.rollout.engine.replicas of a running run).

The command checks its arguments and the run directory (a live launcher, a run with its own engine servers), then
writes the request, RUN_DIR/scale.json (`{"replicas": N}`, atomically). The launcher reads it while it watches the
run (`ScaleRequests.poll`) and resizes its pool (`trainingrun.local.engine.LocalEnginePool`: new servers start and are
listed for the rollout once healthy; removed ones leave the list at once and are stopped once the rollout's pool let
them go). With --wait the command waits until pids.json's `engine_replicas` shows the new size reached (every wanted
server listed, none leaving). A request outlives nothing: the launcher clears it when it starts, and a run started
again begins with spec.rollout.engine.replicas.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

from trainingrun.cliargs import positive_seconds
from trainingrun.local.engine import MAX_REPLICAS
from trainingrun.local.procs import write_json_atomic
from trainingrun.local.rundir import live_owner

SCALE_FILE = "scale.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of a running `trainingrun run`")
    parser.add_argument("--replicas", type=int, required=True, metavar="N",
                        help=f"engine servers wanted (spec.rollout.engine.replicas, 1..{MAX_REPLICAS})")
    parser.add_argument("--wait", action="store_true", help="wait until the pool has the new size")
    parser.add_argument("--timeout", type=positive_seconds, default=1800.0, metavar="S",
                        help="with --wait: give up after S seconds (default 1800; vLLM on CPU starts in minutes)")


class ScaleRequests:
    """The launcher's side: the newest request in RUN_DIR/scale.json, once each (`poll`)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / SCALE_FILE
        self.path.unlink(missing_ok=True)  # an earlier invocation's request is not this one's
        self._seen: int | None = None  # the file's mtime_ns last read

    def poll(self) -> tuple[int | None, str]:
        """(N, "") for a new request, (None, problem) for a new unreadable one, (None, "") when nothing new."""
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return None, ""
        if mtime == self._seen:
            return None, ""
        self._seen = mtime
        try:
            n = json.loads(self.path.read_text())["replicas"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return None, f"{self.path}: not a request ({type(exc).__name__}: {exc}); ignored"
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_REPLICAS:
            return None, f"{self.path}: replicas: {n!r}; allowed: an integer 1..{MAX_REPLICAS}; ignored"
        return n, ""


def refusal(run_dir: Path, replicas: int) -> str | None:
    """Why the request cannot be made, naming the argument, or None."""
    if not 1 <= replicas <= MAX_REPLICAS:
        return f"--replicas: {replicas}; allowed: 1..{MAX_REPLICAS} (spec.rollout.engine.replicas)"
    try:
        doc = yaml.safe_load((run_dir / "run.yaml").read_text()) or {}
    except OSError:
        return f"RUN_DIR: {run_dir} is not a run directory (no run.yaml)"
    engine = ((doc.get("spec") or {}).get("rollout") or {}).get("engine") or {}
    if engine.get("type", "megatron") != "vllm" or engine.get("url"):
        what = "rollout.engine.url is set (the servers are yours)" if engine.get("url") else \
            f"rollout.engine.type is {engine.get('type', 'megatron')} (in the rollout process)"
        return f"RUN_DIR: the run in {run_dir} has no pool of its own engine servers to resize: {what}"
    if live_owner(run_dir) is None:
        return (f"RUN_DIR: no launcher runs {run_dir} now; a run started again begins with "
                "spec.rollout.engine.replicas (--set rollout.engine.replicas=N)")
    return None


def reached(run_dir: Path, replicas: int) -> bool:
    """pids.json says the pool has `replicas` servers listed and none leaving."""
    try:
        size = json.loads((run_dir / "pids.json").read_text()).get("engine_replicas") or {}
    except (OSError, ValueError):
        return False
    return size == {"wanted": replicas, "listed": replicas, "leaving": 0}


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    problem = refusal(run_dir, args.replicas)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    write_json_atomic(run_dir / SCALE_FILE, {"replicas": args.replicas, "requested": time.time()})
    print(f"requested {args.replicas} engine server(s) for the run in {run_dir} (its launcher log shows the resize)")
    if not args.wait:
        return 0
    deadline = time.monotonic() + args.timeout
    while not reached(run_dir, args.replicas):
        if live_owner(run_dir) is None:
            print(f"error: the launcher of {run_dir} ended before the pool had {args.replicas} server(s)",
                  file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            print(f"error: --timeout: the pool has not {args.replicas} server(s) after {args.timeout:g}s",
                  file=sys.stderr)
            return 1
        time.sleep(0.5)
    print(f"the pool has {args.replicas} engine server(s)")
    return 0
