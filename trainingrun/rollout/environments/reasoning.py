"""`environment.type: reasoningGym`: a multi-step reasoning-gym task — the model answers, hears whether it was right,
and tries again.

reset: the prompt's question (reasoningGym prompts: the entry `prompt.index` of the prompt source's seeded dataset,
which the worker builds once). step(answer): the task's own `score_answer(answer, entry)`; a score of at least
`threshold` ends the episode with reward score × decay^(attempt − 1); otherwise the model hears `feedback` (role
user) and answers again, up to `attempts` answers (the last one ends the episode with its score, also discounted).
Keep `rollout.source.generate.environment.maxTurns` ≥ `attempts`, or episodes are truncated first.

Settings (`environment.config`): `attempts` (default 3), `feedback` (default "That is not right. Try again."),
`threshold` (default 1.0), `decay` (default 1.0: a late right answer counts fully).
"""

from __future__ import annotations

from typing import Any

from trainingrun.rollout.environments.base import StepResult
from trainingrun.rollout.prompts import reasoning_gym_dataset

_DATASETS: dict[str, Any] = {}  # one per worker process and dataset


def dataset(params: dict[str, Any]):
    key = repr(sorted(params.items()))
    if key not in _DATASETS:
        _DATASETS[key] = reasoning_gym_dataset(**params)
    return _DATASETS[key]


class ReasoningGymRetry:
    """See the module docstring."""

    def __init__(self, attempts: int = 3, feedback: str = "That is not right. Try again.", threshold: float = 1.0,
                 decay: float = 1.0):
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ValueError(f"reasoningGym environment: attempts must be a positive int, got {attempts!r}")
        if not 0.0 < float(decay) <= 1.0:
            raise ValueError(f"reasoningGym environment: decay must be in (0, 1], got {decay!r}")
        self.attempts, self.feedback = attempts, str(feedback)
        self.threshold, self.decay = float(threshold), float(decay)
        self.tries = 0
        self.data = self.entry = None

    def reset(self, prompt: dict[str, Any]) -> str:
        params = prompt.get("dataset")
        if not params:
            raise ValueError("reasoningGym environment: needs reasoningGym prompts (prompts.type reasoningGym)")
        self.data = dataset(params)
        self.entry = self.data[int(prompt["index"])]
        return str(prompt.get("text") or self.entry["question"])

    def step(self, turn: str) -> StepResult:
        self.tries += 1
        score = float(self.data.score_answer(answer=turn.strip(), entry=self.entry))
        reward = score * self.decay ** (self.tries - 1)
        if score >= self.threshold or self.tries >= self.attempts:
            return StepResult(observation=None, reward=reward, done=True)
        return StepResult(observation=self.feedback, reward=0.0, done=False, role="user")
