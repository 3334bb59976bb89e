"""Hand-built rollouts for trainer tests and the trainer benchmark (the real producer is `trainingrun rollout`).

`make_samples` draws a seeded "reverse the prompt" task with varied lengths; `publish` schedules them with the
project's scheduler (`build_dp_schedule`) and publishes them per the store contract (per-rank payloads in
`partitions[r]` order, schedule JSON with global_batch_sizes, loss_tokens, step_offset, samples_offset).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Samples:
    """A rollout's samples before scheduling."""

    tokens: list[np.ndarray]
    loss_masks: list[np.ndarray]
    advantages: np.ndarray
    rewards: np.ndarray
    group_ids: list[int]
    sample_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def make_samples(n: int, *, vocab: int, seed: int, min_len: int = 3, max_len: int = 16, group_size: int = 2,
                 id_base: int = 0) -> Samples:
    """n samples: prompt p, separator 1, then reversed p; targets = the reversed part (and the separator's successor)."""
    rng = np.random.default_rng(seed)
    toks, masks = [], []
    for _ in range(n):
        plen = int(rng.integers(min_len, max_len + 1))
        prompt = rng.integers(2, vocab, plen)
        seq = np.concatenate([prompt, [1], prompt[::-1]]).astype(np.int32)
        mask = np.zeros(len(seq), np.uint8)
        mask[plen + 1:] = 1
        toks.append(seq)
        masks.append(mask)
    rewards = rng.random(n).astype(np.float32)
    groups = [i // group_size for i in range(n)]
    adv = rewards.copy()
    for g in set(groups):  # group-normalised advantage
        idx = [i for i in range(n) if groups[i] == g]
        adv[idx] = rewards[idx] - rewards[idx].mean()
    return Samples(toks, masks, adv.astype(np.float32), rewards, groups, np.arange(id_base, id_base + n, dtype=np.int64))


def payload_for(samples: Samples, positions: list[int]) -> dict[str, np.ndarray]:
    """The RankPayload of the samples at `positions` (in that order)."""
    toks = [samples.tokens[i] for i in positions]
    lens = [len(t) for t in toks]
    return {
        "tokens": np.concatenate(toks).astype(np.int32) if toks else np.zeros(0, np.int32),
        "offsets": np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        "loss_mask": np.concatenate([samples.loss_masks[i] for i in positions]).astype(np.uint8)
        if toks else np.zeros(0, np.uint8),
        "advantages": samples.advantages[positions].astype(np.float32),
        "rewards": samples.rewards[positions].astype(np.float32),
        "sample_ids": samples.sample_ids[positions].astype(np.int64),
    }


def loss_tokens_of(samples: Samples, idx: list[int]) -> int:
    """Target tokens (loss_mask, first token of each sample excluded) of the samples `idx`."""
    return int(sum(int(samples.loss_masks[i][1:].sum()) for i in idx))


def schedule_and_payloads(samples: Samples, *, dp_size: int, rollout: int, step_offset: int, samples_offset: int,
                          groups_per_step: int | None, max_tokens_per_gpu: int | None = None,
                          micro_batch_size: int | None = None) -> tuple[dict[str, Any], dict[int, dict]]:
    from trainingrun.schedule import build_dp_schedule

    sched = build_dp_schedule(
        [len(t) for t in samples.tokens], dp_size=dp_size, global_batch_size=groups_per_step,
        group_ids=samples.group_ids, max_tokens_per_gpu=max_tokens_per_gpu, micro_batch_size=micro_batch_size,
    )
    d = sched.to_dict()
    step_samples: list[list[int]] = [[] for _ in d["global_batch_sizes"]]
    for r in range(dp_size):
        flat = [mb for mb in d["micro_batch_indices"][r]]
        k = 0
        for s, m in enumerate(d["num_microbatches"]):
            for mb in flat[k:k + m]:
                step_samples[s].extend(d["partitions"][r][p] for p in mb)
            k += m
    schedule = {
        "rollout": rollout, "dp_size": dp_size, "schedule": d,
        "global_batch_sizes": d["global_batch_sizes"],
        "loss_tokens": [loss_tokens_of(samples, idx) for idx in step_samples],
        "step_offset": step_offset, "samples_offset": samples_offset,
        "num_samples": len(samples.tokens),
    }
    payloads = {r: payload_for(samples, list(d["partitions"][r])) for r in range(dp_size)}
    return schedule, payloads


def publish(store, *, num_rollouts: int, samples_per_rollout: list[int] | int, dp_size: int, vocab: int, seed: int,
            groups_per_step: int | None = 2, max_tokens_per_gpu: int | None = 64, group_size: int = 2,
            finish: bool = True) -> list[dict[str, Any]]:
    """Publish `num_rollouts` rollouts (sample counts vary if a list is given); returns their schedules."""
    counts = samples_per_rollout if isinstance(samples_per_rollout, list) else [samples_per_rollout] * num_rollouts
    step_offset = samples_offset = 0
    out = []
    for k in range(num_rollouts):
        s = make_samples(counts[k], vocab=vocab, seed=seed * 1000 + k, group_size=group_size, id_base=k * 100_000)
        schedule, payloads = schedule_and_payloads(
            s, dp_size=dp_size, rollout=k, step_offset=step_offset, samples_offset=samples_offset,
            groups_per_step=groups_per_step, max_tokens_per_gpu=max_tokens_per_gpu,
        )
        if schedule["schedule"]["leftover"]:
            raise ValueError("synthetic publish: choose counts that fill whole steps (no leftover)")
        store.publish_rollout(k, payloads, schedule)
        step_offset += len(schedule["global_batch_sizes"])
        samples_offset += sum(schedule["global_batch_sizes"])
        out.append(schedule)
    if finish:
        store.finish(num_rollouts)
    return out
