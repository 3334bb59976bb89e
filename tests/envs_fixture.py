"""User environments for the tests (`environment.type: class`, `className: tests.envs_fixture:NAME`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from trainingrun.rollout.environments.calculator import Calculator


class Echo:
    """Deterministic: observation "<prompt text> <n>" after the n-th turn; reward n per turn; done on a turn that
    says "stop" (or after `turns` turns)."""

    def __init__(self, turns: int = 100):
        self.turns, self.n, self.text = turns, 0, ""

    def reset(self, prompt):
        self.text = prompt.get("text") or " ".join(map(str, prompt["tokens"]))
        return self.text

    def step(self, turn):
        self.n += 1
        done = "stop" in turn or self.n >= self.turns
        return f"{self.text} {self.n}", float(self.n), done, {"tool_calls": 1, "role": "tool"}


class Faulty:
    """Misbehaves as the turn says: raise, hang, nontext, flood, exit, memory, nan, badrole; else like Echo."""

    def __init__(self):
        self.n = 0

    def reset(self, prompt):
        if "reset-raise" in (prompt.get("text") or ""):
            raise RuntimeError("reset exploded")
        return prompt.get("text") or "start"

    def step(self, turn):
        self.n += 1
        if "raise" in turn:
            raise RuntimeError("the environment exploded")
        if "hang" in turn:
            time.sleep(3600)
        if "nontext" in turn:
            return 42, 0.0, False
        if "flood" in turn:
            return "x" * 10_000_000, 0.0, False
        if "exit" in turn:
            os._exit(3)
        if "memory" in turn:
            blocks = []  # 1 GiB steps: past the test's limit at once (64 MiB ones are zero-filled for seconds under load)
            while True:
                blocks.append(bytearray(1 << 30))
        if "nan" in turn:
            return "ok", float("nan"), False
        if "badrole" in turn:
            return "ok", 0.0, False, {"role": "wizard"}
        return f"seen {self.n}", 1.0, "done" in turn


class NeedsArgument:
    def __init__(self, required):
        self.required = required

    def reset(self, prompt):
        return ""

    def step(self, turn):
        return "", 0.0, True


class MarkedCalculator(Calculator):
    """The calculator, which creates `marker` and then sleeps `pause` seconds in the first reset of a prompt whose index
    is `index` while the marker is absent: a test kills the rollout during that pause (mid-episode). The episodes'
    observations and rewards are the calculator's, whatever the marker says."""

    def __init__(self, marker: str = "", index: int = -1, pause: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.marker, self.index, self.pause = marker, index, pause

    def step(self, turn):
        if self.marker and self.prompt_index == self.index and not Path(self.marker).exists():
            Path(self.marker).write_text("mid-episode")
            time.sleep(self.pause)
        return super().step(turn)

    def reset(self, prompt):
        self.prompt_index = int(prompt["index"])
        return super().reset(prompt)
