"""The pure stages between a source's groups and a published rollout: filters → advantages → steps → flat samples.

Pure functions (numpy + the scheduler), no I/O, so each stage is unit-tested on its own.

Filters (applied to a rollout's new groups; carried-over groups were filtered when they were produced):
  max_length     a group with any sample longer than min(filters.maxLength, model.seqLength) tokens is dropped
                 whole (group-relative advantages of a partial group would be biased; trainers cannot take samples
                 over seqLength).
  zero_variance  a group whose rewards are all equal is dropped (dynamic sampling: it carries no policy-gradient
                 signal). Groups that give only advantages (jsonl) are judged by their advantages.
Advantages (`trainer.advantage`, computed once per group, `group_advantages`), r the group's rewards, n its size:
  grpo          (r − mean r) / (std r + 1e-6), std population (/n) or unbiased (/(n − 1), `stdNormalization`)
  dr_grpo       r − mean r (Dr. GRPO: no std, no length bias from it)
  rloo          r_i − mean_{j≠i} r_j = n/(n − 1) · (r_i − mean r) (leave-one-out baseline; 0 for n = 1)
  reinforce_pp  r − mean r here, then normalised over the step's samples when the step is formed
                (`normalize_over_steps`: (a − mean) / (std + 1e-6), std as grpo's)
Advantages given by a jsonl source are used as they are. sft — 1 for every sample. The estimators are one table,
`ESTIMATORS` (each entry: a group's advantages, and whether they are then normalised over each step).

Scheduler lengths: a sample's length is len(tokens). The trainer packs whole samples (input = all tokens, target of
position t-1 is token t where loss_mask[t] = 1), so a sample occupies len(tokens) positions of a micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import get_args

import numpy as np

from trainingrun.api.spec.trainer import StdNormalization
from trainingrun.contract.errors import ConfigError
from trainingrun.contract.fields import concat
from trainingrun.contract.published import Samples
from trainingrun.rollout.groups import SampleGroup
from trainingrun.schedule import step_fits

ADV_EPS = 1e-6


@dataclass
class FilterStats:
    max_length: int = 0  # samples dropped
    zero_variance: int = 0  # samples dropped
    stale: int = 0  # carried generated samples dropped: older than the staleness bound (generated rollouts only)

    def as_dict(self) -> dict[str, int]:
        out = {"max_length": self.max_length, "zero_variance": self.zero_variance}
        if self.stale:
            out["stale"] = self.stale
        return out


def apply_filters(groups: list[SampleGroup], *, max_length: int | None,
                  zero_variance: bool) -> tuple[list[SampleGroup], FilterStats]:
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


STD_NORMALIZATIONS = get_args(StdNormalization)


def _std(x: np.ndarray, std: str) -> float:
    """Population or unbiased std (unbiased of one value: 0)."""
    if std not in STD_NORMALIZATIONS:
        raise ValueError(f"trainer.advantage.stdNormalization: {std!r} is not one of {STD_NORMALIZATIONS}")
    return float(x.std(ddof=1)) if std == "unbiased" and len(x) > 1 else float(x.std())


def _grpo(r: np.ndarray, std: str) -> np.ndarray:
    return (r - r.mean()) / (_std(r, std) + ADV_EPS)


def _centred(r: np.ndarray, std: str) -> np.ndarray:
    return r - r.mean()


def _rloo(r: np.ndarray, std: str) -> np.ndarray:
    n = len(r)
    return (r - r.mean()) * (n / (n - 1)) if n > 1 else np.zeros_like(r)


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator (`trainer.advantage.estimator`, module docstring)."""

    doc: str  # one line: the advantage
    group: Callable[[np.ndarray, str], np.ndarray]  # (a group's rewards float64, stdNormalization) → its advantages
    over_steps: bool = False  # then normalised over each step's samples when the steps are formed
    #                           (`normalize_over_steps`; advantages given by a jsonl source are refused)


