"""Children's log lines (trainingrun/childlog.py): a timestamp on every line; Megatron's known start-up warnings
from rank 0 only."""

from __future__ import annotations

import io
import subprocess
import sys
import time

from trainingrun.childlog import KNOWN_STARTUP_WARNINGS, TimestampedWriter

T = time.mktime((2026, 11, 30, 22, 45, 1, 0, 0, -1))


def test_every_line_gets_the_time_also_when_written_in_pieces():
    raw = io.StringIO()
    w = TimestampedWriter(raw, clock=lambda: T)
    w.write("one\ntw")
    w.write("o\n\nthree")
    w.write("\n")
    assert raw.getvalue().splitlines() == ["2026-11-30 22:45:01 one", "2026-11-30 22:45:01 two",
                                           "2026-11-30 22:45:01 ", "2026-11-30 22:45:01 three"]


SCRIPT = """
import sys, warnings
from trainingrun.childlog import install_timestamps, quiet_known_warnings
install_timestamps()
quiet_known_warnings(int(sys.argv[1]))
warnings.warn("Transformer Engine and Apex are not installed. Falling back to local implementations")
warnings.warn("Apex is not installed. Falling back to Torch Norm")
warnings.warn("something else")
print("[trainer] hello")
"""


def run_rank(rank: int, stamps: str = "1") -> str:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(rank)], capture_output=True, text=True, timeout=60,
                          env={"TRAININGRUN_LOG_TIMESTAMPS": stamps, "PATH": "/usr/bin:/bin",
                               "PYTHONPATH": ":".join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


def test_known_startup_warnings_only_from_rank_0_and_every_line_stamped():
    rank0, rank1 = run_rank(0), run_rank(1)
    assert "Transformer Engine and Apex" in rank0 and "Apex is not installed" in rank0
    assert "Transformer Engine and Apex" not in rank1 and "Apex is not installed" not in rank1
    assert "something else" in rank1 and "[trainer] hello" in rank1
    for line in (rank0 + rank1).splitlines():
        assert line[:4] == time.strftime("%Y") and line[19] == " ", line
    assert len(KNOWN_STARTUP_WARNINGS) >= 3
    assert run_rank(0, stamps="0").startswith(("<string>", "[trainer]"))  # off: lines as written
