"""`rollout.source.type: synthetic`: a seeded, learnable task, and the token ids of the built-in tasks.

Token ids of the built-in tasks (here and in the synthetic prompts of generated rollouts, `rollout/prompts.py`):
0 pad, 1 separator, 2 end of answer, 3.. content.

    sample = prompt + [SEP] + response + [EOS], response = task(prompt) with some tokens corrupted.
    The loss mask covers response and EOS. Prompt lengths follow a truncated Pareto law (alpha 1.2) between
    minLength and maxLength: mostly short, a heavy tail of long ones. Each of the groupSize samples of a group
    gets its own corruption rate (uniform in [0, 0.6)); each answer token is replaced by a different random token
    with that probability; reward = fraction of answer tokens that are correct. With probability 0.2 a group's
    samples are all identical (as when a policy is confident), so the zero-variance filter drops it.
    Everything is drawn from a generator seeded by (spec.seed, source index): rollout i is the same whatever
    happened before, which makes restarts deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainingrun.contract.errors import ConfigError
from trainingrun.rollout.groups import SampleGroup
from trainingrun.rollout.source import ReplaySource

PAD, SEP, EOS = 0, 1, 2
FIRST_CONTENT = 3
PARETO_ALPHA = 1.2
IDENTICAL_GROUP_P = 0.2
MAX_CORRUPTION = 0.6


def truncated_pareto_lengths(rng: np.random.Generator, n: int, lo: int, hi: int, alpha: float = PARETO_ALPHA) -> np.ndarray:
    """n integer lengths in [lo, hi], density ∝ x^-(alpha+1) (inverse-CDF sampling of a truncated Pareto law)."""
    if lo == hi:
        return np.full(n, lo, dtype=np.int64)
    u = rng.random(n)
    upper = hi + 1  # floor() then reaches hi
    x = lo / (1.0 - u * (1.0 - (lo / upper) ** alpha)) ** (1.0 / alpha)
    return np.clip(np.floor(x).astype(np.int64), lo, hi)


def task_answer(task: str, prompt: np.ndarray) -> np.ndarray:
    if task == "reverse":
        return prompt[::-1].copy()
    if task == "sort":
        return np.sort(prompt)
    if task == "copy":
        return prompt.copy()
    raise ConfigError(f"rollout.source.synthetic.task: unknown task {task!r}; allowed: reverse, sort, copy")


@dataclass(frozen=True)
class SyntheticConfig:
    task: str
    min_length: int
    max_length: int
    vocab_size: int
    group_size: int
    groups_per_rollout: int
    seed: int


def synthetic_rollout(cfg: SyntheticConfig, source_index: int) -> list[SampleGroup]:
    """The groups of synthetic rollout `source_index`; a pure function of (cfg, source_index)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([cfg.seed, source_index, 0x7A11])))
    n_content = cfg.vocab_size - FIRST_CONTENT
    lengths = truncated_pareto_lengths(rng, cfg.groups_per_rollout, cfg.min_length, cfg.max_length)
    groups = []
    gs = cfg.group_size
    for g, plen in enumerate(lengths):
        prompt = rng.integers(FIRST_CONTENT, cfg.vocab_size, size=int(plen)).astype(np.int32)
        answer = task_answer(cfg.task, prompt)
        identical = rng.random() < IDENTICAL_GROUP_P
        rates = rng.uniform(0.0, MAX_CORRUPTION, size=gs)
        toks, masks, rewards = [], [], np.empty(gs, np.float32)
        for i in range(gs):
            if identical and i > 0:
                toks.append(toks[0].copy())
                masks.append(masks[0].copy())
                rewards[i] = rewards[0]
                continue
            wrong = rng.random(int(plen)) < rates[i]
            # a different token: shift by 1..n_content-1 within the content range
            shift = rng.integers(1, max(n_content, 2), size=int(plen))
            response = answer.copy()
            if n_content > 1:
                response[wrong] = (answer[wrong] - FIRST_CONTENT + shift[wrong]) % n_content + FIRST_CONTENT
            else:
                wrong[:] = False
            tokens = np.concatenate([prompt, [SEP], response, [EOS]]).astype(np.int32)
            mask = np.zeros(len(tokens), np.uint8)
            mask[int(plen) + 1 :] = 1  # response tokens and EOS are targets
            toks.append(tokens)
            masks.append(mask)
            rewards[i] = 1.0 - wrong.mean()
        gid = source_index * cfg.groups_per_rollout + g
        ids = np.arange(gid * gs, (gid + 1) * gs, dtype=np.int64)
        groups.append(SampleGroup(group_id=gid, tokens=toks, loss_masks=masks, rewards=rewards, sample_ids=ids))
    return groups


class SyntheticSource(ReplaySource):
    """`rollout.source.type: synthetic` (see the module docstring)."""

    def __init__(self, cfg: SyntheticConfig):
        self.cfg = cfg

    def draw(self, index: int) -> list[SampleGroup]:
        return synthetic_rollout(self.cfg, index)
