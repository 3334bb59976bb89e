"""One optimizer step over exactly the scheduled micro-batches, through Megatron's `get_forward_backward_func`.

The loss each micro-batch returns is the contract's J_{r,m} times `megatron_loss_factor(D, M)` (see
`trainingrun.trainer.loss`), so the gradient after Megatron's schedule and DDP reduction is ∇J_s.
The LR scheduler is advanced by GBS_s *before* the optimizer step, so the LR a step uses already counts that step's
samples (with warmup, the first step does not run at LR 0); after the step the scheduler's counter equals the run's
samples consumed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch

from trainingrun.metrics.reduce import allreduce_pairs
from trainingrun.trainer.batch import MicroBatch
from trainingrun.trainer.loss import STAT_NAMES, LossSettings, StepTotals, megatron_loss_factor, micro_batch_objective


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

    def mean(self, name: str) -> float:
        s, c = self.stats[STAT_NAMES.index(name)].tolist()
        return s / c if c else 0.0


def forward_backward(
    ddp_model,
    microbatches: list[MicroBatch],
    loss: LossSettings,
    totals: StepTotals,
    *,
    dp_size: int,
    ref_model=None,
) -> torch.Tensor:
    """Run the micro-batches (forward + backward, gradients reduced over DP) with the run's `loss` and the step's
    denominators `totals`; return local stats [S, 2] (this data-parallel rank's, the same on each pipeline stage).

    `ref_model`: the frozen initial policy (ppo with a KL penalty), run forward-only on the same micro-batch.

    Pipeline parallelism (P > 1 stages): Megatron's 1F1B schedule runs the same M micro-batches through the stages;
    every stage reads them (positions, cu_seqlens, RoPE), the first embeds the tokens, each later stage receives the
    previous one's activations — [tokens, 1, hidden], another length for every packed micro-batch, so the shape goes
    first (`variable_seq_lengths`, set by `build_model`) — and the last computes the loss. The schedule divides it by
    M as at P = 1 and DDP reduces over the same D ranks, so the factor and the gradient are those of P = 1. Only the
    last stage sees the losses: its statistics are summed over the pipeline group (the others contribute zeros)."""
    from megatron.core import parallel_state  # deferred: megatron
    from megatron.core.pipeline_parallel import get_forward_backward_func  # deferred: megatron

    m = len(microbatches)
    if m < 1:
        raise ValueError("num_microbatches: a step needs at least one micro-batch per rank")
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if ref_model is not None and pp_size > 1:
        raise ValueError("trainer.policyLoss.klCoef: the reference model is not pipelined; allowed with "
                         "pipelineParallelSize 1 only")
    factor = megatron_loss_factor(dp_size, m)
    stats = torch.zeros(len(STAT_NAMES), 2, dtype=torch.float64)

    def loss_func(mb: MicroBatch, ref_logits, logits: torch.Tensor):
        objective, mb_stats = micro_batch_objective(
            logits[0], mb.loss, loss, totals, vocab_parallel=True,
            ref_logits=None if ref_logits is None else ref_logits[0],
        )
        stats.add_(mb_stats)
        # Megatron divides this tensor in place by M: hand it a fresh one, never the logged value.
        return objective * factor, {}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        inputs = dict(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=None,
                      packed_seq_params=mb.packed_seq_params())
        ref_logits = None
        if ref_model is not None and mb.loss.num_samples:
            with torch.no_grad():
                ref_logits = ref_model(**inputs)
        logits = model(**inputs)
        return logits, partial(loss_func, mb, ref_logits)

    fb = get_forward_backward_func()
    fb(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=[ddp_model],
        num_microbatches=m,
        seq_length=max(mb.input_ids.shape[1] for mb in microbatches),
        micro_batch_size=1,
        forward_only=False,
    )
    if pp_size > 1:
        stats = allreduce_pairs(stats, group=parallel_state.get_pipeline_model_parallel_group())
    return stats


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
) -> StepResult:
    """Zero grads, forward/backward, advance the LR scheduler by GBS_s, optimizer step, reduce metrics."""
    import torch.distributed as dist  # deferred: torch

    t0 = time.perf_counter()
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    local = forward_backward(ddp_model, microbatches, loss, totals, dp_size=dp_size, ref_model=ref_model)
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
    # One all-reduce for everything: the stats pairs, (tokens, samples) and (Σ sample ids, samples).
    extra = torch.tensor([[float(local_tokens), float(local_samples)], [id_sum, float(local_samples)]],
                         dtype=torch.float64)
    reduced = allreduce_pairs(torch.cat([local, extra]), group=dp_group if dist.is_initialized() else None)
    stats, totals, ids = reduced[:-2], reduced[-2], reduced[-1]
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
    )
