"""The variable-global-batch loss: per-token losses, the contract's normalisation, and the factor Megatron needs.

Contract (design.md, "Loss scaling"), for step s with GBS_s samples and T_s loss tokens (both from the schedule):
  sample:  J_s = (1/GBS_s) · Σ_{i in s} mean_{t in loss tokens of i} ℓ_{i,t}      (a sample without loss tokens adds 0)
  token:   J_s = (1/T_s)   · Σ_{i in s} Σ_t ℓ_{i,t}
with ℓ_{i,t} = −log p(x_t | x_<t)                  (loss type `sft`, masked cross-entropy, at temperature 1)
     ℓ_{i,t} = w_{i,t} · (−A_i · log π(x_t)) − c_H · H_t                           (loss type `policy_gradient`)
     ℓ_{i,t} = w_{i,t} · (max(−A_i·r, −A_i·clip(r, 1 − ε_low, 1 + ε_high)) + β·k3_t) − c_H · H_t    (`ppo`)
  π is softmax(logits / temperature), as the generator sampled; H_t its entropy, c_H `entropyCoef` (the entropy
  bonus);
  r = π(x_t)/π_old(x_t) (`ratioLevel: token`) or the sample's length-normalised sequence ratio
      exp(mean_t log(π/π_old)) (`sequence`, GSPO), log-ratios clamped to ±LOG_RATIO_CLAMP before exp;
      with `clipRatioC` c (dual clip, default 3) the term of a negative advantage is at most −A_i·c;
  π_old = the engine's log-probability (`oldLogprobs: engine`) or the trainer's own, recomputed by a forward-only
      pass before the rollout's first update (`oldLogprobs: trainer`, `trainer/step.py`);
  k3_t = exp(q) − q − 1, q = log π_ref(x_t) − log π(x_t): the KL to the initial policy (β = klCoef > 0 only);
  w_{i,t} the rollout correction (`rolloutCorrection`, detached): with ρ = π_old/π_engine per token, or at
      `level: sequence` the sample's geometric mean exp(mean_t log ρ), `tis` w = min(ρ, threshold), `mask`
      w = 1 if lowerThreshold ≤ ρ ≤ threshold else 0; `none` w = 1. With `oldLogprobs: engine`, π_old of `ppo` is
      the engine's (ρ ≡ 1: the spec refuses a correction there) and for `policy_gradient`, whose objective has no
      π_old, ρ = sg(π)/π_engine with π the weights before this step's update. A masked token leaves the numerator
      only: GBS_s, T_s and each sample's n_i stay the schedule's.

Both are a weighted sum over this rank's tokens with weights w_{i,t} = 1/(GBS_s·n_i) or 1/T_s, so every rank and every
micro-batch computes its own part J_{r,m} = Σ_{t in (r,m)} w_t ℓ_t and J_s = Σ_r Σ_m J_{r,m} exactly.

Megatron then (megatron-core 0.16.1, two-value loss return, `calculate_per_token_loss=False`):
  * `forward_step_calc_loss` divides the returned loss by num_microbatches M (and multiplies by the CP size, 1 here);
  * DDP (`average_in_collective=False`) pre-scales each gradient by 1/D before the all-reduce SUM over the D ranks.
So the gradient after the step is (1/D)·Σ_r Σ_m ∇(returned_{r,m}/M). Returning returned_{r,m} = D·M·J_{r,m} makes it
Σ_r Σ_m ∇J_{r,m} = ∇J_s: `megatron_loss_factor(D, M) = D·M`. Derivation in docs/trainer.md.

log π and H are computed in ONE place for every loss type, `token_logprobs`: from the logits of this rank's
vocabulary slice (Megatron's `parallel_output`, V/tp columns) as Megatron's vocab-parallel cross-entropy does it —
the max, Σexp and Σexp·z all-reduced over the tensor-parallel group, each rank's gradient that of its own slice —
and in chunks of rows, so the loss never holds more than a few [chunk, V/tp] float32 temporaries besides its input:
peak memory O(T + chunk·V) (benchmarks/loss_memory.py).

Mixtures of experts add the per-sample load-balancing loss aux_j (`modeling.moe`) with the same normalisation:
  A_s = c · (1/GBS_s) · Σ_{i in s} aux_i   (sample)      A_s = c · (1/T_s) · Σ_i n_i · aux_i   (token; n_i loss tokens)
(c = `LossSettings.moe_aux_coeff`); `sample_weights` gives each sample's weight, the router attaches c·w_i·aux_i
times the same Megatron factor D·M, so the gradient after the step is ∇(J_s + A_s) (docs/trainer.md, "MoE loss
scaling").

The run's choices travel as one frozen `LossSettings` (loss type, normalisation, `PolicySettings`; resolved once from
the spec by `loss_settings`), each step's denominators GBS_s and T_s as `StepTotals`. New terms (an MoE router
loss, ...) join `micro_batch_objective` through the settings. The loss types are one table, `LOSS_KINDS`: each entry
its per-token ℓ_t and what it needs (a policy loss: the policy terms above; a ratio π/π_old; a reference model;
generated rollouts only) — a new loss type is one entry, its value in the spec's `LossType` and its docs.

`loss_mask[t] = 1` marks token t as a trained target: it is predicted from the logits at t−1 of the same sample, so
the first token of a sample is never a target (its mask is ignored).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import get_args

import torch
import torch.distributed as dist

from trainingrun.api.spec.trainer import CorrectionType, Level, LossNormalization, LossType, OldLogprobs

# the spec's enums (`trainingrun.api.models`); the loss types' table is `LOSS_KINDS` (below)
LOSS_TYPES = get_args(LossType)
NORMALIZATIONS = get_args(LossNormalization)
OLD_LOGPROBS = get_args(OldLogprobs)
CORRECTION_TYPES = get_args(CorrectionType)
LEVELS = get_args(Level)

# log-ratios are clamped to ±20 before exp: a far-off token (log-ratio 100) gives a ratio of e^20, never inf/NaN
LOG_RATIO_CLAMP = 20.0
# rows per chunk of `token_logprobs`: as many as keep one [rows, V/tp] float32 temporary at this many elements
LOSS_CHUNK_ELEMENTS = 1 << 24

# Names of the per-rank (sum, count) statistics a micro-batch reports, in all-reduce order (see metrics.reduce).
# Those after sample_tokens need the generator's log-probabilities (generated rollouts); otherwise their count is 0.
# MAX_STATS hold (max, count) instead: reduced by max over micro-batches and ranks (`merge_stats`).
STAT_NAMES = ("objective", "sample_loss", "token_loss", "sample_reward", "sample_tokens", "sample_reward_sq",
              "logprob_abs_diff", "importance_ratio", "clip_fraction", "dual_clip_fraction", "approx_kl", "entropy",
              "kl_ref",
              "response_length", "mismatch_kl", "correction_weight", "masked_fraction", "seq_clip_fraction",
              "entropy_bonus", "correction_weight_max")
MAX_STATS = ("correction_weight_max",)


@dataclass(frozen=True)
class RolloutCorrection:
    """`trainer.policyLoss.rolloutCorrection`: the train–inference mismatch correction (module docstring)."""

    type: str = "none"
    level: str = "token"
    threshold: float = 2.0
    lower_threshold: float | None = None  # mask only; None: 1/threshold

    def __post_init__(self) -> None:
        if self.type not in CORRECTION_TYPES:
            raise ValueError(f"policyLoss.rolloutCorrection.type: {self.type!r} is not one of {CORRECTION_TYPES}")
        if self.level not in LEVELS:
            raise ValueError(f"policyLoss.rolloutCorrection.level: {self.level!r} is not one of {LEVELS}")
        if not self.threshold > 0 or not self.lower < self.threshold:
            raise ValueError(f"policyLoss.rolloutCorrection: need 0 <= lowerThreshold < threshold, got "
                             f"{self.lower} and {self.threshold}")

    @property
    def lower(self) -> float:
        return 1.0 / self.threshold if self.lower_threshold is None else self.lower_threshold


@dataclass(frozen=True)
class PolicySettings:
    """What the generated-rollout statistics and the policy objectives need (`spec.trainer.policyLoss`, sampling).
    New policy-loss options of the spec become fields here (with the spec's default), read in `loss_settings`."""

    temperature: float = 1.0  # the generator's sampling temperature (0 = greedy: log-probabilities at 1)
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    old_logprobs: str = "engine"
    correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    ratio_level: str = "token"
    clip_ratio_c: float | None = 3.0  # dual clip (negative advantages); None: off (the spec has no off)
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"policyLoss.oldLogprobs: {self.old_logprobs!r} is not one of {OLD_LOGPROBS}")
        if self.ratio_level not in LEVELS:
            raise ValueError(f"policyLoss.ratioLevel: {self.ratio_level!r} is not one of {LEVELS}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(f"policyLoss.clipRatioC: must be > 1 (or unset), got {self.clip_ratio_c}")

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

    @property
    def kind(self) -> LossKind:
        """The loss type's entry of `LOSS_KINDS`."""
        return LOSS_KINDS[self.loss_type]

    @property
    def recomputes_old_logprobs(self) -> bool:
        """The trainer runs the forward-only π_old pass before a rollout's first update (`oldLogprobs: trainer`)."""
        return self.policy is not None and self.policy.old_logprobs == "trainer" and self.kind.policy


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
        rc = pl.rollout_correction
        policy = PolicySettings(
            temperature=gen.sampling.temperature, clip_low=pl.clip_low, clip_high=pl.clip_high, kl_coef=pl.kl_coef,
            old_logprobs=pl.old_logprobs, ratio_level=pl.ratio_level, clip_ratio_c=pl.clip_ratio_c,
            entropy_coef=pl.entropy_coef,
            correction=RolloutCorrection(type=rc.type, level=rc.level, threshold=rc.threshold,
                                         lower_threshold=rc.lower_threshold))
    return LossSettings(loss_type=t.loss_type, normalization=t.loss_normalization, policy=policy)


# ------------------------------------------------------------------------------------------ log π and entropy
def _tp(group) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel group (None or a group of one: (0, 1))."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


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


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """float32 for half/float32 logits (as Megatron's cross-entropy), float64 for float64 ones (reference checks)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


class _TokenLogProbs(torch.autograd.Function):
    """Rows of vocabulary-parallel logits z [R, V/tp] → (log softmax(s·z)[target], entropy of softmax(s·z)) per row.

    Forward per chunk of rows, u = s·z in float32: m = max u, S = Σ exp(u − m), A = Σ exp(u − m)·u, and u[target]
    on the rank whose slice holds the target — max all-reduced (MAX) and then (S, A, u[target]) in one all-reduce
    (SUM) over the tensor-parallel group; log π = u[target] − m − log S, H = m + log S − A/S. Saved: z and the
    per-row (m + log S, A/S). Backward per chunk (no collective: every term is local to the slice), with p = π(·):
        ∂log π/∂u = onehot(target) − p,   ∂H/∂u = −p·(u − A/S),   ∂/∂z = s·∂/∂u
    written into a new tensor or, with `overwrite`, into z itself (as Megatron's cross-entropy does: the caller
    never reads the logits afterwards)."""

    @staticmethod
    def forward(ctx, logits, target, scale, group, chunk, with_entropy, overwrite):
        rank, size = _tp(group)
        rows, vocab = logits.shape
        start = rank * vocab
        dev, dtype = logits.device, _compute_dtype(logits)
        logp = torch.empty(rows, dtype=dtype, device=dev)
        lse = torch.empty(rows, dtype=dtype, device=dev)
        mean_u = torch.empty(rows, dtype=dtype, device=dev) if with_entropy else None
        for a in range(0, rows, chunk):
            b = min(rows, a + chunk)
            u = logits[a:b].to(dtype) * scale  # a new [chunk, V/tp] float32 tensor
            m = u.max(dim=-1).values
            if size > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            local = target[a:b] - start
            inside = (local >= 0) & (local < vocab)
            picked = u.gather(-1, local.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1) * inside
            e = torch.exp(u - m.unsqueeze(-1))
            parts = [e.sum(-1), picked]
            if with_entropy:
                parts.append(e.mul_(u).sum(-1))
            del e
            sums = torch.stack(parts)
            if size > 1:
                dist.all_reduce(sums, group=group)
            lse[a:b] = m + torch.log(sums[0])
            logp[a:b] = sums[1] - lse[a:b]
            if with_entropy:
                mean_u[a:b] = sums[2] / sums[0]
        ctx.scale, ctx.chunk, ctx.start, ctx.overwrite = scale, chunk, start, overwrite
        ctx.with_entropy = with_entropy
        ctx.save_for_backward(logits, target, lse, *([mean_u] if with_entropy else []))
        if not with_entropy:
            ent = torch.zeros_like(lse)
            ctx.mark_non_differentiable(ent)
            return logp, ent
        return logp, lse - mean_u

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, target, lse, *rest = ctx.saved_tensors
        mean_u = rest[0] if ctx.with_entropy else None
        rows, vocab = logits.shape
        grad = logits if ctx.overwrite else torch.empty_like(logits)
        for a in range(0, rows, ctx.chunk):
            b = min(rows, a + ctx.chunk)
            u = logits[a:b].to(lse.dtype) * ctx.scale
            p = torch.exp(u - lse[a:b].unsqueeze(-1))
            gl = g_logp[a:b].to(lse.dtype).unsqueeze(-1)
            if mean_u is not None:
                # −g_logp·p − g_ent·p·(u − ū), as p·w with w computed in place of u
                w = u.sub_(mean_u[a:b].unsqueeze(-1)).mul_(-g_ent[a:b].to(lse.dtype).unsqueeze(-1)).sub_(gl)
                p.mul_(w)
            else:
                p.mul_(-gl)
            local = target[a:b] - ctx.start
            inside = (local >= 0) & (local < vocab)
            p.scatter_add_(-1, local.clamp(0, vocab - 1).unsqueeze(-1), (gl.squeeze(-1) * inside).unsqueeze(-1))
            grad[a:b] = (p.mul_(ctx.scale)).to(grad.dtype)
        return grad, None, None, None, None, None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, scale: float = 1.0, *, tp_group=None,
                   entropy: bool = False, overwrite: bool = False,
                   chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(tokens[t] | logits[t−1]) for t ≥ 1 with 0 at t = 0, [T] float32; the entropy of the distribution
    that predicts token t, likewise [T], or None without `entropy`) of softmax(logits · scale).

    logits [T, V/tp]: this tensor-parallel rank's vocabulary slice (`tp_group`: the TP group, None for TP 1) — THE
    place every loss type and every statistic takes log π and H from (see `_TokenLogProbs`). Differentiable in both
    outputs. `chunk_rows`: rows per chunk (default: LOSS_CHUNK_ELEMENTS / (V/tp)). `overwrite`: the backward writes
    the gradient into `logits` (the caller must not read them after the backward)."""
    rows, vocab = logits.shape
    chunk = chunk_rows or max(1, LOSS_CHUNK_ELEMENTS // max(vocab, 1))
    # row t predicts token t+1; the last row has no target (a dummy 0, dropped)
    target = torch.cat([tokens[1:], tokens.new_zeros(1)]).long()
    logp, ent = _TokenLogProbs.apply(logits, target, float(scale), tp_group, int(chunk), bool(entropy),
                                     bool(overwrite))
    zero = logp.new_zeros(1)
    return torch.cat([zero, logp[:-1]]), (torch.cat([zero, ent[:-1]]) if entropy else None)


# ------------------------------------------------------------------------------------------------ the objective
@dataclass
class LossInputs:
    """What the loss needs for one packed micro-batch (all tensors on the model's device).

    tokens [T], target_mask [T] float (loss_mask with each sample's first token cleared), sample_of [T] long (index of
    the token's sample in this micro-batch), advantages [n], rewards [n], lengths [n]; n may be 0 (empty micro-batch).
    engine_logprobs [T]: the generator's log-probability of each token (generated rollouts; None otherwise).
    old_logprobs [T]: π_old recomputed by the trainer (`oldLogprobs: trainer`; None otherwise).
    """

    tokens: torch.Tensor
    target_mask: torch.Tensor
    sample_of: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    lengths: torch.Tensor
    engine_logprobs: torch.Tensor | None = None
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
    tp_group=None,
    ref_logits: torch.Tensor | None = None,
    overwrite_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This micro-batch's part J_{r,m} of the contract objective (`loss`, with the step's denominators `totals`),
    and its statistics. logits [T, V/tp]: this TP rank's vocabulary slice (`tp_group`: the TP group; None at TP 1).

    Returns (objective, stats) where stats is a float64 tensor [len(STAT_NAMES), 2] of (sum, count) pairs
    ((max, count) for MAX_STATS), detached. `ref_logits`: the initial policy's logits (ppo with kl_coef > 0).
    `overwrite_logits`: the backward may write the gradient into `logits` (see `token_logprobs`).
    """
    kind, normalization = loss.kind, loss.normalization
    n = inputs.num_samples
    stats = torch.zeros(len(STAT_NAMES), 2, dtype=torch.float64)
    if n == 0:  # empty micro-batch: zero contribution, but keep the graph connected for Megatron's backward
        return logits.sum() * 0.0, stats
    generated = inputs.engine_logprobs is not None
    if kind.generated_only and not generated:
        raise ValueError(f"loss_type {loss.loss_type}: the payload has no generator log-probabilities (generated "
                         "rollouts only)")
    policy = loss.policy or PolicySettings()
    mask = inputs.target_mask.float()
    scale = policy.logit_scale if kind.policy else 1.0
    entropy_grad = kind.policy and policy.entropy_coef > 0
    logp, ent = token_logprobs(logits, inputs.tokens, scale, tp_group=tp_group, entropy=generated or entropy_grad,
                               overwrite=overwrite_logits)
    tokens_per_sample = torch.zeros(n, dtype=torch.float32, device=mask.device).index_add_(0, inputs.sample_of, mask)
    terms: dict[str, torch.Tensor] = {}
    if generated:
        stat_logp, stat_ent = logp, ent
        if scale != policy.logit_scale:  # sft: the statistics are of the tempered policy
            with torch.no_grad():
                stat_logp, stat_ent = token_logprobs(logits.detach(), inputs.tokens, policy.logit_scale,
                                                     tp_group=tp_group, entropy=True)
        terms = _statistics(stat_logp, stat_ent, inputs, mask, tokens_per_sample, kind, policy)
    ref_logp = None
    if ref_logits is not None and kind.reference:
        with torch.no_grad():
            ref_logp, _ = token_logprobs(ref_logits, inputs.tokens, policy.logit_scale, tp_group=tp_group)
    tok = TokenTerms(logp=logp, ent=ent, inputs=inputs, mask=mask, tokens_per_sample=tokens_per_sample, kind=kind,
                     policy=policy, ref_logp=ref_logp, out=terms)
    per_token = kind.per_token(tok)
    if kind.policy:
        per_token = _policy_terms(per_token, tok)
    masked = per_token * mask
    loss_per_sample = torch.zeros(n, dtype=masked.dtype, device=mask.device).index_add_(0, inputs.sample_of, masked)
    has_tokens = tokens_per_sample > 0
    sample_mean = torch.where(has_tokens, loss_per_sample / tokens_per_sample.clamp(min=1.0), 0.0)
    if normalization == "sample":
        if totals.global_batch_size <= 0:
            raise ValueError(f"global_batch_size: must be > 0 for lossNormalization sample, got "
                             f"{totals.global_batch_size}")
        objective = sample_mean.sum() / totals.global_batch_size
    else:
        objective = masked.sum() / max(int(totals.loss_tokens), 1)

    with torch.no_grad():
        count_tokens = float(mask.sum())
        stats[0] = _pair(float(objective), float(n))
        stats[1] = _pair(float(sample_mean.sum()), float(n))
        stats[2] = _pair(float(masked.sum()), count_tokens)
        stats[3] = _pair(float(inputs.rewards.double().sum()), float(n))
        stats[4] = _pair(float(inputs.lengths.double().sum()), float(n))
        stats[5] = _pair(float((inputs.rewards.double() ** 2).sum()), float(n))
        per_sample = {"seq_clip_fraction"}
        for name, values in terms.items():
            if name in MAX_STATS:
                stats[STAT_NAMES.index(name)] = _pair(float(values), count_tokens)
            elif name in per_sample:
                counted = has_tokens.double()
                stats[STAT_NAMES.index(name)] = _pair(float((values.double() * counted).sum()), float(counted.sum()))
            else:
                stats[STAT_NAMES.index(name)] = _pair(float((values.double() * mask.double()).sum()), count_tokens)
        if generated:
            stats[STAT_NAMES.index("response_length")] = _pair(float(tokens_per_sample.sum()), float(n))
    return objective, stats


def _pair(total: float, count: float) -> torch.Tensor:
    """A (sum, count) row in float64 (a float32 tensor would round the sum)."""
    return torch.tensor([total, count], dtype=torch.float64)


def _per_sample_mean(x: torch.Tensor, inputs: LossInputs, mask: torch.Tensor,
                     tokens_per_sample: torch.Tensor) -> torch.Tensor:
    """mean over each sample's loss tokens of x [T] (0 for a sample without loss tokens), broadcast back to [T]."""
    n = tokens_per_sample.numel()
    sums = torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, inputs.sample_of, x * mask.to(x.dtype))
    return (sums / tokens_per_sample.clamp(min=1.0).to(x.dtype))[inputs.sample_of]


