"""The variable-global-batch loss: per-token losses, the contract's normalisation, and the factor Megatron needs.

Contract (design.md, "Loss scaling"), for step s with GBS_s samples and T_s loss tokens (both from the schedule):
  sample:  J_s = (1/GBS_s) · Σ_{i in s} mean_{t in loss tokens of i} ℓ_{i,t}      (a sample without loss tokens adds 0)
  token:   J_s = (1/T_s)   · Σ_{i in s} Σ_t ℓ_{i,t}
with ℓ_{i,t} = −log p(x_t | x_<t)            (loss type `sft`, masked cross-entropy)
     ℓ_{i,t} = −A_i · log p(x_t | x_<t)      (loss type `policy_gradient`, A_i the sample's advantage)
     ℓ_{i,t} = max(−A_i·r_t, −A_i·clip(r_t, 1 − ε_low, 1 + ε_high)) + β·k3_t     (loss type `ppo`)
           r_t = exp(log π(x_t) − log π_gen(x_t)): the importance ratio against the generator's log-probability
           (the old policy), log π of softmax(logits / temperature) as the generator sampled;
           k3_t = exp(q_t) − q_t − 1 with q_t = log π_ref(x_t) − log π(x_t): the KL to the initial policy (β > 0 only).

Both are a weighted sum over this rank's tokens with weights w_{i,t} = 1/(GBS_s·n_i) or 1/T_s, so every rank and every
micro-batch computes its own part J_{r,m} = Σ_{t in (r,m)} w_t ℓ_t and J_s = Σ_r Σ_m J_{r,m} exactly.

Megatron then (megatron-core 0.16.1, two-value loss return, `calculate_per_token_loss=False`):
  * `forward_step_calc_loss` divides the returned loss by num_microbatches M (and multiplies by the CP size, 1 here);
  * DDP (`average_in_collective=False`) pre-scales each gradient by 1/D before the all-reduce SUM over the D ranks.
So the gradient after the step is (1/D)·Σ_r Σ_m ∇(returned_{r,m}/M). Returning returned_{r,m} = D·M·J_{r,m} makes it
Σ_r Σ_m ∇J_{r,m} = ∇J_s: `megatron_loss_factor(D, M) = D·M`. Derivation in docs/trainer.md.

Mixtures of experts add the per-sample load-balancing loss aux_j (`modeling.moe`) with the same normalisation:
  A_s = c · (1/GBS_s) · Σ_{i in s} aux_i   (sample)      A_s = c · (1/T_s) · Σ_i n_i · aux_i   (token; n_i loss tokens)
(c = `LossSettings.moe_aux_coeff`); `sample_weights` gives each sample's weight, the router attaches c·w_i·aux_i
times the same Megatron factor D·M, so the gradient after the step is ∇(J_s + A_s) (docs/trainer.md, "MoE loss
scaling").

The run's choices travel as one frozen `LossSettings` (loss type, normalisation, `PolicySettings`; resolved once from
the spec by `loss_settings`), each step's denominators GBS_s and T_s as `StepTotals`.

`loss_mask[t] = 1` marks token t as a trained target: it is predicted from the logits at t−1 of the same sample, so
the first token of a sample is never a target (its mask is ignored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("sft", "policy_gradient", "ppo")
NORMALIZATIONS = ("sample", "token")

# Names of the per-rank (sum, count) statistics a micro-batch reports, in all-reduce order (see metrics.reduce).
# Those after sample_tokens need the generator's log-probabilities (generated rollouts); otherwise their count is 0.
STAT_NAMES = ("objective", "sample_loss", "token_loss", "sample_reward", "sample_tokens", "sample_reward_sq",
              "logprob_abs_diff", "importance_ratio", "clip_fraction", "approx_kl", "entropy", "kl_ref",
              "response_length")


@dataclass(frozen=True)
class PolicySettings:
    """What the generated-rollout statistics and the `ppo` objective need (`spec.trainer.policyLoss`, sampling).
    New policy-loss options of the spec become fields here (with the spec's default), read in `loss_settings`."""

    temperature: float = 1.0  # the generator's sampling temperature (0 = greedy: log-probabilities at 1)
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0

    @property
    def logit_scale(self) -> float:
        return 1.0 / self.temperature if self.temperature > 0 else 1.0


@dataclass(frozen=True)
class LossSettings:
    """How every step of the run computes its loss: the loss type, the contract's normalisation, and for generated
    rollouts the policy settings (None for replayed rollouts: the defaults of `PolicySettings` apply). Resolved once
    from the spec (`loss_settings`); ValueError naming the field for a value the loss does not know."""

    loss_type: str = "sft"
    normalization: str = "sample"
    policy: PolicySettings | None = None
    moe_aux_coeff: float = 0.0  # mixtures of experts: the per-sample load-balancing loss's coefficient c

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type: {self.loss_type!r} is not one of {LOSS_TYPES}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"lossNormalization: {self.normalization!r} is not one of {NORMALIZATIONS}")


