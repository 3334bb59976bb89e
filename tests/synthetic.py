"""Hand-built rollouts for trainer tests and the trainer benchmark (the real producer is `trainingrun rollout`).

`make_samples` draws a seeded "reverse the prompt" task with varied lengths; `schedule_and_payloads` schedules them
through the rollout contract (`trainingrun.contract.published.build_published`) and `publish` publishes them with it.
"""

from __future__ import annotations

import numpy as np

from trainingrun.contract import published
from trainingrun.contract.published import PublishedRollout, Samples


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
    return Samples(tokens=toks, loss_masks=masks, rewards=rewards, advantages=adv.astype(np.float32),
                   sample_ids=np.arange(id_base, id_base + n, dtype=np.int64), group_ids=groups)


def loss_tokens_of(samples: Samples, idx: list[int]) -> int:
    """Target tokens (loss_mask, first token of each sample excluded) of the samples `idx`."""
    return int(sum(int(samples.loss_masks[i][1:].sum()) for i in idx))


def schedule_and_payloads(samples: Samples, *, dp_size: int, rollout: int, step_offset: int, samples_offset: int,
                          groups_per_step: int | None, max_tokens_per_gpu: int | None = None,
                          micro_batch_size: int | None = None) -> tuple[PublishedRollout, dict[int, dict]]:
    """The published form and per-rank payloads of `samples`; ValueError if they do not fill whole steps."""
    doc, payloads, leftover = published.build_published(
        rollout, samples, dp_size=dp_size, groups_per_step=groups_per_step, max_tokens_per_gpu=max_tokens_per_gpu,
        micro_batch_size=micro_batch_size, step_offset=step_offset, samples_offset=samples_offset,
        allow_leftover=True,
    )
    if leftover:
        raise ValueError("synthetic rollout: choose counts that fill whole steps (no leftover)")
    return doc, payloads


def publish(store, *, num_rollouts: int, samples_per_rollout: list[int] | int, dp_size: int, vocab: int, seed: int,
            groups_per_step: int | None = 2, max_tokens_per_gpu: int | None = 64, group_size: int = 2,
            finish: bool = True) -> list[PublishedRollout]:
    """Publish `num_rollouts` rollouts (sample counts vary if a list is given); returns them."""
    counts = samples_per_rollout if isinstance(samples_per_rollout, list) else [samples_per_rollout] * num_rollouts
    step_offset = samples_offset = 0
    out = []
    for k in range(num_rollouts):
        s = make_samples(counts[k], vocab=vocab, seed=seed * 1000 + k, group_size=group_size, id_base=k * 100_000)
        doc, payloads = schedule_and_payloads(
            s, dp_size=dp_size, rollout=k, step_offset=step_offset, samples_offset=samples_offset,
            groups_per_step=groups_per_step, max_tokens_per_gpu=max_tokens_per_gpu,
        )
        published.publish(store, doc, payloads)
        step_offset += doc.num_steps
        samples_offset += doc.num_samples
        out.append(doc)
    if finish:
        store.finish(num_rollouts)
    return out
