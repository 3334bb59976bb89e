"""Rewards of generated rollouts (`rollout.source.generate.reward`): a small registry, run so that a bad reward never
stops the rollout.

    exact_match    1.0 if the response equals the reference, else 0.0 (token ids for the built-in tasks; text is
                   compared stripped of surrounding white space)
    token_match    fraction of reference positions the response gets right, over max(len(response), len(reference))
                   (a too long or too short answer loses the missing/extra positions); built-in tasks
    reasoning_gym  the reasoning-gym task's own `score_answer` on the prompt's dataset entry
    math_verify    math-verify: 1.0 if the response's math equals the reference's (`\\boxed{18}`, `18 dollars`, ...)
    function       a user function `module:function` called as function(response, reference) -> float

`exact_match` and `token_match` are pure comparisons and run in the rollout process. The others run in `workers`
spawned processes (`RewardPool`): each call gets `timeoutSeconds`; a call that raises, times out (its worker is
killed and replaced) or returns something that is not a finite number is a *failed* reward: the sample gets
`failedReward`, the failure is counted by reason (`error`, `timeout`, `nan`) and reported, and the rollout goes on.
Work travels to the workers as JSON over pipes (no pickle): for reasoning_gym only (dataset index, response) — each
worker builds the same seeded dataset — else (response, reference).
"""

from __future__ import annotations

import importlib
import json
import math
import multiprocessing
import os
import multiprocessing.connection
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainingrun.childproc import PipeWorker
from trainingrun.rollout.prompts import reasoning_gym_dataset

IN_PROCESS = ("exact_match", "token_match")
FAILURE_REASONS = ("error", "timeout", "nan")


# ------------------------------------------------------------------------------------------------------ rewards
def _text(x: Any) -> Any:
    return x.strip() if isinstance(x, str) else list(x)


def exact_match(response: Any, reference: Any) -> float:
    return 1.0 if _text(response) == _text(reference) else 0.0


def token_match(response: Sequence, reference: Sequence) -> float:
    response, reference = list(response), list(reference)
    n = max(len(response), len(reference))
    if n == 0:
        return 1.0
    return sum(a == b for a, b in zip(response, reference)) / n


def math_verify(response: str, reference: Any) -> float:
    from math_verify import parse, verify  # deferred: math_verify

    # timeouts off: math-verify's own use signal.alarm, which only works in a main thread; the pool enforces ours
    gold = parse(str(reference), parsing_timeout=None)
    answer = parse(str(response), parsing_timeout=None)
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0


def load_named(path: str, field: str) -> Callable:
    """`module:name` → that callable (a function or a class); ValueError naming `field` when it cannot be loaded."""
    module, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{field}: cannot load {path!r}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"{field}: {path!r} is not callable")
    return fn


def load_function(path: str) -> Callable[[Any, Any], float]:
    """`module:function` → the function; ValueError naming reward.function when it cannot be imported."""
    return load_named(path, "rollout.source.generate.reward.function")


@dataclass(frozen=True)
class RewardConfig:
    """What a worker needs to build its scorer (JSON-able: it is sent to spawned processes)."""

    type: str
    function: str | None = None
    dataset: dict[str, Any] | None = None  # reasoning_gym: name, config, seed, size

    def scorer(self) -> Callable[[Any, Any], float]:
        if self.type == "exact_match":
            return exact_match
        if self.type == "token_match":
            return token_match
        if self.type == "math_verify":
            return math_verify
        if self.type == "function":
            assert self.function is not None
            return load_function(self.function)
        if self.type == "reasoning_gym":
            assert self.dataset is not None
            ds = reasoning_gym_dataset(**self.dataset)
            return lambda response, index: float(ds.score_answer(answer=response, entry=ds[int(index)]))
        raise ValueError(f"rollout.source.generate.reward.type: unknown {self.type!r}")


# ------------------------------------------------------------------------------------------------------ scoring
@dataclass
class Scored:
    """Rewards of a batch and what failed."""

    rewards: list[float]
    failed: list[str | None]  # None, or the failure reason of that item
    messages: list[str] = field(default_factory=list)  # one line per failure (first few)

    def counts(self) -> dict[str, int]:
        return {r: sum(f == r for f in self.failed) for r in FAILURE_REASONS}


def _finite(value: Any) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


