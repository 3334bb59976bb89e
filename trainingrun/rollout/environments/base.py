"""The environment protocol of multi-turn episodes, and the checks every environment's answer goes through.

An environment is a class built once per episode as `Class(**config)` (`rollout.source.generate.environment.config`):

    reset(prompt: dict) -> str                 the first observation (the conversation's first user message)
    step(turn: str) -> (observation, reward, done)   or (observation, reward, done, info), or a `StepResult`
    close() -> None                            optional: the episode is over

`prompt` holds the prompt source's `text`, `reference` (the answer), `index`, `meta`, `tokens` (ids, for token
prompts), `dataset` (reasoning-gym prompts: name, config, seed, size) and `seed` (per episode: an environment that
draws random numbers seeds them with it, so a restarted rollout replays the same episodes). `turn` is the model's
turn as text: its tokens decoded once, without the end-of-text token. `observation` is text (None or anything when
`done`: it is not shown to the model); `reward` a finite number; `done` a bool. `info` may count `tool_calls` and
`tool_errors` (ints, for the metrics) and name the observation's chat `role` ("user" by default; "tool" for tool
results).

Anything else — an exception, a non-text observation, a reward that is not a finite number, a `done` that is not a
bool — is a failure of the environment (`InvalidResult`): the pool (`rollout/environments/pool.py`) ends that episode
as failed and counts the reason (FAILURE_REASONS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from trainingrun.rollout.rewards import load_named

# why an environment call failed: raised, ran past timeoutSeconds, answered something malformed, an observation over
# the size limit, its worker process exited, or it ran out of its memory limit
FAILURE_REASONS = ("error", "timeout", "invalid", "oversized", "exit", "memory")
ROLES = ("user", "tool", "system")


class InvalidResult(ValueError):
    """An environment answered something that is not a valid result."""


class Environment(Protocol):
    def reset(self, prompt: dict[str, Any]) -> str: ...

    def step(self, turn: str) -> Any: ...


@dataclass(frozen=True)
class StepResult:
    """One environment step, checked (`step_result`)."""

    observation: str | None
    reward: float
    done: bool
    tool_calls: int = 0
    tool_errors: int = 0
    role: str = "user"

    def to_json(self) -> dict[str, Any]:
        return {"observation": self.observation, "reward": self.reward, "done": self.done,
                "tool_calls": self.tool_calls, "tool_errors": self.tool_errors, "role": self.role}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StepResult:
        return step_result(d)


def _count(info: dict[str, Any], key: str) -> int:
    value = info.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidResult(f"step: info[{key!r}] must be a non-negative int, got {value!r}")
    return value


def step_result(value: Any) -> StepResult:
    """An environment's step answer as a checked StepResult; InvalidResult saying what is wrong."""
    if isinstance(value, StepResult):
        value = value.to_json()
    if isinstance(value, dict):
        info = {k: v for k, v in value.items() if k not in ("observation", "reward", "done")}
        missing = [k for k in ("observation", "reward", "done") if k not in value]
        if missing:
            raise InvalidResult(f"step: result misses {missing}")
        obs, reward, done = value["observation"], value["reward"], value["done"]
    elif isinstance(value, (tuple, list)) and len(value) in (3, 4):
        obs, reward, done = value[:3]
        info = value[3] if len(value) == 4 else {}
        if not isinstance(info, dict):
            raise InvalidResult(f"step: info must be a dict, got {type(info).__name__}")
    else:
        raise InvalidResult(f"step: must return (observation, reward, done[, info]), got {type(value).__name__}")
    if not isinstance(done, bool):
        raise InvalidResult(f"step: done must be a bool, got {type(done).__name__}")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise InvalidResult(f"step: reward must be a finite number, got {reward!r}"[:200])
    if done:
        obs = obs if isinstance(obs, str) else None
    elif not isinstance(obs, str):
        raise InvalidResult(f"step: observation must be text, got {type(obs).__name__}")
    role = info.get("role", "user")
    if role not in ROLES:
        raise InvalidResult(f"step: info['role'] must be one of {ROLES}, got {role!r}"[:200])
    return StepResult(observation=obs, reward=float(reward), done=done, tool_calls=_count(info, "tool_calls"),
                      tool_errors=_count(info, "tool_errors"), role=role)


def first_observation(value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidResult(f"reset: the first observation must be text, got {type(value).__name__}")
    return value


BUILT_IN = {
    "calculator": "trainingrun.rollout.environments.calculator:Calculator",
    "reasoningGym": "trainingrun.rollout.environments.reasoning:ReasoningGymRetry",
}


def environment_path(env_type: str, class_name: str | None) -> str:
    """The `module:Class` an environment spec names."""
    if env_type == "class":
        assert class_name is not None
        return class_name
    return BUILT_IN[env_type]


def load_class(path: str) -> type:
    """`module:Class` → the class; ValueError naming environment.className when it cannot be loaded."""
    return load_named(path, "rollout.source.generate.environment.className")
