"""Driving `trainingrun run` from tests: start it as a real process, wait for it, read what it wrote."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT = 300


def start(spec: Path, out: Path, *extra: str, cwd: Path = ROOT, progress_interval: int = 10) -> subprocess.Popen:
    """`trainingrun run SPEC --out OUT ...` in the background, stdout and stderr together."""
    return subprocess.Popen(
        [sys.executable, "-m", "trainingrun", "run", str(spec), "--out", str(out),
         "--progress-interval", str(progress_interval), *extra],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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


def records(out: Path) -> list[dict]:
    """The run's metrics.jsonl: one record per step."""
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
