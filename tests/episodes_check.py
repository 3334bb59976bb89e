"""What the multi-turn tests share: an engine wrapper that records every call, and the token-in/token-out check of a
sample against the engine's answers (rollout/episodes.py)."""

from __future__ import annotations

import numpy as np


class Recording:
    """Wraps an Engine; `calls` holds (contexts, n, completions) of every generate call, in order."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.name = getattr(engine, "name", "recording")

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def load_weights(self, version: int) -> None:
        self.engine.load_weights(version)

    def generate(self, prompts, n, sampling):
        out = self.engine.generate(prompts, n, sampling)
        self.calls.append(([list(map(int, p)) for p in prompts], n, out))
        return out

    def close(self) -> None:
        self.engine.close()

    def pairs(self) -> list[tuple[list[int], object]]:
        """(context, completion) of every completion the engine returned."""
        return [(ctx, c) for contexts, _n, outs in self.calls for ctx, comps in zip(contexts, outs) for c in comps]


def check_sample(tokens: np.ndarray, mask: np.ndarray, logprobs: np.ndarray, pairs) -> int:
    """Every model token of an episode sample is a token the engine returned for exactly the context before it, with
    its log-probability bit for bit and loss mask 1; every other token has mask 0 and log-probability 0. Returns the
    sample's turns. AssertionError naming the position otherwise."""
    tokens, mask, logprobs = np.asarray(tokens), np.asarray(mask), np.asarray(logprobs, np.float32)
    candidates: dict[int, list] = {}  # turn start -> completions the engine returned for the context before it
    for ctx, c in pairs:
        end = len(ctx) + len(c.tokens)
        if end <= len(tokens) and np.array_equal(tokens[:len(ctx)], ctx) and np.array_equal(tokens[len(ctx):end],
                                                                                         c.tokens):
            candidates.setdefault(len(ctx), []).append(c)
    model = np.zeros(len(tokens), bool)
    for start, comps in sorted(candidates.items()):
        # several episodes may share a context (and even a completion's tokens): one of them is this sample's turn
        match = next((c for c in sorted(comps, key=lambda c: -len(c.tokens))
                      if mask[start:start + len(c.tokens)].all()
                      and np.array_equal(logprobs[start:start + len(c.tokens)], np.asarray(c.logprobs, np.float32))),
                     None)
        assert match is not None, f"the turn at {start}: no completion of the engine with these tokens, loss mask 1 " \
                                  "and these logprobs"
        end = start + len(match.tokens)
        assert not model[start:end].any(), f"turns overlap at {start}"
        model[start:end] = True
    assert np.array_equal(mask.astype(bool), model), \
        f"loss mask 1 where the engine generated nothing, or 0 on a turn (positions {np.flatnonzero(mask != model)[:8]})"
    assert not logprobs[~model].any(), "a logprob on a token the engine did not generate"
    return int(sum(1 for _ in candidates))
