"""From a rollout's groups to what is published: filters → advantages → steps → DP schedule → per-rank payloads.

Pure functions (numpy + the scheduler), no I/O, so each stage is unit-tested on its own.

Filters (applied to a rollout's new groups; carried-over groups were filtered when they were produced):
  max_length     a group with any sample longer than min(filters.maxLength, model.seqLength) tokens is dropped
                 whole (group-relative advantages of a partial group would be biased; trainers cannot take samples
                 over seqLength).
  zero_variance  a group whose rewards are all equal is dropped (dynamic sampling: it carries no policy-gradient
                 signal). Groups that give only advantages (jsonl) are judged by their advantages.
Advantages: policy_gradient — (reward − group mean) / (group std + 1e-6), population std; advantages given by a
jsonl source are used as they are. sft — 1 for every sample.

Scheduler lengths: a sample's length is len(tokens). The trainer packs whole samples (input = all tokens, target of
position t-1 is token t where loss_mask[t] = 1), so a sample occupies len(tokens) positions of a micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainingrun.rollout.sources import ConfigError, Group
from trainingrun.store.base import RankPayload

ADV_EPS = 1e-6


@dataclass
class FilterStats:
    max_length: int = 0  # samples dropped
    zero_variance: int = 0  # samples dropped

    def as_dict(self) -> dict[str, int]:
        return {"max_length": self.max_length, "zero_variance": self.zero_variance}


def apply_filters(groups: list[Group], *, max_length: int | None, zero_variance: bool) -> tuple[list[Group], FilterStats]:
    """The groups that pass, and how many samples each filter dropped."""
    stats = FilterStats()
    kept = []
    for g in groups:
        if max_length is not None and max(g.lengths) > max_length:
            stats.max_length += len(g)
            continue
        if zero_variance:
            values = g.rewards if g.has_reward or g.advantages is None else g.advantages
            if len(g) < 2 or float(np.ptp(values)) == 0.0:
                stats.zero_variance += len(g)
                continue
        kept.append(g)
    return kept, stats


def compute_advantages(groups: list[Group], loss_type: str) -> None:
    """Set `advantages` of each group in place (see the module docstring)."""
    for g in groups:
        if loss_type == "sft":
            g.advantages = np.ones(len(g), np.float32)
        elif g.advantages is None:
            r = g.rewards.astype(np.float64)
            g.advantages = ((r - r.mean()) / (r.std() + ADV_EPS)).astype(np.float32)


def split_into_steps(
    groups: list[Group],
    *,
    policy: str,
    groups_per_step: int | None,
    dp_size: int,
    micro_batch_size: int | None = None,
    microbatch_multiple: int = 1,
) -> tuple[list[Group], list[Group]]:
    """(groups that form this rollout's steps, groups carried into the next rollout), order kept.

    fixed: as many whole steps of `groups_per_step` groups as there are; the rest is carried. dynamic: all groups
    form one step, or, when the scheduler could not plan that step, all are carried: fewer than `dp_size` samples
    (every rank needs one) or, with static micro-batches (`micro_batch_size`), fewer samples than the aligned
    micro-batch count (`trainingrun.schedule.step_fits`).
    A fixed step the scheduler cannot plan is a ConfigError (globalBatchSize too small for the ranks/micro-batches).
    """
    from trainingrun.schedule import step_fits

    def fits(n: int) -> bool:
        return step_fits(n, dp_size=dp_size, micro_batch_size=micro_batch_size, microbatch_multiple=microbatch_multiple)

    if policy == "dynamic":
        if not fits(sum(len(g) for g in groups)):
            return [], list(groups)
        return list(groups), []
    assert groups_per_step is not None
    n_steps = len(groups) // groups_per_step
    used = groups[: n_steps * groups_per_step]
    for s in range(n_steps):
        n = sum(len(g) for g in used[s * groups_per_step : (s + 1) * groups_per_step])
        if n < dp_size:
            raise ConfigError(
                f"rollout.steps.globalBatchSize: a step of {groups_per_step} groups holds only {n} samples, fewer "
                f"than the {dp_size} data-parallel ranks; raise globalBatchSize or groupSize"
            )
        if not fits(n):
            quantum = dp_size * microbatch_multiple
            raise ConfigError(
                f"rollout.steps.globalBatchSize: a step of {groups_per_step} groups holds only {n} samples, too few "
                f"for trainer.microBatchSize {micro_batch_size}: its micro-batches per step, a multiple of "
                f"{quantum} (data-parallel ranks {dp_size} × microbatchMultiple {microbatch_multiple}), would "
                f"outnumber its samples; raise globalBatchSize, lower microBatchSize or use maxTokensPerGPU"
            )
    return used, list(groups[n_steps * groups_per_step :])


@dataclass
class BuiltRollout:
    """A rollout ready to publish."""

    schedule: dict[str, Any]
    payloads: dict[int, RankPayload]
    num_samples: int
    num_steps: int
    imbalance: list[float] = field(default_factory=list)


def build_rollout(
    rollout: int,
    groups: list[Group],
    *,
    dp_size: int,
    policy: str,
    groups_per_step: int | None,
    max_tokens_per_gpu: int | None,
    micro_batch_size: int | None,
    microbatch_multiple: int,
    step_offset: int,
    samples_offset: int,
    extra: dict[str, Any] | None = None,
) -> BuiltRollout:
    """Schedule `groups` (which form whole steps) over `dp_size` ranks and cut the per-rank payloads."""
    from trainingrun.schedule import build_dp_schedule

    tokens = [t for g in groups for t in g.tokens]
    masks = [m for g in groups for m in g.loss_masks]
    rewards = np.concatenate([g.rewards for g in groups]).astype(np.float32)
    advantages = np.concatenate([g.advantages for g in groups]).astype(np.float32)
    sample_ids = np.concatenate([g.sample_ids for g in groups]).astype(np.int64)
    group_ids = [g.group_id for g in groups for _ in range(len(g))]
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    sched = build_dp_schedule(
        lengths,
        dp_size=dp_size,
        global_batch_size=groups_per_step if policy == "fixed" else None,
        group_ids=group_ids,
        max_tokens_per_gpu=max_tokens_per_gpu,
        micro_batch_size=micro_batch_size,
        microbatch_multiple=microbatch_multiple,
    )
    if sched.leftover:  # split_into_steps passes whole steps only
        raise AssertionError(f"scheduler left {len(sched.leftover)} samples over from whole steps")
    loss_counts = np.array([int(m.sum()) for m in masks], dtype=np.int64)
    loss_tokens = sched.step_loss_tokens(loss_counts)
    imbalance, step_tokens = [], []
    for s in range(sched.num_steps):
        load = [sum(int(lengths[i]) for mb in sched.step_microbatches(r, s) for i in mb) for r in range(dp_size)]
        step_tokens.append(sum(load))
        mean = sum(load) / dp_size
        imbalance.append(max(load) / mean if mean else 1.0)
    payloads = {}
    for r, part in enumerate(sched.partitions):
        idx = np.asarray(part, dtype=np.int64)
        offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(lengths[idx], out=offsets[1:])
        payloads[r] = {
            "tokens": np.concatenate([tokens[i] for i in idx]).astype(np.int32) if len(idx) else np.zeros(0, np.int32),
            "offsets": offsets,
            "loss_mask": np.concatenate([masks[i] for i in idx]).astype(np.uint8) if len(idx) else np.zeros(0, np.uint8),
            "advantages": advantages[idx],
            "rewards": rewards[idx],
            "sample_ids": sample_ids[idx],
        }
    schedule = {
        "rollout": rollout,
        "dp_size": dp_size,
        "schedule": sched.to_dict(),
        "global_batch_sizes": list(map(int, sched.global_batch_sizes)),
        "loss_tokens": list(map(int, loss_tokens)),
        "step_tokens": step_tokens,
        "imbalance": [round(x, 6) for x in imbalance],
        "num_steps": sched.num_steps,
        "num_samples": len(tokens),
        "num_groups": len(groups),
        "step_offset": step_offset,
        "samples_offset": samples_offset,
        "mean_reward": float(rewards.mean()) if len(rewards) else 0.0,
        **(extra or {}),
    }
    return BuiltRollout(schedule, payloads, len(tokens), sched.num_steps, imbalance)