@dataclass(frozen=True)
class StepTotals:
    """The step's denominators, from the schedule (the rollout side knows them: no all-reduce): GBS_s samples and
    T_s loss tokens."""

    global_batch_size: int
    loss_tokens: int


def loss_settings(spec) -> LossSettings:
    """The run's `LossSettings`: `spec.trainer.lossType`, `lossNormalization` and — generated rollouts only —
    `trainer.policyLoss` with the sampling temperature."""
    t = spec.trainer
    gen = spec.rollout.source.generate
    policy = None
    if spec.rollout.source.type == "generate" and gen is not None:
        pl = t.policy_loss
        policy = PolicySettings(temperature=gen.sampling.temperature, clip_low=pl.clip_low, clip_high=pl.clip_high,
                                kl_coef=pl.kl_coef)
    return LossSettings(loss_type=t.loss_type, normalization=t.loss_normalization, policy=policy)


def sample_weights(inputs: LossInputs, loss: LossSettings, totals: StepTotals) -> torch.Tensor:
    """[n] float32: the weight of each sample of a micro-batch in the step's objective — 1/GBS_s (sample
    normalisation), or its loss tokens / T_s (token) — the weights a per-sample term (the MoE balance loss) takes to
    be normalised as the loss is."""
    n = inputs.num_samples
    if loss.normalization == "sample":
        return torch.full((n,), 1.0 / totals.global_batch_size, dtype=torch.float32, device=inputs.lengths.device)
    counts = torch.zeros(n, dtype=torch.float32, device=inputs.target_mask.device)
    if n:
        counts.index_add_(0, inputs.sample_of, inputs.target_mask.float())
    return counts / max(int(totals.loss_tokens), 1)


