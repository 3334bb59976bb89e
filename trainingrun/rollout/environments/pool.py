"""Environments in worker processes: an environment that hangs, raises, answers garbage, floods, exits or runs out of
memory ends its episode as failed and never stalls the rollout (the isolation rewards have, `rollout/rewards.py`).

`EnvironmentPool(path, config, workers=W, ...)` spawns W processes; each builds `Class(**config)` once at start (a
failure there is a configuration error of the run, exit 78) and then hosts the environments of the episodes homed on
it (episode e on worker e mod W), one call at a time, while the W workers run in parallel:

    reset([(episode, prompt), ...])  -> {episode: Outcome}   (the first observation)
    step([(episode, turn text), ...]) -> {episode: Outcome}  (a checked `StepResult`)
    release([episode, ...])                                  (the episodes are over: their environments are dropped)

Every call has `timeout` seconds. A worker that runs past it is killed (reason `timeout`); one that exits or dies is
replaced (reason `exit`); a call that raises (`error`), returns something malformed (`invalid`, see
`environments/base.py`), an observation longer than `max_chars` (`oversized`, refused in the worker before it is
sent) or exhausts the worker's address-space limit (`memory`: `memory_mib` MiB beyond what the worker held after
start-up, RLIMIT_AS) fails that episode only. The other episodes that lived in a replaced worker lose nothing: the new
worker rebuilds each one's environment at its next call by resetting it with the same prompt and replaying its
earlier turns (environments are expected to be deterministic given the prompt and its seed).

Work travels as JSON over pipes, never pickle; a reply longer than the limit is refused unread.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import resource
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainingrun.childproc import PipeWorker
from trainingrun.contract.errors import ConfigError
from trainingrun.rollout.environments.base import InvalidResult, StepResult, first_observation, load_class, step_result

STARTUP_GRACE_SECONDS = 60.0
FIELD = "rollout.source.generate.environment"


@dataclass(frozen=True)
class Outcome:
    """One call's answer: `value` (the first observation for reset, a StepResult for step) or `reason` (one of
    FAILURE_REASONS) with a one-line `message`."""

    value: Any = None
    reason: str | None = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.reason is None


class EnvironmentPool:
    """See the module docstring."""

    def __init__(self, path: str, config: dict[str, Any], *, workers: int = 1, timeout: float = 10.0,
                 memory_mib: int = 1024, max_chars: int = 1 << 16, say: Callable[[str], None] | None = None):
        self.path, self.config = path, dict(config)
        self.timeout, self.memory_mib, self.max_chars = timeout, memory_mib, max_chars
        self.say = say or (lambda _msg: None)
        self.ctx = multiprocessing.get_context("spawn")
        self.slots: list[_Worker | None] = [None] * workers
        self.generation = [0] * workers  # bumped when a slot's worker is replaced
        self.home: dict[int, tuple[int, int]] = {}  # episode -> (slot, generation its environment lives in)
        self.history: dict[int, tuple[dict[str, Any], list[str]]] = {}  # episode -> (prompt, turns stepped)
        self.replaced = 0  # workers replaced so far

    # ---- life cycle
    def start(self) -> None:
        """Start every worker (in parallel); ConfigError when the environment cannot be built from its config."""
        pending = [(i, _Worker.spawn(self.ctx, _serve, *self._args())) for i in range(len(self.slots))]
        for i, w in pending:
            error = w.ready()
            if error is not None:
                for _, other in pending:
                    other.stop()
                if error.startswith("build:"):
                    raise ConfigError(f"{FIELD}: cannot build {self.path}(**config): {error[6:].strip()}")
                raise RuntimeError(f"environment worker {i}: {error}")
            self.slots[i] = w

    def close(self) -> None:
        for w in self.slots:
            if w is not None:
                w.stop()
        self.slots = [None] * len(self.slots)

    def _args(self) -> tuple:
        return (self.path, json.dumps(self.config), self.memory_mib, self.max_chars)

    def _worker(self, slot: int) -> _Worker:
        w = self.slots[slot]
        if w is None:
            w = _Worker.spawn(self.ctx, _serve, *self._args())
            error = w.ready()
            if error is not None:
                raise RuntimeError(f"environment worker {slot} did not start: {error}")
            self.slots[slot] = w
        return w

    def _replace(self, slot: int) -> None:
        w = self.slots[slot]
        if w is not None:
            w.stop()
        self.slots[slot] = None
        self.generation[slot] += 1
        self.replaced += 1

    # ---- calls
    def reset(self, items: list[tuple[int, dict[str, Any]]]) -> dict[int, Outcome]:
        calls = []
        for episode, prompt in items:
            slot = episode % len(self.slots)
            self.home[episode] = (slot, -1)  # no environment yet: set when the reset succeeds
            self.history[episode] = (prompt, [])
            calls.append((episode, {"op": "reset", "id": episode, "prompt": prompt}))
        return self._run(calls)

    def step(self, items: list[tuple[int, str]]) -> dict[int, Outcome]:
        return self._run([(episode, {"op": "step", "id": episode, "turn": turn}) for episode, turn in items])

    def release(self, episodes: list[int]) -> None:
        """The episodes are over: drop their environments (no answer is awaited)."""
        for episode in episodes:
            self.history.pop(episode, None)
            slot, gen = self.home.pop(episode, (None, None))
            w = self.slots[slot] if slot is not None else None
            if w is not None and gen == self.generation[slot]:
                try:
                    w.send({"op": "close", "id": episode})
                except OSError:
                    self._replace(slot)

    def _run(self, calls: list[tuple[int, dict[str, Any]]]) -> dict[int, Outcome]:
        out: dict[int, Outcome] = {}
        queues: list[deque] = [deque() for _ in self.slots]
        for episode, msg in calls:
            queues[self.home[episode][0]].append((episode, msg))
        busy: dict[int, tuple[int, dict[str, Any], float]] = {}  # slot -> (episode, message, deadline)
        while any(queues) or busy:
            for slot, queue in enumerate(queues):
                if slot in busy or not queue:
                    continue
                episode, msg = queue.popleft()
                try:
                    w = self._worker(slot)
                except RuntimeError as exc:
                    out[episode] = Outcome(reason="error", message=str(exc))
                    continue
                msg, calls_in_it = self._with_restore(episode, slot, msg)
                try:
                    w.send(msg)
                except OSError as exc:
                    out[episode] = Outcome(reason="exit", message=f"environment worker gone: {exc}")
                    self._replace(slot)
                    continue
                busy[slot] = (episode, msg, time.monotonic() + self.timeout * calls_in_it)
            for slot, (episode, msg, deadline) in list(busy.items()):
                w = self.slots[slot]
                assert w is not None
                outcome = None
                if w.conn.poll(0):
                    try:
                        outcome = self._answer(episode, slot, msg, w.receive(self.max_chars))
                    except _Oversized:
                        outcome = Outcome(reason="oversized", message=f"reply longer than {self.max_chars} characters")
                        self._replace(slot)
                    except (EOFError, OSError, ValueError):
                        outcome = self._died(slot, w)
                elif not w.proc.is_alive():
                    outcome = self._died(slot, w)
                elif time.monotonic() > deadline:
                    outcome = Outcome(reason="timeout", message=f"no answer within {self.timeout:g}s (worker killed)")
                    self._replace(slot)
                if outcome is not None:
                    out[episode] = outcome
                    del busy[slot]
            if busy:
                multiprocessing.connection.wait([self.slots[s].conn for s in busy], timeout=0.05)
        return out

    def _with_restore(self, episode: int, slot: int, msg: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """A step for an episode whose environment lived in a replaced worker carries what rebuilds it."""
        home = self.home[episode]
        if msg["op"] != "step" or home[1] == self.generation[slot]:
            return msg, 1
        prompt, turns = self.history[episode]
        return {**msg, "restore": {"prompt": prompt, "turns": turns}}, 2 + len(turns)

    def _answer(self, episode: int, slot: int, msg: dict[str, Any], reply: dict[str, Any]) -> Outcome:
        if not reply.get("ok"):
            reason = reply.get("reason") if reply.get("reason") in ("error", "invalid", "oversized", "memory") else "error"
            return Outcome(reason=reason, message=str(reply.get("message", ""))[:300])
        self.home[episode] = (slot, self.generation[slot])
        if msg["op"] == "reset":
            return Outcome(value=reply["observation"])
        try:
            result = step_result(reply)
        except InvalidResult as exc:  # the worker checked it already; a reply altered on the way is refused too
            return Outcome(reason="invalid", message=str(exc))
        self.history[episode][1].append(msg["turn"])
        return Outcome(value=result)

    def _died(self, slot: int, w: _Worker) -> Outcome:
        w.proc.join(timeout=1)
        code = w.proc.exitcode
        self._replace(slot)
        return Outcome(reason="exit", message=f"environment worker exited (code {code})")


class _Oversized(Exception):
    pass


class _Worker(PipeWorker):
    def ready(self) -> str | None:
        """Wait until the worker built its environment: None, or what went wrong ("build: ..." for a bad config)."""
        if not self.conn.poll(STARTUP_GRACE_SECONDS):
            self.stop()
            return f"not ready after {STARTUP_GRACE_SECONDS:g}s"
        try:
            hello = json.loads(self.conn.recv_bytes())
        except (EOFError, OSError, ValueError):
            self.stop()
            return f"died while starting (exit {self.proc.exitcode})"
        if not hello.get("ready"):
            self.stop()
            return f"build: {hello.get('error')}"
        return None

    def send(self, msg: dict[str, Any]) -> None:
        self.conn.send_bytes(json.dumps(msg, default=str).encode())

    def receive(self, max_chars: int) -> dict[str, Any]:
        try:
            raw = self.conn.recv_bytes(4 * max_chars + 65536)
        except OSError as exc:
            if "too long" in str(exc) or "bad message length" in str(exc):
                raise _Oversized() from None
            raise
        reply = json.loads(raw)
        if not isinstance(reply, dict):
            raise ValueError("reply is not an object")
        return reply


# ------------------------------------------------------------------------------------------------------ the worker
def _limit_memory(mib: int) -> None:
    """RLIMIT_AS = the address space held now + `mib` MiB (where /proc tells it; elsewhere no limit)."""
    try:
        with open("/proc/self/status") as f:
            size_kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return
    limit = (size_kib << 10) + (mib << 20)
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _close(env: Any) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001 - an environment's clean-up never fails the episode after it ended
            pass


def _call(cls, config: dict[str, Any], envs: dict[int, Any], msg: dict[str, Any], max_chars: int) -> dict[str, Any]:
    episode, op = int(msg["id"]), msg["op"]
    if op == "reset":
        env = cls(**config)
        observation = first_observation(env.reset(msg["prompt"]))
        if len(observation) > max_chars:
            _close(env)
            return {"ok": False, "reason": "oversized",
                    "message": f"first observation of {len(observation)} characters (limit {max_chars})"}
        envs[episode] = env
        return {"ok": True, "observation": observation}
    env = envs.get(episode)
    if env is None:
        restore = msg.get("restore")
        if restore is None:
            return {"ok": False, "reason": "error", "message": f"no environment for episode {episode}"}
        env = cls(**config)
        env.reset(restore["prompt"])
        for turn in restore["turns"]:
            env.step(turn)
        envs[episode] = env
    try:
        result = step_result(env.step(msg["turn"]))
    except BaseException:
        envs.pop(episode, None)
        raise
    if result.done:
        envs.pop(episode, None)
        _close(env)
    if result.observation is not None and len(result.observation) > max_chars:
        envs.pop(episode, None)
        return {"ok": False, "reason": "oversized",
                "message": f"observation of {len(result.observation)} characters (limit {max_chars})"}
    return {"ok": True, **result.to_json()}


def _serve(conn, path: str, config_json: str, memory_mib: int, max_chars: int) -> None:  # pragma: no cover - worker
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = json.loads(config_json)
    try:
        cls = load_class(path)
        _close(cls(**config))
    except Exception as exc:  # noqa: BLE001 - reported to the pool: a configuration error of the run
        conn.send_bytes(json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}"}).encode())
        return
    _limit_memory(memory_mib)
    conn.send_bytes(json.dumps({"ready": True}).encode())
    envs: dict[int, Any] = {}
    while True:
        try:
            msg = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if msg.get("op") == "close":
            env = envs.pop(int(msg["id"]), None)
            if env is not None:
                _close(env)
            continue
        try:
            out = _call(cls, config, envs, msg, max_chars)
        except MemoryError:
            out = {"ok": False, "reason": "memory", "message": f"out of memory (limit {memory_mib} MiB)"}
        except InvalidResult as exc:
            out = {"ok": False, "reason": "invalid", "message": str(exc)}
        except Exception as exc:  # noqa: BLE001 - an environment's failure is reported, never raised
            out = {"ok": False, "reason": "error", "message": f"{type(exc).__name__}: {exc}"[:300]}
        try:
            data = json.dumps(out)
        except (TypeError, ValueError) as exc:
            data = json.dumps({"ok": False, "reason": "invalid", "message": f"not JSON: {exc}"[:300]})
        conn.send_bytes(data.encode())
