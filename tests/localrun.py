"""Driving `trainingrun run` from tests: start it as a real process, wait for it, read what it wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.services import wait_for

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT = 300


def start(spec: Path, out: Path, *extra: str, cwd: Path = ROOT, progress_interval: int = 10,
          env: dict[str, str] | None = None, plot: bool = False) -> subprocess.Popen:
    """`trainingrun run SPEC --out OUT ...` in the background, stdout and stderr together (`env`: the launcher's
    environment, which its children inherit; default this process's). Without `plot` the run draws no plot.png
    (`--no-plot`: matplotlib's 2 s per run, in a suite of a hundred runs); the tests of the plot ask for it.
    PYTHONPATH leads with this checkout, so that the launcher's children (rollout, trainers, engines) run this
    checkout's code even where the virtual environment's editable install points at another one (a git worktree)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.Popen(
        [sys.executable, "-m", "trainingrun", "run", str(spec), "--out", str(out),
         "--progress-interval", str(progress_interval), *([] if plot else ["--no-plot"]), *extra],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )


def finish(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT) -> tuple[int, str]:
    """Exit code and output; a launcher still running after `timeout` is interrupted and the test fails."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"launcher did not finish in {timeout}s:\n{out[-4000:]}")
    return proc.returncode, out


def role_logs(out: Path, lines: int = 12) -> str:
    """For a failed run's message: each role's log under `out`/logs, its last lines and its last error lines
    (a failure's cause is often in another role's log than the one that ended the run, and pytest keeps only a
    few runs' directories)."""
    parts = []
    for path in sorted((out / "logs").glob("*.log")):
        text = path.read_text(errors="replace").splitlines()
        errors = [t for t in text if any(w in t for w in ("Error", "error:", "failed", "Traceback"))]
        parts.append(f"--- {path.name}: last error lines\n" + "\n".join(errors[-lines:])
                     + f"\n--- {path.name}: last lines\n" + "\n".join(text[-lines:]))
    return "\n" + "\n".join(parts)


def fault_when(proc: subprocess.Popen, ready: Callable[[], object], what: str, fault: Callable[[], None], *,
               timeout: float = RUN_TIMEOUT) -> tuple[int, str]:
    """Wait until `ready()` while the launcher runs (it must not end first), then inject `fault()` (kill a child,
    restart a service, stop the launcher...) and wait for the launcher; its exit code and output."""
    try:
        wait_for(lambda: ready() or proc.poll() is not None, timeout, what, interval=0.1)
        assert proc.poll() is None, f"the run ended before {what}:\n{proc.stdout.read()[-3000:]}"
        fault()
        return finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


def stop_held(proc: subprocess.Popen, out: Path, holds: Callable[[], object], what: str, *,
              timeout: float = RUN_TIMEOUT, before_stop: Callable[[], None] | None = None) -> tuple[int, str]:
    """Wait until `holds()` while the launcher runs (it must not end first), then SIGTERM it (after `before_stop`);
    its exit code and output. `holds()` is confirmed while the run's trainers are held still (SIGSTOP), so what it
    saw still holds when the SIGTERM comes; the trainers go on (SIGCONT) a second after the launcher had it, with
    theirs pending. Checked while they ran, a trainer could train past what was seen (another step, a checkpoint, the
    run's end) before the SIGTERM arrived (seen once in test_elastic_e2e)."""
    frozen: list[int] = []

    def ready() -> bool:
        if not holds():
            return False
        try:
            pids = [int(p["pid"]) for name, p in json.loads((out / "pids.json").read_text())["processes"].items()
                    if name.startswith("trainer-")]
        except (OSError, ValueError, KeyError):  # being rewritten
            return False
        _signal(pids, signal.SIGSTOP)
        t0 = time.monotonic()
        while not all(map(_stopped, pids)) and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        if holds():
            frozen[:] = pids
            return True
        _signal(pids, signal.SIGCONT)
        return False

    def stop() -> None:
        if before_stop is not None:
            before_stop()
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        _signal(frozen, signal.SIGCONT)

    try:
        return fault_when(proc, ready, what, stop, timeout=timeout)
    finally:
        _signal(frozen, signal.SIGCONT)  # never left stopped, whatever failed


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return True  # gone: holds nothing up


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_child(out: Path, process: str) -> None:
    """SIGKILL one process of the run (`rollout`, `trainer-1`, ...), found in the run directory's pids.json."""
    pid = json.loads((out / "pids.json").read_text())["processes"][process]["pid"]
    os.kill(pid, signal.SIGKILL)


def records(out: Path) -> list[dict]:
    """The run's metrics.jsonl: one record per step."""
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
