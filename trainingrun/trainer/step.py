"""One optimizer step over exactly the scheduled micro-batches, through Megatron's `get_forward_backward_func`.

The loss each micro-batch returns is the contract's J_{r,m} times `megatron_loss_factor(D, M)` (see
`trainingrun.trainer.loss`), so the gradient after Megatron's schedule and DDP reduction is ∇J_s. The logits are this
tensor-parallel rank's vocabulary slice; the loss reduces over the TP group itself (`loss.token_logprobs`).
`old_logprobs_pass` is the forward-only pass of `policyLoss.oldLogprobs: trainer`: π_old of every token of a
rollout's micro-batches with the trainer's weights before the rollout's first update, through the same schedule.
The LR scheduler is advanced by GBS_s *before* the optimizer step, so the LR a step uses already counts that step's
samples (with warmup, the first step does not run at LR 0); after the step the scheduler's counter equals the run's
samples consumed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from trainingrun.metrics.reduce import allreduce_max, allreduce_pairs
from trainingrun.trainer.batch import MicroBatch, step_microbatches
from trainingrun.trainer.loss import (
    MAX_STATS, STAT_NAMES, LossSettings, StepTotals, megatron_loss_factor, merge_stats, micro_batch_objective,
    token_logprobs,
)


@dataclass
class StepResult:
    """What one step reports. `local_stats`: this rank's (sum, count) pairs [len(STAT_NAMES), 2];
    `stats`: the same reduced over all DP ranks (one all-reduce). `loss` = reduced objective J_s."""

    local_stats: torch.Tensor
    stats: torch.Tensor
    loss: float
    grad_norm: float
    lr: float
    seconds: float
    tokens: int  # tokens of the step over all ranks
    local_tokens: int
    local_samples: int
    samples: int = 0  # samples of the step over all ranks (= GBS_s when the schedule is whole)
    sample_id_sum: int = 0  # Σ global sample ids of the step (exactly-once checks)
    loss_scale: float = 1.0  # fp16 dynamic loss scale used by this step (1 for bf16/fp32)
    skipped: bool = False  # fp16: gradients overflowed at this loss scale; the update was skipped (scale lowered)
    moe: dict | None = None  # mixtures of experts: the step's router statistics (`trainer.moe.MoETraining.step_stats`)

    def mean(self, name: str) -> float:
        """Σsum / Σcount of a (sum, count) statistic; for MAX_STATS the maximum (0 when nothing was counted)."""
        s, c = self.stats[STAT_NAMES.index(name)].tolist()
        if name in MAX_STATS:
            return s if c else 0.0
        return s / c if c else 0.0


def tp_group():
    """The tensor-parallel group the loss reduces over (None at TP 1)."""
    from megatron.core import parallel_state  # deferred: megatron

    return parallel_state.get_tensor_model_parallel_group() \
        if parallel_state.get_tensor_model_parallel_world_size() > 1 else None


def logit_rows(logits: torch.Tensor) -> torch.Tensor:
    """The model's logits [1, T, V/tp] as the loss's rows [T, V/tp]: a view whose backward is a view too, so the
    gradient the loss writes in place of the logits is the one the output layer receives. (`logits[0]` gave the same
    rows, but its backward allocated a second, zero-filled [1, T, V/tp] tensor for the gradient: 500 MB at 4096
    tokens of a 32k vocabulary in fp32, found by the memory plan's CPU measurements, issue 28.)"""
    return logits.squeeze(0)


def _model_inputs(mb: MicroBatch) -> dict:
    return dict(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=None,
                packed_seq_params=mb.packed_seq_params())


def _run_schedule(ddp_model, microbatches: list[MicroBatch], forward_step, *, forward_only: bool) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func  # deferred: megatron

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=[ddp_model],
        num_microbatches=len(microbatches),
        seq_length=max(mb.input_ids.shape[1] for mb in microbatches),
        micro_batch_size=1,
        forward_only=forward_only,
    )