def _k3(log_r: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator r − 1 − log r of KL(q‖p) from log r = log p/q of a sample of q, in float64 (exact
    near r = 1: no rounding to 0 below |log r| 1e-4, never negative)."""
    x = log_r.double()
    return torch.expm1(x) - x


def _old_logprobs(inputs: LossInputs, kind: LossKind, policy: PolicySettings) -> torch.Tensor:
    """log π_old [T]: the trainer's recomputed (`oldLogprobs: trainer`, a policy loss) or the engine's."""
    if policy.old_logprobs == "trainer" and kind.policy:
        if inputs.old_logprobs is None:
            raise ValueError("policyLoss.oldLogprobs trainer: the micro-batch has no recomputed π_old (the "
                             "trainer's forward-only pass did not run)")
        return inputs.old_logprobs.float()
    return inputs.engine_logprobs.float()


def _log_ratio(logp, old, inputs: LossInputs, mask, tokens_per_sample, level: str) -> tuple[torch.Tensor, ...]:
    """(token log-ratio log π − log π_old, clamped, 0 off the loss tokens; the log-ratio at `level`: the token's, or
    its sample's mean over the loss tokens — GSPO's length-normalised sequence ratio)."""
    tok = torch.where(mask > 0, logp - old, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return tok, (_per_sample_mean(tok, inputs, mask, tokens_per_sample) if level == "sequence" else tok)


def _clipped(ratio, adv, policy: PolicySettings) -> tuple[torch.Tensor, torch.Tensor]:
    """(−A·r, −A·clip(r, 1 − clipLow, 1 + clipHigh))."""
    return -adv * ratio, -adv * torch.clamp(ratio, 1.0 - policy.clip_low, 1.0 + policy.clip_high)


def _statistics(logp, ent, inputs: LossInputs, mask, tokens_per_sample, kind: LossKind,
                policy: PolicySettings) -> dict[str, torch.Tensor]:
    """Per-token statistics of a generated rollout, before the update (no gradient): |log π_engine − log π|, the
    ratio π/π_old and its k3 KL estimate, the fractions of tokens the clip and the dual clip (a negative advantage's
    term capped at −A·clipRatioC) act on, the entropy, and the mismatch KL
    between engine and trainer (k3 of ρ = π_trainer/π_engine, π_trainer = the recomputed π_old with `oldLogprobs:
    trainer`, else π before the update); GSPO's clipped-sequence fraction (per sample) at `ratioLevel: sequence`."""
    with torch.no_grad():
        lp = logp.detach()
        eng = inputs.engine_logprobs.float()
        old = _old_logprobs(inputs, kind, policy)
        adv = inputs.advantages.float()[inputs.sample_of]
        tok, level = _log_ratio(lp, old, inputs, mask, tokens_per_sample, policy.ratio_level)
        unclipped, clipped = _clipped(torch.exp(level), adv, policy)
        is_clipped = (clipped > unclipped).float()
        dual = torch.zeros_like(is_clipped)
        if policy.clip_ratio_c is not None:
            dual = ((adv < 0) & (torch.maximum(unclipped, clipped) > -adv * policy.clip_ratio_c)).float()
        trainer_lp = old if policy.old_logprobs == "trainer" and kind.policy else lp
        mismatch = torch.where(mask > 0, trainer_lp - eng, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        out = {"logprob_abs_diff": (lp - eng).abs(), "importance_ratio": torch.exp(tok), "approx_kl": _k3(tok),
               "clip_fraction": is_clipped, "dual_clip_fraction": dual, "entropy": ent.detach(),
               "mismatch_kl": _k3(mismatch)}
        if policy.ratio_level == "sequence":
            per_sample = torch.zeros(tokens_per_sample.numel(), dtype=torch.float32, device=mask.device)
            out["seq_clip_fraction"] = per_sample.index_reduce_(0, inputs.sample_of, is_clipped, "amax",
                                                                include_self=False)
    return out


# ------------------------------------------------------------------------------------------------ the loss types
@dataclass
class TokenTerms:
    """What a loss type's per-token loss is computed from (one micro-batch): log π and H [T] (at the sampling
    temperature for a policy loss), the inputs, the target mask [T] (float), each sample's loss tokens [n], the policy
    settings, log π_ref [T] (None without a reference), and `out`, the statistics the loss adds (name → [T] values)."""

    logp: torch.Tensor
    ent: torch.Tensor | None
    inputs: LossInputs
    mask: torch.Tensor
    tokens_per_sample: torch.Tensor
    kind: LossKind
    policy: PolicySettings
    ref_logp: torch.Tensor | None
    out: dict[str, torch.Tensor]

    @property
    def advantages(self) -> torch.Tensor:
        """A_i of each token's sample [T]."""
        return self.inputs.advantages.float()[self.inputs.sample_of]


def _sft(t: TokenTerms) -> torch.Tensor:
    return -t.logp


def _policy_gradient(t: TokenTerms) -> torch.Tensor:
    return -t.advantages * t.logp


def _ppo(t: TokenTerms) -> torch.Tensor:
    policy, adv = t.policy, t.advantages
    old = _old_logprobs(t.inputs, t.kind, policy)
    _, level = _log_ratio(t.logp, old, t.inputs, t.mask, t.tokens_per_sample, policy.ratio_level)
    unclipped, clipped = _clipped(torch.exp(level), adv, policy)
    per_token = torch.maximum(unclipped, clipped)
    if policy.clip_ratio_c is not None:  # dual clip: the loss of a negative advantage is at most −A·c
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * policy.clip_ratio_c), per_token)
    if t.ref_logp is not None:
        q = torch.where(t.mask > 0, t.ref_logp - t.logp, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3 = torch.exp(q) - q - 1.0
        per_token = per_token + policy.kl_coef * k3
        t.out["kl_ref"] = k3.detach()
    return per_token


@dataclass(frozen=True)
class LossKind:
    """One loss type (`trainer.lossType`): its per-token loss ℓ_t and what it needs (module docstring)."""

    doc: str  # one line: what ℓ_t is
    per_token: Callable[[TokenTerms], torch.Tensor]  # ℓ_t [T] (before the policy terms)
    policy: bool  # a policy loss: log π at the sampling temperature, π_old recomputed with `oldLogprobs: trainer`,
    #               then the rollout correction and the entropy bonus (`_policy_terms`)
    ratio: bool = False  # the objective holds π/π_old (with `oldLogprobs: engine` the correction's π_old is then
    #                      the engine's; without, π before the update)
    reference: bool = False  # with klCoef > 0 the KL to the initial policy (the trainer keeps a reference model)
    generated_only: bool = False  # needs the generator's log-probabilities (generated rollouts)


# The loss types: a new one is one entry here, its value in `api.models.LossType` and a line in docs/trainer.md
# ("Loss types"); tests/unit/test_loss.py keeps the keys equal to the Literal's values.
LOSS_KINDS: dict[str, LossKind] = {
    "sft": LossKind("−log p(x_t | x_<t): masked cross-entropy at temperature 1", _sft, policy=False),
    "policy_gradient": LossKind("−A_i · log π(x_t) (REINFORCE with the rollout's advantages)", _policy_gradient,
                                policy=True),
    "ppo": LossKind("max(−A_i·r, −A_i·clip(r, 1 − ε_low, 1 + ε_high)) (+ β·k3 to the initial policy; dual clip)",
                    _ppo, policy=True, ratio=True, reference=True, generated_only=True),
}


def _policy_terms(per_token: torch.Tensor, t: TokenTerms) -> torch.Tensor:
    """A policy loss's ℓ_t with the rollout correction's weight w_t (generated rollouts) and the entropy bonus;
    adds their statistics to `t.out`."""
    policy = t.policy
    if t.inputs.engine_logprobs is not None:
        weight = _correction_weights(t.logp, t.inputs, t.mask, t.tokens_per_sample, t.kind, policy, t.out)
        if weight is not None:
            per_token = per_token * weight
    if policy.entropy_coef > 0:
        per_token = per_token - policy.entropy_coef * t.ent
        t.out["entropy_bonus"] = policy.entropy_coef * t.ent.detach()
    return per_token


def _correction_weights(logp, inputs: LossInputs, mask, tokens_per_sample, kind: LossKind, policy: PolicySettings,
                        out: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """w [T] (detached) of `rolloutCorrection` (None for `none`): ρ = π_old/π_engine, π_old of a loss without a ratio
    (policy_gradient) with `oldLogprobs: engine` being π before this step's update; adds its statistics to `out`."""
    rc = policy.correction
    if rc.type == "none":
        return None
    with torch.no_grad():
        if policy.old_logprobs == "engine" and not kind.ratio:
            trainer_lp = logp.detach().float()
        else:
            trainer_lp = _old_logprobs(inputs, kind, policy)  # ppo with oldLogprobs engine: the engine's, ρ ≡ 1
        eng = inputs.engine_logprobs.float()
        log_rho = torch.where(mask > 0, trainer_lp - eng, 0.0).double().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        if rc.level == "sequence":
            log_rho = _per_sample_mean(log_rho, inputs, mask, tokens_per_sample)
        rho = torch.exp(log_rho)
        if rc.type == "tis":
            weight = torch.clamp(rho, max=rc.threshold)
        else:
            weight = ((rho >= rc.lower) & (rho <= rc.threshold)).double()
        on = mask > 0
        out["correction_weight"] = weight
        out["masked_fraction"] = (weight == 0).double()
        out["correction_weight_max"] = weight[on].max() if bool(on.any()) else weight.new_zeros(())
        return weight.to(logp.dtype)


def merge_stats(total: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`total` += `new` for (sum, count) pairs, in place; MAX_STATS rows take the max (and add their counts)."""
    rows = [STAT_NAMES.index(name) for name in MAX_STATS]
    keep = total[rows, 0].clone()
    total.add_(new)
    for i, r in enumerate(rows):
        total[r, 0] = max(float(keep[i]), float(new[r, 0]))
    return total


def megatron_loss_factor(dp_size: int, num_microbatches: int) -> float:
    """Factor on J_{r,m} so Megatron's 1/M (schedule) and 1/D (DDP) leave the gradient of J_s (see module doc)."""
    return float(dp_size * num_microbatches)