class RewardScorer:
    """Scores (response, reference) pairs with the configured reward (see the module docstring)."""

    def __init__(self, config: RewardConfig, *, timeout: float, failed_reward: float, workers: int = 1):
        self.config = config
        self.timeout = timeout
        self.failed_reward = failed_reward
        self.pool = None if config.type in IN_PROCESS else RewardPool(config, workers=workers, timeout=timeout)
        self.fn = config.scorer() if self.pool is None else None

    def score(self, items: list[tuple[Any, Any]]) -> Scored:
        out = Scored(rewards=[], failed=[])
        results = self.pool.run(items) if self.pool is not None else [self._local(r, ref) for r, ref in items]
        for value, reason, message in results:
            x = _finite(value) if reason is None else None
            if reason is None and x is None:
                reason, message = "nan", f"reward returned {value!r}, not a finite number"
            out.rewards.append(self.failed_reward if reason else x)
            out.failed.append(reason)
            if reason and len(out.messages) < 5:
                out.messages.append(f"{reason}: {message}")
        return out

    def _local(self, response: Any, reference: Any) -> tuple[Any, str | None, str]:
        try:
            return self.fn(response, reference), None, ""
        except Exception as exc:  # noqa: BLE001 - a reward's failure is recorded, never raised
            return None, "error", f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class RewardPool:
    """`workers` spawned processes running the scorer, one item at a time each, with a deadline per item."""

    def __init__(self, config: RewardConfig, *, workers: int, timeout: float):
        self.config = config
        self.timeout = timeout
        self.ctx = multiprocessing.get_context("spawn")
        self.workers: list[_Worker | None] = [None] * workers

    def _worker(self, i: int) -> _Worker:
        w = self.workers[i]
        if w is None or not w.proc.is_alive():
            if w is not None:
                w.stop()
            w = self.workers[i] = _Worker.start(self.ctx, self.config)
        return w

    def run(self, items: list[tuple[Any, Any]]) -> list[tuple[Any, str | None, str]]:
        results: list[tuple[Any, str | None, str] | None] = [None] * len(items)
        todo = list(range(len(items)))[::-1]
        busy: dict[int, tuple[int, float]] = {}  # worker -> (item, deadline)
        while todo or busy:
            for wi in range(len(self.workers)):
                if wi not in busy and todo:
                    item = todo.pop()
                    try:
                        w = self._worker(wi)
                    except RuntimeError as exc:
                        results[item] = (None, "error", str(exc))
                        continue
                    w.send(items[item])
                    busy[wi] = (item, time.monotonic() + self.timeout)
            for wi, (item, deadline) in list(busy.items()):
                w = self.workers[wi]
                assert w is not None
                if w.conn.poll(0):
                    try:
                        results[item] = w.receive()
                    except (EOFError, OSError, ValueError) as exc:
                        results[item] = (None, "error", f"reward worker died: {exc!r}")
                        w.stop()
                        self.workers[wi] = None
                    del busy[wi]
                elif not w.proc.is_alive():
                    results[item] = (None, "error", f"reward worker died (exit {w.proc.exitcode})")
                    w.stop()
                    self.workers[wi] = None
                    del busy[wi]
                elif time.monotonic() > deadline:
                    results[item] = (None, "timeout", f"no result within {self.timeout:g}s (worker killed)")
                    w.stop()
                    self.workers[wi] = None
                    del busy[wi]
            if busy:
                multiprocessing.connection.wait([self.workers[wi].conn for wi in busy], timeout=0.05)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        for w in self.workers:
            if w is not None:
                w.stop()
        self.workers = [None] * len(self.workers)


STARTUP_GRACE_SECONDS = 60.0


class _Worker(PipeWorker):
    @classmethod
    def start(cls, ctx, config: RewardConfig) -> _Worker:
        """Start a worker and wait until its scorer is built (imports are not counted against a reward's time)."""
        w = cls.spawn(ctx, _serve, json.dumps(config.__dict__))
        proc, parent = w.proc, w.conn
        if not parent.poll(STARTUP_GRACE_SECONDS):
            w.stop()
            raise RuntimeError(f"reward worker not ready after {STARTUP_GRACE_SECONDS:g}s")
        try:
            parent.recv_bytes()  # b"ready"
        except (EOFError, OSError):
            w.stop()
            raise RuntimeError(f"reward worker died while starting (exit {proc.exitcode})") from None
        return w

    def send(self, item: tuple[Any, Any]) -> None:
        self.conn.send_bytes(json.dumps(list(item), default=str).encode())

    def receive(self) -> tuple[Any, str | None, str]:
        value, reason, message = json.loads(self.conn.recv_bytes())
        return value, reason, message


def _serve(conn, config_json: str) -> None:  # pragma: no cover - runs in the spawned worker
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        scorer = RewardConfig(**json.loads(config_json)).scorer()
    except Exception as exc:  # noqa: BLE001 - every call then reports it
        scorer, startup_error = None, f"{type(exc).__name__}: {exc}"
    conn.send_bytes(b"ready")
    while True:
        try:
            response, reference = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if scorer is None:
            out = [None, "error", startup_error]
        else:
            try:
                value = scorer(response, reference)
                out = [_finite(value), None if _finite(value) is not None else "nan",
                       "" if _finite(value) is not None else f"reward returned {value!r}, not a finite number"]
            except Exception as exc:  # noqa: BLE001
                out = [None, "error", f"{type(exc).__name__}: {exc}"]
        conn.send_bytes(json.dumps(out).encode())