def forward_backward(
    ddp_model,
    microbatches: list[MicroBatch],
    loss: LossSettings,
    totals: StepTotals,
    *,
    dp_size: int,
    ref_model=None,
    moe=None,
) -> torch.Tensor:
    """Run the micro-batches (forward + backward, gradients reduced over DP) with the run's `loss` and the step's
    denominators `totals`; return local stats [S, 2] (this data-parallel rank's, the same on each pipeline stage).

    `ref_model`: the frozen initial policy (ppo with a KL penalty), run forward-only on the same micro-batch.

    Pipeline parallelism (P > 1 stages): Megatron's 1F1B schedule runs the same M micro-batches through the stages;
    every stage reads them (positions, cu_seqlens, RoPE), the first embeds the tokens, each later stage receives the
    previous one's activations — [tokens, 1, hidden], another length for every packed micro-batch, so the shape goes
    first (`variable_seq_lengths`, set by `build_model`) — and the last computes the loss. The schedule divides it by
    M as at P = 1 and DDP reduces over the same D ranks, so the factor and the gradient are those of P = 1. Only the
    last stage sees the losses: its statistics are summed over the pipeline group (the others contribute zeros).

    `moe`: a mixture of experts' `trainer.moe.MoETraining` (equal lengths over the expert-parallel group, the balance
    loss, routing replay and statistics of each micro-batch's forward)."""
    from megatron.core import parallel_state  # deferred: megatron

    m = len(microbatches)
    if m < 1:
        raise ValueError("num_microbatches: a step needs at least one micro-batch per rank")
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if ref_model is not None and pp_size > 1:
        raise ValueError("trainer.policyLoss.klCoef: the reference model is not pipelined; allowed with "
                         "pipelineParallelSize 1 only")
    factor = megatron_loss_factor(dp_size, m)
    stats = torch.zeros(len(STAT_NAMES), 2, dtype=torch.float64)
    group = tp_group()
    if moe is not None:
        microbatches = moe.prepare_step(microbatches)

    def loss_func(mb: MicroBatch, ref_logits, logits: torch.Tensor):
        # the logits are read by the loss alone: its backward writes their gradient in place (as Megatron's own)
        objective, mb_stats = micro_batch_objective(
            logit_rows(logits), mb.loss, loss, totals, tp_group=group,
            ref_logits=None if ref_logits is None else logit_rows(ref_logits), overwrite_logits=True,
        )
        merge_stats(stats, mb_stats)
        # Megatron divides this tensor in place by M: hand it a fresh one, never the logged value.
        return objective * factor, {}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        inputs = _model_inputs(mb)
        ref_logits = None
        if ref_model is not None and mb.loss.num_samples:
            with torch.no_grad():
                ref_logits = ref_model(**inputs)
        if moe is not None:
            moe.before_forward(mb, loss, totals, factor)
        logits = model(**inputs)
        return logits, partial(loss_func, mb, ref_logits)

    _run_schedule(ddp_model, microbatches, forward_step, forward_only=False)
    if pp_size > 1:
        stats = allreduce_pairs(stats, group=parallel_state.get_pipeline_model_parallel_group())
    return stats


def old_logprobs_pass(ddp_model, microbatches: list[MicroBatch], loss: LossSettings) -> list[torch.Tensor]:
    """π_old for `policyLoss.oldLogprobs: trainer`: a forward-only pass over `microbatches` with the current weights;
    per micro-batch, log π(token t | t−1) [T] of softmax(logits / temperature) (0 at t = 0; the micro-batch's
    first token of each sample is not a target), computed as the loss computes it (`loss.token_logprobs`), so
    with unchanged weights the ratio π/π_old of the next step is exactly 1."""
    scale = (loss.policy.logit_scale if loss.policy is not None else 1.0)
    group = tp_group()
    out: list[torch.Tensor | None] = [None] * len(microbatches)
    index = iter(range(len(microbatches)))

    def loss_func(i: int, mb: MicroBatch, logits: torch.Tensor):
        logp, _ = token_logprobs(logit_rows(logits), mb.loss.tokens, scale, tp_group=group)
        out[i] = logp.detach()
        return logp.new_zeros(()), {}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return model(**_model_inputs(mb)), partial(loss_func, next(index), mb)

    with torch.no_grad():
        _run_schedule(ddp_model, microbatches, forward_step, forward_only=True)
    if any(lp is None for lp in out):
        raise RuntimeError("old_logprobs_pass: the schedule returned no logits for some micro-batches")
    return out  # type: ignore[return-value]


