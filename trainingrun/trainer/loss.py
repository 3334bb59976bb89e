"""The variable-global-batch loss: per-token losses, the contract's normalisation, and the factor Megatron needs.

Contract (design.md, "Loss scaling"), for step s with GBS_s samples and T_s loss tokens (both from the schedule):
  sample:  J_s = (1/GBS_s) · Σ_{i in s} mean_{t in loss tokens of i} ℓ_{i,t}      (a sample without loss tokens adds 0)
  token:   J_s = (1/T_s)   · Σ_{i in s} Σ_t ℓ_{i,t}
with ℓ_{i,t} = −log p(x_t | x_<t)            (loss type `sft`, masked cross-entropy)
     ℓ_{i,t} = −A_i · log p(x_t | x_<t)      (loss type `policy_gradient`, A_i the sample's advantage).

Both are a weighted sum over this rank's tokens with weights w_{i,t} = 1/(GBS_s·n_i) or 1/T_s, so every rank and every
micro-batch computes its own part J_{r,m} = Σ_{t in (r,m)} w_t ℓ_t and J_s = Σ_r Σ_m J_{r,m} exactly.

Megatron then (megatron-core 0.16.1, two-value loss return, `calculate_per_token_loss=False`):
  * `forward_step_calc_loss` divides the returned loss by num_microbatches M (and multiplies by the CP size, 1 here);
  * DDP (`average_in_collective=False`) pre-scales each gradient by 1/D before the all-reduce SUM over the D ranks.
So the gradient after the step is (1/D)·Σ_r Σ_m ∇(returned_{r,m}/M). Returning returned_{r,m} = D·M·J_{r,m} makes it
Σ_r Σ_m ∇J_{r,m} = ∇J_s: `megatron_loss_factor(D, M) = D·M`. Derivation in docs/trainer.md.

`loss_mask[t] = 1` marks token t as a trained target: it is predicted from the logits at t−1 of the same sample, so
the first token of a sample is never a target (its mask is ignored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("sft", "policy_gradient")
NORMALIZATIONS = ("sample", "token")

# Names of the per-rank (sum, count) statistics a micro-batch reports, in all-reduce order (see metrics.reduce).
STAT_NAMES = ("objective", "sample_loss", "token_loss", "sample_reward", "sample_tokens")


def token_nll(logits: torch.Tensor, tokens: torch.Tensor, vocab_parallel: bool = False) -> torch.Tensor:
    """−log p(tokens[t] | logits[t−1]) for t ≥ 1, 0 at t = 0, in float32. logits [T, V], tokens [T].

    `vocab_parallel=True`: `logits` is this tensor-parallel rank's vocabulary slice [T, V/tp] (Megatron's
    `parallel_output`), and the log-softmax is taken over the whole vocabulary with Megatron's
    `vocab_parallel_cross_entropy` (max and sum-exp all-reduced over the TP group; its backward gives each rank the
    gradient of its slice). With TP 1 it equals the plain form. It works in place on a float32 `logits` (as Megatron's
    own loss does): compute it once per forward and do not read the logits afterwards."""
    if vocab_parallel:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        # position t predicts token t+1; the last position has no target (a dummy 0, dropped)
        target = torch.cat([tokens[1:], tokens.new_zeros(1)]).long()
        nll = vocab_parallel_cross_entropy(logits.float(), target)
        return torch.cat([nll.new_zeros(1), nll[:-1]])
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp[:-1].gather(-1, tokens[1:].long().unsqueeze(-1)).squeeze(-1)
    return torch.cat([picked.new_zeros(1), -picked])


@dataclass
class LossInputs:
    """What the loss needs for one packed micro-batch (all tensors on the model's device).

    tokens [T], target_mask [T] float (loss_mask with each sample's first token cleared), sample_of [T] long (index of
    the token's sample in this micro-batch), advantages [n], rewards [n], lengths [n]; n may be 0 (empty micro-batch).
    """

    tokens: torch.Tensor
    target_mask: torch.Tensor
    sample_of: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    lengths: torch.Tensor

    @property
    def num_samples(self) -> int:
        return int(self.lengths.numel())


def micro_batch_objective(
    logits: torch.Tensor,
    inputs: LossInputs,
    *,
    loss_type: str,
    normalization: str,
    global_batch_size: int,
    loss_tokens: int,
    vocab_parallel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This micro-batch's part J_{r,m} of the contract objective, and its statistics. `vocab_parallel`: logits are
    this TP rank's vocabulary slice (see `token_nll`).

    Returns (objective, stats) where stats is a float64 tensor [len(STAT_NAMES), 2] of (sum, count) pairs, detached.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type: {loss_type!r} is not one of {LOSS_TYPES}")
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"lossNormalization: {normalization!r} is not one of {NORMALIZATIONS}")
    n = inputs.num_samples
    stats = torch.zeros(len(STAT_NAMES), 2, dtype=torch.float64)
    if n == 0:  # empty micro-batch: zero contribution, but keep the graph connected for Megatron's backward
        return logits.float().sum() * 0.0, stats
    nll = token_nll(logits, inputs.tokens, vocab_parallel=vocab_parallel)
    mask = inputs.target_mask.float()
    per_token = nll if loss_type == "sft" else nll * inputs.advantages.float()[inputs.sample_of]
    masked = per_token * mask
    tokens_per_sample = torch.zeros(n, dtype=torch.float32, device=mask.device).index_add_(0, inputs.sample_of, mask)
    loss_per_sample = torch.zeros(n, dtype=masked.dtype, device=mask.device).index_add_(0, inputs.sample_of, masked)
    has_tokens = tokens_per_sample > 0
    sample_mean = torch.where(has_tokens, loss_per_sample / tokens_per_sample.clamp(min=1.0), 0.0)
    if normalization == "sample":
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size: must be > 0 for lossNormalization sample, got {global_batch_size}")
        objective = sample_mean.sum() / global_batch_size
    else:
        objective = masked.sum() / max(int(loss_tokens), 1)

    with torch.no_grad():
        count_tokens = float(mask.sum())
        stats[0] = torch.tensor([float(objective), float(n)])
        stats[1] = torch.tensor([float(sample_mean.sum()), float(n)])
        stats[2] = torch.tensor([float(masked.sum()), count_tokens])
        stats[3] = torch.tensor([float(inputs.rewards.double().sum()), float(n)])
        stats[4] = torch.tensor([float(inputs.lengths.double().sum()), float(n)])
    return objective, stats


def megatron_loss_factor(dp_size: int, num_microbatches: int) -> float:
    """Factor on J_{r,m} so Megatron's 1/M (schedule) and 1/D (DDP) leave the gradient of J_s (see module doc)."""
    return float(dp_size * num_microbatches)
