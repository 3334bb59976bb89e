"""The inference engine the rollout generates with: a small protocol, implemented in-process (`megatron`) and by an
OpenAI-compatible server (`vllm`).

    engine.generate(prompts, n, sampling) -> for each prompt, n `Completion`s
    engine.weight_version                 -> version of the weights it generates with now
    engine.load_weights(version)          -> generate with weights `version` from now on
    engine.close()

Completion: the generated token ids (without the prompt; ending with the stop token when one ended it), the
generator's log-probability of each of them, and why it ended. The log-probabilities are those of the distribution
the token was drawn from: softmax(logits / temperature) over the whole vocabulary, and with top_p < 1 its top-p set
renormalised (log p − log Σ_kept p) — what vLLM reports with `processed_logprobs`, and what the in-process engine
records. With top_p 1 the trainer, which divides its logits by the same temperature, computes the same numbers for
the same weights (with temperature 1 they are the plain model log-probabilities); with top_p < 1 the difference is
the truncated mass, a mismatch the trainer's rollout correction sees (docs/rl.md). For a mixture of experts, optionally
(`routed_experts`, the in-process engine with routing replay), the experts every token of prompt + completion was
routed to: int16 [len(prompt) + len(tokens), MoE layers × top-k], −1 for a token it never fed through the model.

Weight versions count the rollouts the trainers have trained (0: the initial weights). The trainers' weight
publisher (`trainingrun/trainer/weights.py`, chosen by `spec.weightSync`) makes a version loadable; an engine is
built with whatever it needs to fetch a loadable version (the store, a directory, a process group). `load_weights`
must leave the engine on either the old version or the new one, never a mix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one generate call (`spec.rollout.source.generate.sampling`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0  # with the same seed, prompts and weights, an engine generates the same tokens


@dataclass
class Completion:
    tokens: np.ndarray  # int32 [m], m >= 1
    logprobs: np.ndarray  # float32 [m]
    finish_reason: str  # one of FINISH_REASONS
    meta: dict = field(default_factory=dict)  # engine-specific extras (timings, ...)
    routed_experts: np.ndarray | None = None  # int16 [prompt + m, MoE layers × top-k] (see the module docstring)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.logprobs):
            raise ValueError(f"completion: {len(self.tokens)} tokens but {len(self.logprobs)} logprobs")
        if self.routed_experts is not None and (self.routed_experts.ndim != 2
                                                or len(self.routed_experts) < len(self.tokens)):
            raise ValueError(f"completion.routed_experts: shape {self.routed_experts.shape}; must be [prompt + "
                             f"{len(self.tokens)} tokens, MoE layers × top-k]")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"completion.finish_reason: {self.finish_reason!r}; allowed: {FINISH_REASONS}")


class Engine(Protocol):
    name: str

    @property
    def weight_version(self) -> int: ...

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        """n completions for each prompt (token ids), in prompt order."""

    def load_weights(self, version: int) -> None:
        """Generate with the weights of `version` (loadable: published by the trainers) from now on."""

    def close(self) -> None: ...