def payload_old_logprobs(ddp_model, payload, step_positions: list[list[list[int]]], loss: LossSettings,
                         device) -> np.ndarray:
    """log π_old of every token of a rank's payload (float32, the payload's token layout; 0 where no micro-batch of
    `step_positions` — per step, its micro-batches as positions into the payload — holds the sample), by
    `old_logprobs_pass` over each step's micro-batches."""
    offsets = payload["offsets"]
    old = np.zeros(len(payload["tokens"]), np.float32)
    for positions in step_positions:
        mbs = step_microbatches(payload, positions, device)
        for pos, logp in zip(positions, old_logprobs_pass(ddp_model, mbs, loss)):
            lp = logp.float().cpu().numpy()
            at = 0
            for p in pos:
                a, b = int(offsets[p]), int(offsets[p + 1])
                old[a:b] = lp[at:at + b - a]
                at += b - a
    return old


def train_step(
    ddp_model,
    optimizer,
    scheduler,
    microbatches: list[MicroBatch],
    loss: LossSettings,
    totals: StepTotals,
    *,
    dp_size: int,
    dp_group=None,
    ref_model=None,
    moe=None,
) -> StepResult:
    """Zero grads, forward/backward, advance the LR scheduler by GBS_s, optimizer step, reduce metrics."""
    import torch.distributed as dist  # deferred: torch

    t0 = time.perf_counter()
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    local = forward_backward(ddp_model, microbatches, loss, totals, dp_size=dp_size, ref_model=ref_model, moe=moe)
    scheduler.step(increment=totals.global_batch_size)
    lr = float(optimizer.param_groups[0]["lr"])
    loss_scale = float(optimizer.get_loss_scale())
    ok, grad_norm, _ = optimizer.step()
    skipped = not ok
    if skipped and getattr(optimizer, "grad_scaler", None) is None:
        raise FloatingPointError("optimizer step skipped (non-finite gradients)")
    local_tokens = sum(mb.num_tokens for mb in microbatches)
    local_samples = sum(mb.loss.num_samples for mb in microbatches)
    id_sum = float(sum(sum(mb.sample_ids) for mb in microbatches))
    # One all-reduce for every pair: the stats pairs, (tokens, samples) and (Σ sample ids, samples); one more for
    # the maximum statistics.
    extra = torch.tensor([[float(local_tokens), float(local_samples)], [id_sum, float(local_samples)]],
                         dtype=torch.float64)
    group = dp_group if dist.is_initialized() else None
    reduced = allreduce_pairs(torch.cat([local, extra]), group=group)
    stats, totals, ids = reduced[:-2], reduced[-2], reduced[-1]
    rows = [STAT_NAMES.index(name) for name in MAX_STATS]  # (max, count) rows: the maximum over the ranks
    stats[rows, 0] = allreduce_max(local[rows, 0], group=group)
    return StepResult(
        local_stats=local,
        stats=stats,
        loss=float(stats[0, 0]),
        grad_norm=float(grad_norm) if grad_norm is not None else 0.0,
        lr=lr,
        seconds=time.perf_counter() - t0,
        tokens=int(totals[0]),
        local_tokens=local_tokens,
        local_samples=local_samples,
        samples=int(totals[1]),
        sample_id_sum=int(ids[0]),
        loss_scale=loss_scale,
        skipped=skipped,
        moe=None if moe is None else moe.step_stats(),
    )