def token_nll(logits: torch.Tensor, tokens: torch.Tensor, vocab_parallel: bool = False) -> torch.Tensor:
    """−log p(tokens[t] | logits[t−1]) for t ≥ 1, 0 at t = 0, in float32. logits [T, V], tokens [T].

    `vocab_parallel=True`: `logits` is this tensor-parallel rank's vocabulary slice [T, V/tp] (Megatron's
    `parallel_output`), and the log-softmax is taken over the whole vocabulary with Megatron's
    `vocab_parallel_cross_entropy` (max and sum-exp all-reduced over the TP group; its backward gives each rank the
    gradient of its slice). With TP 1 it equals the plain form. It works in place on a float32 `logits` (as Megatron's
    own loss does): compute it once per forward and do not read the logits afterwards."""
    if vocab_parallel:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # deferred: megatron

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
    old_logprobs [T]: the generator's log-probability of each token (generated rollouts; None otherwise).
    """

    tokens: torch.Tensor
    target_mask: torch.Tensor
    sample_of: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    lengths: torch.Tensor
    old_logprobs: torch.Tensor | None = None

    @property
    def num_samples(self) -> int:
        return int(self.lengths.numel())


def micro_batch_objective(
    logits: torch.Tensor,
    inputs: LossInputs,
    loss: LossSettings,
    totals: StepTotals,
    *,
    vocab_parallel: bool = False,
    ref_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This micro-batch's part J_{r,m} of the contract objective (`loss`, with the step's denominators `totals`),
    and its statistics. `vocab_parallel`: logits are this TP rank's vocabulary slice (see `token_nll`).

    Returns (objective, stats) where stats is a float64 tensor [len(STAT_NAMES), 2] of (sum, count) pairs, detached.
    `ref_logits`: the initial policy's logits (ppo with kl_coef > 0).
    """
    loss_type, normalization = loss.loss_type, loss.normalization
    global_batch_size, loss_tokens = totals.global_batch_size, totals.loss_tokens
    n = inputs.num_samples
    stats = torch.zeros(len(STAT_NAMES), 2, dtype=torch.float64)
    if n == 0:  # empty micro-batch: zero contribution, but keep the graph connected for Megatron's backward
        return logits.float().sum() * 0.0, stats
    mask = inputs.target_mask.float()
    policy = loss.policy or PolicySettings()
    gen = None
    if inputs.old_logprobs is not None:
        gen = _policy_terms(logits, inputs, mask, policy, ref_logits)
    elif loss_type == "ppo":
        raise ValueError("loss_type ppo: the payload has no generator log-probabilities (generated rollouts only)")
    if loss_type == "ppo":
        per_token = gen["ppo"]
    else:
        nll = token_nll(logits, inputs.tokens, vocab_parallel=vocab_parallel)
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
        stats[5] = torch.tensor([float((inputs.rewards.double() ** 2).sum()), float(n)])
        if gen is not None:
            for name in ("logprob_abs_diff", "importance_ratio", "clip_fraction", "approx_kl", "entropy", "kl_ref"):
                if name == "kl_ref" and ref_logits is None:
                    continue
                stats[STAT_NAMES.index(name)] = torch.tensor([float((gen[name] * mask).sum()), count_tokens])
            stats[STAT_NAMES.index("response_length")] = torch.tensor([float(tokens_per_sample.sum()), float(n)])
    return objective, stats


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(tokens[t] | logits[t−1]) for t ≥ 1 with 0 at t = 0, the full log-softmax [T−1, V]) of
    softmax(logits · scale), in float32."""
    logp_all = torch.log_softmax(logits.float() * scale, dim=-1)[:-1]
    picked = logp_all.gather(-1, tokens[1:].long().unsqueeze(-1)).squeeze(-1)
    return torch.cat([picked.new_zeros(1), picked]), logp_all


def _policy_terms(logits, inputs: LossInputs, mask, policy: PolicySettings, ref_logits) -> dict[str, torch.Tensor]:
    """Per-token tensors [T] of the clipped objective and its statistics (see the module docstring)."""
    logp, logp_all = token_logprobs(logits, inputs.tokens, policy.logit_scale)
    old = inputs.old_logprobs.float()
    log_ratio = torch.where(mask > 0, logp - old, 0.0)
    ratio = torch.exp(log_ratio)
    adv = inputs.advantages.float()[inputs.sample_of]
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - policy.clip_low, 1.0 + policy.clip_high)
    ppo = torch.maximum(unclipped, clipped)
    out = {"ppo": ppo}
    with torch.no_grad():
        ent = -(logp_all.exp() * logp_all).sum(-1)
        out["entropy"] = torch.cat([ent.new_zeros(1), ent])
        out["logprob_abs_diff"] = (logp - old).abs().detach()
        out["importance_ratio"] = ratio.detach()
        out["clip_fraction"] = (clipped > unclipped).float()
        neg = -log_ratio.detach()  # log pi_old - log pi
        out["approx_kl"] = torch.exp(neg) - neg - 1.0
    if ref_logits is not None:
        with torch.no_grad():
            ref_logp, _ = token_logprobs(ref_logits, inputs.tokens, policy.logit_scale)
        q = torch.where(mask > 0, ref_logp - logp, 0.0)
        k3 = torch.exp(q) - q - 1.0
        out["ppo"] = ppo + policy.kl_coef * k3
        out["kl_ref"] = k3.detach()
    return out


def megatron_loss_factor(dp_size: int, num_microbatches: int) -> float:
    """Factor on J_{r,m} so Megatron's 1/M (schedule) and 1/D (DDP) leave the gradient of J_s (see module doc)."""
    return float(dp_size * num_microbatches)
