"""Mixture-of-experts training on one trainer rank: the taps on the model's routers (`modeling.moe.RoutingHooks`),
and per step

* `prepare_step`: with expert parallelism over the all-gather token dispatcher (CPU), micro-batch m of every rank of
  an expert-parallel group must hold the same number of tokens (each MoE layer all-gathers them): one all-reduce
  (MAX) of the step's micro-batch lengths over the group, then each micro-batch is padded with a dummy document
  (`batch.pad_to_length`: no targets, in no sample, so the loss, the balance loss and the statistics never see it).
  The all-to-all dispatcher (CUDA) takes uneven counts and needs no padding;
* `before_forward`: what the routers do in the micro-batch's forward — the per-sample balance loss with its weights
  (coefficient × the loss's normalisation × Megatron's factor D·M, `trainer.loss.sample_weights`), the generator's
  experts to replay (`trainer.moe.routingReplay`), statistics;
* `step_stats`: the step's router statistics over all data-parallel ranks (one all-reduce) for the record and the
  weighted metrics: `moe_aux_loss` (per sample: its balance loss, mean over MoE layers; 1 = balanced),
  `moe_load_imbalance` (per MoE layer: tokens of the busiest expert / mean tokens per expert over the step's
  tokens), `moe_tokens_per_expert` (per layer and expert: tokens routed in the step; the record adds its min and
  max).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.moe import RoutingHooks
from trainingrun.trainer.batch import MicroBatch, pad_to_length
from trainingrun.trainer.loss import LossSettings, StepTotals, sample_weights

# The weighted metrics of `step_stats` (metrics.names: trainingrun_trainer_<name>).
MOE_WEIGHTED = ("moe_aux_loss", "moe_load_imbalance", "moe_tokens_per_expert")


def aux_loss_coeff(spec, arch: Architecture) -> float:
    """The balance loss's coefficient: `trainer.moe.auxLossCoeff`, else the model's (config.json's
    router_aux_loss_coef); 0 for a dense model."""
    if arch.moe is None:
        return 0.0
    given = spec.trainer.moe.aux_loss_coeff
    return float(given) if given is not None else arch.moe.aux_loss_coeff


@dataclass
class MoETraining:
    hooks: RoutingHooks
    replay: bool  # route the payload's tokens as the generator did
    ep_group: object = None  # the expert-parallel group when its micro-batches must be padded to equal lengths
    dp_group: object = None

    @classmethod
    def build(cls, model, arch: Architecture, *, replay: bool, device: torch.device) -> MoETraining | None:
        """For a mixture of experts; None for a dense model (call after `init_distributed`)."""
        from megatron.core import parallel_state  # deferred: megatron after prepare_device

        hooks = RoutingHooks.install(model, arch)
        if hooks is None:
            return None
        ep = parallel_state.get_expert_model_parallel_world_size()
        pad = ep > 1 and device.type != "cuda"  # the all-gather dispatcher (modeling.model.moe_config)
        return cls(hooks=hooks, replay=replay, ep_group=parallel_state.get_expert_model_parallel_group() if pad
                   else None, dp_group=parallel_state.get_data_parallel_group())

    def prepare_step(self, microbatches: list[MicroBatch]) -> list[MicroBatch]:
        if self.ep_group is None:
            return microbatches
        lengths = torch.tensor([mb.input_ids.shape[1] for mb in microbatches], dtype=torch.int64)
        dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=self.ep_group)
        return [pad_to_length(mb, int(n)) for mb, n in zip(microbatches, lengths.tolist())]

    def before_forward(self, mb: MicroBatch, loss: LossSettings, totals: StepTotals, factor: float) -> None:
        weights = None
        if loss.moe_aux_coeff > 0 and mb.loss.num_samples:
            weights = sample_weights(mb.loss, loss, totals) * (loss.moe_aux_coeff * factor)
        replay = None
        if self.replay:
            replay = self._replay_ids(mb)
        self.hooks.prepare(token_sample=mb.token_sample, num_samples=mb.loss.num_samples, aux_weights=weights,
                           replay=replay, stats=True)

    def _replay_ids(self, mb: MicroBatch) -> torch.Tensor:
        h = self.hooks
        if mb.routed_experts is None:
            raise ValueError("trainer.moe.routingReplay: the rollout's payload has no routed_experts (was it "
                             "generated with routing replay on, by the megatron engine?)")
        width = h.num_layers * h.top_k
        if mb.routed_experts.shape[1] != width:
            raise ValueError(f"routed_experts: {mb.routed_experts.shape[1]} experts per token, the model routes "
                             f"{h.num_layers} MoE layers × top-{h.top_k} = {width}")
        return mb.routed_experts.long().view(-1, h.num_layers, h.top_k)

    def step_stats(self) -> dict[str, object]:
        """The step's router statistics (see the module docstring): record fields (floats) and, under
        `weighted`, this rank's (sum, count) pair of each of `MOE_WEIGHTED`. Collective over the data-parallel
        group."""
        st = self.hooks.take_stats()
        layers, experts = st.tokens_per_expert.shape
        local_aux = (st.aux_sum, float(st.aux_count))
        flat = torch.cat([st.tokens_per_expert.flatten(), torch.tensor(local_aux, dtype=torch.float64)])
        if dist.is_initialized():
            dist.all_reduce(flat, group=self.dp_group)
        counts = flat[:-2].view(layers, experts)
        aux_sum, aux_count = flat[-2:].tolist()
        mean = counts.mean(dim=1)
        ratio = torch.where(mean > 0, counts.max(dim=1).values / mean.clamp(min=1e-12), torch.ones_like(mean))
        imbalance = (float(ratio.sum()), float(layers))
        tokens = (float(counts.sum()), float(layers * experts))
        return {
            "moe_aux_loss": aux_sum / aux_count if aux_count else 0.0,
            "moe_load_imbalance": imbalance[0] / imbalance[1],
            "moe_tokens_per_expert": tokens[0] / tokens[1],
            "moe_tokens_per_expert_min": float(counts.min()),
            "moe_tokens_per_expert_max": float(counts.max()),
            # this rank's pairs: its own samples' balance loss; the step-wide figures (the same on every rank, so
            # any set of ranks reduces to them)
            "weighted": {"moe_aux_loss": local_aux, "moe_load_imbalance": imbalance, "moe_tokens_per_expert": tokens},
        }
