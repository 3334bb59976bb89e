"""The local launcher's progress output: a live line on a terminal, plain timestamped lines otherwise.

On a terminal the line is a tqdm bar over the run's rollouts with the elapsed time and an ETA, followed by the step,
loss, global batch size and samples/s of the last step. tqdm measures the terminal at every redraw and shrinks the
bar, then cuts the line, so it never gets wider than the terminal. It is redrawn only when its text changes (a new
step, or the elapsed second ticking over), at most once per second unless a step arrives. Until the first step it
says that the processes are starting (loading torch / Megatron-core). On resume it starts at the steps already
trained (from the run directory's records), and the ETA counts only this invocation's pace.

When stdout is not a terminal (CI, a pipe, a file) one plain line is printed every `interval` seconds when there is a
new step. Events (attempt started, failures, restarts) get their own line in both modes, and every line begins with
the local time, like the children's log lines.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from trainingrun.contract.progress import rollouts_done
from trainingrun.local.report import _fmt

STARTING = "starting: loading torch / Megatron-core"
REDRAW_SECONDS = 1.0


def timestamp() -> str:
    """The prefix of every launcher line: local time to the second."""
    return time.strftime("%H:%M:%S")


@dataclass
class ProgressLine:
    """The launcher's live progress line and its event lines (see the module docstring)."""

    num_rollouts: int
    stream: TextIO = field(default_factory=lambda: sys.stdout)
    interval: float = 5.0
    tty: bool | None = None
    last: dict[str, Any] | None = None  # the newest step record
    steps_seen: int = 0
    _window: deque = field(default_factory=lambda: deque(maxlen=20))
    _last_plain: float = 0.0
    _printed_step: object = "nothing yet"
    _bar: Any = None
    _drawn_text: str | None = None
    _last_draw: float = 0.0
    _closed: bool = False
    log_path: Path | None = None  # events are also appended here (logs/launcher.log), with the date

    def __post_init__(self) -> None:
        if self.tty is None:
            self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    # ------------------------------------------------------------------------------------------------ input
    def resume_from(self, record: dict[str, Any] | None) -> None:
        """Start from the newest record of an earlier invocation (the run resumes around there)."""
        if record is not None:
            self.last = record

    def add(self, records: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        for rec in records:
            self.last = rec
            self.steps_seen += 1
            if isinstance(rec.get("samples_consumed"), (int, float)):
                self._window.append((now, rec["samples_consumed"]))
        if records:
            self.tick(force=True)

    # ------------------------------------------------------------------------------------------------ text
    def rollouts_done(self) -> int:
        return rollouts_done(None if self.last is None else self.last.get("rollout", 0), self.num_rollouts)

    def samples_per_second(self) -> float | None:
        """Throughput over the last (up to 20) steps as seen by the launcher, waits included; before two steps
        arrived, the trainer's own figure for the last step."""
        if len(self._window) >= 2:
            (t0, s0), (t1, s1) = self._window[0], self._window[-1]
            if t1 > t0:
                return (s1 - s0) / (t1 - t0)
        if self.last and isinstance(self.last.get("samples_per_second"), (int, float)):
            return float(self.last["samples_per_second"])
        return None

    def fields(self, compact: bool = False) -> str:
        """The last step's figures, most important first (the end is what a narrow terminal cuts); `compact`: the
        live line's (single spaces, without the samples consumed)."""
        rec = self.last
        if rec is None:
            return STARTING
        sps = self.samples_per_second()
        parts = [
            f"step {rec['step']}",
            f"loss {_fmt(rec.get('loss'))}",
            f"gbs {rec.get('global_batch_size', '?')}",
            f"{sps:.1f} samples/s" if sps is not None else "",
            "" if compact else f"samples {rec.get('samples_consumed', '?')}",
        ]
        return (" " if compact else "  ").join(p for p in parts if p)

    def line(self) -> str:
        """The plain (non-terminal) progress line."""
        if self.last is None:
            return f"rollout 0/{self.num_rollouts}  {STARTING}"
        return f"rollout {self.rollouts_done()}/{self.num_rollouts}  {self.fields()}"

    # ------------------------------------------------------------------------------------------------ output
    def _ensure_bar(self):
        if self._bar is None:
            from tqdm import tqdm  # deferred: tqdm (interactive runs only)

            self._bar = tqdm(
                total=self.num_rollouts, initial=self.rollouts_done(), desc=self.fields(compact=True),
                file=self.stream,
                dynamic_ncols=True,
                unit="rollout", leave=True, mininterval=0, miniters=0, smoothing=0.1, delay=0,
                bar_format="rollout {n_fmt}/{total_fmt} {bar} {elapsed}<{remaining} {desc}",
            )
        return self._bar

    def tick(self, force: bool = False) -> None:
        """Redraw (terminal) when the text changed, at most once per `REDRAW_SECONDS` unless `force`; print a plain
        line when `interval` passed and there is a new step (not a terminal)."""
        if self._closed:
            return
        now = time.monotonic()
        if self.tty:
            if not force and now - self._last_draw < REDRAW_SECONDS:
                return
            bar = self._ensure_bar()
            bar.n = self.rollouts_done()
            bar.set_description_str(self.fields(compact=True), refresh=False)
            text = str(bar)
            if text != self._drawn_text:
                bar.refresh()
                self._drawn_text = text
            self._last_draw = now
            return
        step = self.last["step"] if self.last else None
        if force and step == self._printed_step:
            return
        if now - self._last_plain >= self.interval and step != self._printed_step:
            self.stream.write(f"{timestamp()} {self.line()}\n")
            self.stream.flush()
            self._last_plain = now
            self._printed_step = step

    def event(self, message: str) -> None:
        """A one-off message (start, failure, restart) on its own timestamped line, above the live line."""
        text = f"{timestamp()} {message}"
        if self.log_path is not None:
            try:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.log_path, "a") as fh:
                    fh.write(f"{time.strftime('%Y-%m-%d')} {text}\n")
            except OSError:
                pass  # the terminal line below still says it
        if self.tty and self._bar is not None and not self._closed:
            self._bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        """Leave the final state of the line on screen (terminal)."""
        if self._bar is not None and not self._closed:
            self._bar.n = self.rollouts_done()
            self._bar.set_description_str(self.fields(compact=True), refresh=False)
            self._bar.close()
        self._closed = True

    def reopen(self) -> None:
        """After a restart's backoff: a new live line for the next attempt."""
        self._closed = False
        self._bar = None
        self._drawn_text = None