# The advantage estimators: a new one is one entry here, its value in `api.models.AdvantageEstimator` and a row in
# docs/rl.md ("Advantages"); tests/unit/test_rollout.py keeps the keys equal to the Literal's values.
ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator("(r − mean r) / (std r + 1e-6)", _grpo),
    "dr_grpo": Estimator("r − mean r (Dr. GRPO: no std)", _centred),
    "rloo": Estimator("r_i − mean_{j≠i} r_j (leave-one-out; 0 for a group of one)", _rloo),
    "reinforce_pp": Estimator("r − mean r, then normalised over the step's samples", _centred, over_steps=True),
}


def group_advantages(rewards: np.ndarray, estimator: str = "grpo", std: str = "population") -> np.ndarray:
    """One group's advantages (float64) from its rewards by `estimator` (see the module docstring)."""
    entry = ESTIMATORS.get(estimator)
    if entry is None:
        raise ValueError(f"trainer.advantage.estimator: {estimator!r} is not one of {tuple(ESTIMATORS)}")
    return entry.group(np.asarray(rewards, np.float64), std)


def compute_advantages(groups: list[SampleGroup], loss_type: str, estimator: str = "grpo",
                       std: str = "population") -> None:
    """Set `advantages` of each group in place (see the module docstring); given ones are kept."""
    for g in groups:
        if loss_type == "sft":
            g.advantages = np.ones(len(g), np.float32)
        elif g.advantages is None:
            g.advantages = group_advantages(g.rewards, estimator, std).astype(np.float32)


def normalize_over_steps(advantages: np.ndarray, groups: list[SampleGroup], groups_per_step: int | None,
                         std: str = "population") -> np.ndarray:
    """reinforce_pp: the flat advantages of `groups` (in order, as `as_samples` lays them out) normalised over each
    step's samples — `groups_per_step` groups a step, or all of them in one (dynamic steps)."""
    out = np.asarray(advantages, np.float64).copy()
    per_step = groups_per_step or max(len(groups), 1)
    at = 0
    for s in range(0, len(groups), per_step):
        n = sum(len(g) for g in groups[s:s + per_step])
        a = out[at:at + n]
        out[at:at + n] = (a - a.mean()) / (_std(a, std) + ADV_EPS)
        at += n
    return out.astype(np.float32)


def split_into_steps(
    groups: list[SampleGroup],
    *,
    policy: str,
    groups_per_step: int | None,
    dp_size: int,
    micro_batch_size: int | None = None,
    microbatch_multiple: int = 1,
) -> tuple[list[SampleGroup], list[SampleGroup]]:
    """(groups that form this rollout's steps, groups carried into the next rollout), order kept.

    fixed: as many whole steps of `groups_per_step` groups as there are; the rest is carried. dynamic: all groups
    form one step, or, when the scheduler could not plan that step, all are carried: fewer than `dp_size` samples
    (every rank needs one) or, with static micro-batches (`micro_batch_size`), fewer samples than the aligned
    micro-batch count (`trainingrun.schedule.step_fits`).
    A fixed step the scheduler cannot plan is a ConfigError (globalBatchSize too small for the ranks/micro-batches).
    """
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


def as_samples(groups: list[SampleGroup]) -> Samples:
    """The groups' samples as one flat batch, in group order (what `published.build_published` schedules): every
    field of the table (`contract.fields.concat`), an optional one only when every group has it."""
    samples = Samples(group_ids=[g.group_id for g in groups for _ in range(len(g))])
    samples.values.update(concat(groups))
    return samples


def mask_stale_tokens(groups: list[SampleGroup], bound: int) -> int:
    """Partial rollouts with `rollout.staleTokens: mask`: tokens generated with a weight version older than `bound`
    are no training targets (their loss mask is cleared; they stay as context). Returns the tokens masked."""
    masked = 0
    for g in groups:
        if g.token_versions is None:
            continue
        for i, (mask, versions) in enumerate(zip(g.loss_masks, g.token_versions)):
            stale = (versions >= 0) & (versions < bound) & (mask > 0)
            if stale.any():
                masked += int(stale.sum())
                g.loss_masks[i] = np.where(stale, 0, mask).astype(np.uint8)
    return masked
