"""Mixture-of-experts layers at run time: what each router chose, replaying given choices, the per-sample
load-balancing loss and the router statistics — one `RoutingHooks` object per built Megatron model.

The hook. megatron-core 0.16.1's `TopKRouter` computes its top-k through `router.router_replay.get_replay_topk(scores,
topk, num_groups, group_topk, default_compute_topk)` whenever `router_replay` is set (`moe_utils.
topk_routing_with_score_function`; Megatron sets it only with `moe_enable_routing_replay`, for its own
record/replay of whole layers). `RoutingHooks.install(model, arch)` puts a `_RouterTap` of ours there on every router
of the model, in layer order. `scores` is the router's [tokens, experts] logits (`moe_router_pre_softmax` false: the
chosen logits are then softmaxed, i.e. the renormalised top-k) or their softmax (pre-softmax true); tokens are in
Megatron's [sequence, batch] order flattened (position s of row b is token s·B + b). The tap returns Megatron's own
choice, except:

* replay: where `prepare(replay=…)` gives expert ids for a token (≥ 0; −1 leaves the token to the router), those
  experts are used, with the router's own probabilities for them (`scores.gather`), so the gradient still flows
  through the router;
* record: the chosen ids are kept (`recorded()`), for the in-process engine to hand to the trainer;
* the load-balancing loss of each sample (below) is attached to the chosen scores with Megatron's
  `MoEAuxLossAutoScaler` (identity forward; its backward adds the loss's gradient scaled by the schedule's loss
  scale / num_microbatches), so it reaches the router in the layer's own backward — on every pipeline stage alike;
* statistics: tokens per expert and each sample's balance loss are summed until `take_stats()`.

The per-sample balance loss (Switch Transformer's form on one sample's tokens): with n_j tokens of sample j,
f_{j,e} = (tokens of j routed to e) / (n_j·k) and P_{j,e} = mean over j's tokens of softmax(logits)_e,
  aux_j = E · Σ_e f_{j,e} · P_{j,e}          (1 when the sample's tokens spread evenly, up to E/k when not).
A sample is never split across micro-batches or ranks (a scheduler invariant), so aux_j is the same whatever the
data-/expert-parallel layout and micro-batch split; the trainer weights it like the main loss (docs/trainer.md, "MoE
loss scaling"). Tokens outside every sample (padding, an empty micro-batch's dummy token) have `token_sample` −1 and
count nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainingrun.modeling.architecture import Architecture


def patch_megatron_moe() -> None:
    """megatron-core 0.16.1 names `te_general_gemm` in the router's gating function but defines it only when
    TransformerEngine imports: without TE (every CPU and the GPU machine here) the first MoE forward raised
    NameError. Define it as None (the code then takes its plain `torch.mm` branch). Idempotent."""
    from megatron.core.transformer.moe import moe_utils  # deferred: megatron after prepare_device

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def mark_expert_params(model) -> None:
    """Mark every expert parameter as expert-parallel (`allreduce` False) at every expert-parallel size, EP 1
    included. Megatron marks them only at EP > 1, so at EP 1 the optimizer was one plain optimizer and at EP 2 a
    `ChainedOptimizer` (dense + expert), whose checkpoint keys differ (`chained_0.optimizer.state...`): an EP 2
    checkpoint did not load at EP 1. Marked, both sizes build the chained pair and write the same keys; at EP 1 the
    expert-data-parallel group is the data-parallel group, so the gradients are reduced exactly as before."""
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


@dataclass
class RouterStats:
    """Sums since the last `take_stats`: `tokens_per_expert` [MoE layers, experts] (each routed token slot once),
    `aux_sum` (Σ over samples of the mean over layers of aux_j) and `aux_count` (samples)."""

    tokens_per_expert: torch.Tensor
    aux_sum: float
    aux_count: int


class RoutingHooks:
    """The taps on every router of one model (see the module docstring). Use `install`; then per forward call
    `prepare(...)`, and after it `recorded()` / `take_stats()`."""

    def __init__(self, routers: list, arch: Architecture):
        moe = arch.moe
        self.num_layers = len(routers)
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.taps = [_RouterTap(self, i, pre_softmax=not moe.norm_topk_prob) for i in range(len(routers))]
        for router, tap in zip(routers, self.taps):
            router.router_replay = tap
        self.token_sample: torch.Tensor | None = None
        self.num_samples = 0
        self.aux_weights: torch.Tensor | None = None
        self.replay: torch.Tensor | None = None
        self.record = False
        self.stats = False
        self._recorded: list[torch.Tensor | None] = [None] * self.num_layers
        self._reset_stats()

    @classmethod
    def install(cls, model, arch: Architecture) -> RoutingHooks | None:
        """Taps on the routers of `model` (layer order); None for a dense model."""
        if arch.moe is None:
            return None
        from megatron.core.transformer.moe.router import TopKRouter  # deferred: megatron after prepare_device

        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        return cls(routers, arch) if routers else None

    def prepare(self, *, token_sample: torch.Tensor | None = None, num_samples: int = 0,
                aux_weights: torch.Tensor | None = None, replay: torch.Tensor | None = None, record: bool = False,
                stats: bool = False) -> None:
        """What the next forward call does. `token_sample` [T] long: the index of each token's sample in the
        micro-batch, −1 outside every sample (needed for the balance loss and statistics); `aux_weights` [n]: the
        weight of each sample's balance loss (coefficient and normalisation included, `trainer.loss`), None: not
        added to the loss; `replay` [T, layers, k]: expert ids to use (−1: the router's own choice); `record`: keep
        the choices; `stats`: add to the statistics."""
        self.token_sample, self.num_samples = token_sample, num_samples
        self.aux_weights, self.replay, self.record, self.stats = aux_weights, replay, record, stats
        if stats:
            self._aux_count += num_samples
        self._recorded = [None] * self.num_layers

    def recorded(self) -> torch.Tensor:
        """[T, layers, k] int16: the experts each token of the last forward call was routed to."""
        if any(r is None for r in self._recorded):
            raise RuntimeError("routing was not recorded for every MoE layer (prepare(record=True) before the forward)")
        return torch.stack(self._recorded, dim=1)

    def take_stats(self) -> RouterStats:
        out = RouterStats(self._counts, self._aux_sum, self._aux_count)
        self._reset_stats()
        return out

    def _reset_stats(self) -> None:
        self._counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        self._aux_sum = 0.0
        self._aux_count = 0


class _RouterTap:
    """What Megatron's router calls for its top-k (the `router_replay` seam): one per MoE layer."""

    def __init__(self, hooks: RoutingHooks, layer: int, *, pre_softmax: bool):
        self.hooks, self.layer, self.pre_softmax = hooks, layer, pre_softmax

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.hooks
        values, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if h.replay is not None:
            want = h.replay[:, self.layer, :].to(device=scores.device, dtype=torch.long)
            if want.shape != idx.shape:
                raise ValueError(f"routing replay: layer {self.layer} got expert ids of shape {tuple(want.shape)} "
                                 f"for {tuple(idx.shape)} routed token slots")
            given = want[:, 0] >= 0
            if bool(given.any()):
                idx = torch.where(given[:, None], want, idx)
                values = scores.gather(1, idx)
        if h.record:
            h._recorded[self.layer] = idx.detach().to(torch.int16).cpu()
        if h.token_sample is None or not (h.stats or h.aux_weights is not None) or h.num_samples == 0:
            return values, idx
        sample = h.token_sample.to(scores.device)
        valid = sample >= 0
        tok_sample, tok_idx = sample[valid], idx[valid]
        if h.stats:
            h._counts[self.layer] += torch.bincount(tok_idx.flatten(), minlength=h.num_experts).double().cpu()
        probs = scores.float() if self.pre_softmax else torch.softmax(scores.float(), dim=-1)
        aux = sample_balance_loss(probs[valid], tok_idx, tok_sample, h.num_samples, h.num_experts)
        if h.stats:
            h._aux_sum += float(aux.detach().sum()) / h.num_layers
        if h.aux_weights is not None:
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler  # deferred: megatron

            values = MoEAuxLossAutoScaler.apply(values, (aux * h.aux_weights.to(aux.device)).sum())
        return values, idx


def sample_balance_loss(probs: torch.Tensor, chosen: torch.Tensor, sample: torch.Tensor, num_samples: int,
                        num_experts: int) -> torch.Tensor:
    """aux_j for every sample j (module docstring): `probs` [T, E] softmax over the experts, `chosen` [T, k] the
    experts each token went to, `sample` [T] each token's sample (0 … n−1). A sample without tokens gets 0."""
    k = chosen.shape[1]
    routed = torch.zeros(num_samples, num_experts, dtype=probs.dtype, device=probs.device)
    routed.index_add_(0, sample.repeat_interleave(k), torch.nn.functional.one_hot(
        chosen.flatten(), num_experts).to(probs.dtype))
    prob_sum = torch.zeros(num_samples, num_experts, dtype=probs.dtype, device=probs.device).index_add(0, sample, probs)
    n = torch.bincount(sample, minlength=num_samples).to(probs.dtype)
    return num_experts * (routed * prob_sum).sum(-1) / (n.square() * k).clamp(min=1.0)
