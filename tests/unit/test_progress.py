"""The launcher's progress output (trainingrun/progress.py) on a real pseudo-terminal 80 columns wide, and as plain
lines when the stream is not a terminal."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import termios
import time

import pytest

from trainingrun.local import progress as progress_mod
from trainingrun.local.progress import STARTING, ProgressLine

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def records(n: int, start: int = 1) -> list[dict]:
    return [{"step": s, "rollout": s - 1, "loss": 12345.678901 / s, "global_batch_size": 123456,
             "samples_consumed": 9_876_543_210 + s, "samples_per_second": 123456.7} for s in range(start, start + n)]


class Pty:
    """A pseudo-terminal of `cols` columns; `stream` is its slave side (a terminal), `read()` what was drawn."""

    def __init__(self, cols: int = 80, rows: int = 24):
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        attrs = termios.tcgetattr(self.slave)
        attrs[1] &= ~termios.ONLCR  # keep "\n" as written
        termios.tcsetattr(self.slave, termios.TCSANOW, attrs)
        self.stream = io.TextIOWrapper(io.FileIO(self.slave, "w", closefd=False), encoding="utf-8",
                                       write_through=True)
        self.cols = cols

    def read(self) -> str:
        out = b""
        os.set_blocking(self.master, False)
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            out += chunk
        return out.decode("utf-8", "replace")

    def close(self) -> None:
        os.close(self.slave)
        os.close(self.master)


def screen_lines(raw: str) -> list[str]:
    """Every line segment as a terminal shows it: split at carriage returns and newlines, escapes removed."""
    return [seg for seg in re.split(r"[\r\n]", ANSI.sub("", raw))]


@pytest.fixture
def term():
    t = Pty(80)
    yield t
    t.close()


def test_the_live_line_never_exceeds_80_columns(term, monkeypatch):
    monkeypatch.setattr(progress_mod, "REDRAW_SECONDS", 0.0)
    p = ProgressLine(num_rollouts=100_000, stream=term.stream)
    assert p.tty
    p.tick()
    p.event("attempt 0: started 3 processes (1 rollout, 2 trainers); logs in /a/very/long/path/" + "x" * 60)
    for rec in records(30):
        p.add([rec])
    p.close()
    raw = term.read()
    lines = [ln for ln in screen_lines(raw) if ln.strip()]
    assert any(STARTING in ln for ln in lines), "says what it is doing before the first step"
    bars = [ln for ln in lines if ln.startswith("rollout ")]
    assert bars and all(len(ln.rstrip()) <= 80 for ln in bars), max(bars, key=len)
    assert any("step 30" in ln and "<" in ln for ln in bars), "step, elapsed<remaining"
    assert any(re.search(r"\d\d:\d\d<", ln) for ln in bars)
    # the event has its own (timestamped) line; it may be longer than the terminal, it is a log line
    assert any(re.match(r"\d\d:\d\d:\d\d attempt 0: started", ln) for ln in lines)


def test_no_redraw_when_nothing_changed(term):
    p = ProgressLine(num_rollouts=10, stream=term.stream)
    p.add(records(1))
    term.read()
    for _ in range(20):  # the launcher polls 5 times a second
        p.tick()
        time.sleep(0.01)
    assert term.read() == "", "redrawn although neither the step nor the elapsed second changed"
    time.sleep(1.05)
    p.tick()
    assert "step 1" in ANSI.sub("", term.read()), "the clock ticking over is a change"


def test_resume_starts_at_the_resumed_step(term):
    p = ProgressLine(num_rollouts=40, stream=term.stream)
    p.resume_from(records(1, start=25)[0])
    p.tick(force=True)
    first = [ln for ln in screen_lines(term.read()) if ln.startswith("rollout ")][0]
    assert first.startswith("rollout 25/40 ") and "step 25" in first


def test_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    p = ProgressLine(num_rollouts=4, stream=out, interval=0.0)
    assert not p.tty
    p.tick()
    p.add(records(2))
    p.tick()
    p.tick()  # no new step: nothing printed
    p.event("restarting")
    p.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert all(re.match(r"\d\d:\d\d:\d\d ", ln) for ln in lines)
    assert [ln[9:] for ln in lines] == [f"rollout 0/4  {STARTING}",
                                        "rollout 2/4  step 2  loss 6172.8395  gbs 123456  123456.7 samples/s  "
                                        "samples 9876543212", "restarting"]
