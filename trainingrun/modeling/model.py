"""The Megatron model of an `Architecture`: the device, process groups and seed it needs, the one model builder
(`build_model`: trainer, `trainingrun score`, the rollout's in-process engine) and loading canonical weights into it.

Import order matters on a CPU-only machine: call `prepare_device(cpu)` (which installs `modeling.cpu_compat`) before
anything imports megatron, so megatron is imported inside the functions here. Every function takes plain values (an
`Architecture`, a device), so tests build exactly the trainer's model. The trainer's DDP wrapper, optimizer and LR
schedule are in `trainer/optim.py`.

Attention of packed (THD) micro-batches (`attention_choice`, from `model.attentionBackend` and
`model.transformerImpl`): `te` is TransformerEngine's attention inside its layer spec; `flash` and `sdpa` are core
attentions of the local spec (`modeling.attention.FlashVarlenAttention`, `PackedSDPAttention`). `auto` takes te, then
flash, then sdpa, the first this device offers; a named backend the device cannot run is refused (ValueError naming
it and what is missing; the programs exit 78). What the model computes beside its architecture — that choice,
activation recomputation, gradient-accumulation fusion — is one `ModelOptions` value.
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

from trainingrun.modeling import cpu_compat
from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.attention import FlashVarlenAttention, PackedSDPAttention, flash_unavailable
from trainingrun.modeling.convert import check_tp, model_names
from trainingrun.modeling.hf_io import load_megatron_state
from trainingrun.modeling.pipeline import check_pp
from trainingrun.modeling.initialise import initialise
from trainingrun.modeling.moe import mark_expert_params, patch_megatron_moe


def prepare_device(gpus: int) -> torch.device:
    """CUDA when the spec asks for GPUs and one is visible (NCCL), else CPU (gloo + the compat shim).

    Worker LOCAL_RANK uses GPU LOCAL_RANK; ValueError when this node has more workers (LOCAL_WORLD_SIZE) than visible
    GPUs (NCCL refuses two ranks on one device)."""
    if gpus > 0 and torch.cuda.is_available():
        visible = torch.cuda.device_count()
        nproc = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        if nproc > visible:
            raise ValueError(f"trainer.gpusPerReplica: {nproc} workers per pod but only {visible} CUDA device(s) "
                             "visible; allowed: at most the visible devices (or run without CUDA on the CPU)")
        local = int(os.environ.get("LOCAL_RANK", "0")) % visible
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    cpu_compat.install()
    return torch.device("cpu")


def init_distributed(device: torch.device, tp: int = 1, pp: int = 1, timeout_s: float = 600, ep: int = 1) -> None:
    """torch.distributed from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, then Megatron's parallel state. `ep`: the
    expert-parallel size (groups of `ep` data-parallel ranks share the experts of a mixture-of-experts model; their
    expert-data-parallel groups reduce the experts' gradients)."""
    from megatron.core import parallel_state  # deferred: megatron after prepare_device

    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method="env://",
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 expert_model_parallel_size=ep)


def end_distributed() -> None:
    """The end of what `init_distributed` set up: Megatron's parallel state, then torch.distributed's groups,
    destroyed while the interpreter is whole. gloo groups left to the interpreter's finalisation can abort a process
    after its work is done ("terminate called without an active exception", pytorch#190489)."""
    from megatron.core import parallel_state  # deferred: megatron after prepare_device

    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def set_seed(seed: int) -> None:
    """Same seed on every rank: model init identical whatever the data-parallel size."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # deferred: megatron

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def torch_dtype(precision: str) -> torch.dtype:
    """The torch dtype of a spec precision (fp32, bf16, fp16)."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def te_unavailable(device: torch.device) -> str | None:
    """Why TransformerEngine cannot run here (None: it can): CUDA and the transformer_engine package."""
    if device.type != "cuda":
        return f"TransformerEngine runs on CUDA only (device {device})"
    try:
        import transformer_engine  # noqa: F401  # deferred: optional, CUDA only
    except ImportError as exc:
        return f"the transformer_engine package does not import here ({exc})"
    return None


@dataclass(frozen=True)
class AttentionChoice:
    """The attention backend a process runs (te, flash or sdpa) and why: the line its log prints."""

    backend: Literal["te", "flash", "sdpa"]
    reason: str

    @property
    def layer_impl(self) -> str:
        """The Megatron layer implementation it runs in: TE's attention only in TE's layer spec."""
        return "transformer_engine" if self.backend == "te" else "local"


def attention_choice(arch: Architecture, device: torch.device, *, generation: bool = False) -> AttentionChoice:
    """The attention backend of `arch` on `device` (see the module docstring; the rules are in docs/trainer.md).

    `model.transformerImpl: transformer_engine` means TE's attention (its layer spec has no other); `local` means
    flash or sdpa (the API refuses the contradictory combinations). `auto` under `transformerImpl: auto` takes te only
    in bf16/fp16, as the layer spec always did: TE's kernels for packed input are half-precision ones. A named
    backend that cannot run here raises ValueError naming the field, the backend and what is missing.
    `generation`: the in-process engine's padded batches, which never reach the flash kernel (the flash module runs
    them through torch SDPA), so a named flash is not refused there."""
    want, impl, precision = arch.attention_backend, arch.transformer_impl, arch.precision
    te_missing = te_unavailable(device)
    if impl == "transformer_engine" or want == "te":
        if te_missing:
            field = "model.transformerImpl: transformer_engine" if impl == "transformer_engine" else \
                "model.attentionBackend: te"
            raise ValueError(f"{field} needs TransformerEngine, which is not available: {te_missing}; allowed here: "
                             "model.attentionBackend auto, flash or sdpa with model.transformerImpl auto or local")
        if want == "te":
            return AttentionChoice("te", "named")
        return AttentionChoice("te", "auto: model.transformerImpl transformer_engine (its layer spec has only "
                                     "TransformerEngine's attention)")
    flash_missing = flash_unavailable(device, precision, arch.head_dim)
    if want == "flash":
        if flash_missing and not generation:
            raise ValueError(f"model.attentionBackend: flash is not available here: {flash_missing}; allowed here: "
                             "sdpa or auto")
        note = " (generation: padded batches through torch SDPA)" if generation else ""
        return AttentionChoice("flash", "named" + note)
    if want == "sdpa":
        return AttentionChoice("sdpa", "named")
    if impl == "auto" and not te_missing and precision in ("bf16", "fp16"):
        return AttentionChoice("te", "auto: TransformerEngine imports on CUDA and the model is " + precision)
    why_not_te = te_missing or (f"model.transformerImpl {impl}" if impl != "auto" else
                                f"TransformerEngine's packed kernels are half precision, the model is {precision}")
    if not flash_missing:
        return AttentionChoice("flash", f"auto: te not taken ({why_not_te}); torch's varlen flash attention runs here")
    return AttentionChoice("sdpa", f"auto: te not taken ({why_not_te}); flash not available ({flash_missing})")


def layer_impl(arch: Architecture, device: torch.device) -> str:
    """Which Megatron layer implementation `build_model` uses: "transformer_engine" (the te attention backend) or
    "local" (flash or sdpa); ValueError as `attention_choice`."""
    return attention_choice(arch, device).layer_impl


# Megatron's core attention per local-spec backend
_CORE_ATTENTION = {"flash": FlashVarlenAttention, "sdpa": PackedSDPAttention}


def layer_spec(arch: Architecture, device: torch.device, attention: AttentionChoice | None = None, config=None):
    """Megatron's TransformerEngine layer spec (backend te), or its local spec with the flash or the packed SDPA core
    attention. `attention`: the process's resolved choice (default: `attention_choice(arch, device)`). The norm type
    comes from the architecture (RMSNorm for llama); `qk_norm` adds the per-head query/key norms. A mixture of experts
    is Megatron's block spec of dense and MoE layers (`get_gpt_decoder_block_spec` of `config`, by its
    `moe_layer_freq`; experts as a `SequentialMLP`, no grouped GEMM)."""
    from megatron.core.models.gpt import gpt_layer_specs  # deferred: megatron

    choice = attention or attention_choice(arch, device)
    te = choice.backend == "te"
    if arch.moe is not None:
        block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=te,
                                                           normalization=arch.normalization)
        if not te:
            for spec in block.layer_specs:
                spec.submodules.self_attention.submodules.core_attention = _CORE_ATTENTION[choice.backend]
        return block
    if te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=arch.normalization, qk_layernorm=arch.qk_norm)
    spec.submodules.self_attention.submodules.core_attention = _CORE_ATTENTION[choice.backend]
    return spec


def moe_config(arch: Architecture, device: torch.device, ep: int = 1) -> dict:
    """The `TransformerConfig` fields of a mixture of experts (empty for a dense model).

    Routing as Hugging Face computes it: softmax over all experts, then top-k (`moe_router_pre_softmax`) when
    `norm_topk_prob` is false; top-k of the logits, then softmax over those k (= the renormalised top-k
    probabilities) when it is true; router logits in fp32. Megatron's own load-balancing loss is off: the trainer adds
    its per-sample form through `modeling.moe` (docs/trainer.md, "MoE loss scaling"). Tokens reach the experts by
    all-gather on the CPU (the all-to-all dispatcher needs CUDA streams) and all-to-all on CUDA."""
    moe = arch.moe
    if moe is None:
        return {}
    return dict(
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_topk=moe.top_k,
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_layer_freq=[1 if moe.is_moe_layer(i) else 0 for i in range(arch.num_layers)],
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_size,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_token_dispatcher_type="alltoall" if device.type == "cuda" else "allgather",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        expert_model_parallel_size=ep,
    )


@dataclass(frozen=True)
class ModelOptions:
    """How the model computes beside its architecture (module docstring). The defaults are what inference and
    scoring use: the attention resolved on the device, nothing recomputed, nothing fused. The trainer's come from
    `spec.trainer.performance` (`trainingrun.trainer.optim.performance_settings`, which checks them for the device)."""

    attention: AttentionChoice | None = None  # None: attention_choice(arch, device)
    recompute_granularity: Literal["selective", "full"] | None = None
    recompute_method: Literal["uniform", "block"] | None = None  # full only
    recompute_num_layers: int | None = None  # full only
    gradient_accumulation_fusion: bool = False  # needs apex's fused_weight_gradient_mlp_cuda (CUDA)


def transformer_config(arch: Architecture, device: torch.device, options: ModelOptions = ModelOptions(), *,
                       pipeline_size: int = 1, ep: int = 1):
    """Megatron `TransformerConfig` of an architecture; no dropout, so runs are reproducible, and no fusions that
    need CUDA kernels — except the gradient-accumulation fusion and the recomputation `options` ask for.
    `pipeline_size` > 1: the stages exchange each micro-batch's activation shape before the activation
    (`variable_seq_lengths`: packed micro-batches differ in length). `ep`: the expert-parallel size (mixtures of
    experts, `moe_config`)."""
    from megatron.core.transformer import TransformerConfig  # deferred: megatron

    dtype = torch_dtype(arch.precision)
    config = TransformerConfig(
        pipeline_model_parallel_size=pipeline_size,
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization=arch.normalization,
        layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=arch.gated,
        activation_func=F.silu if arch.gated else F.gelu,
        add_bias_linear=arch.add_bias_linear,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        use_cpu_initialization=device.type == "cpu",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        gradient_accumulation_fusion=options.gradient_accumulation_fusion,
        recompute_granularity=options.recompute_granularity,
        recompute_method=options.recompute_method,
        recompute_num_layers=options.recompute_num_layers,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        **moe_config(arch, device, ep),
    )
    # Set after construction: the constructor refuses it with the default MoE token dispatcher (all-gather), which
    # a model without experts never runs.
    config.variable_seq_lengths = pipeline_size > 1
    return config


def build_model(arch: Architecture, device: torch.device, *, load_weights: bool = True,
                parallel_output: bool = True, options: ModelOptions = ModelOptions(), seed: int = 0):
    """THE model builder (trainer, scoring, in-process inference): a Megatron `GPTModel` of `arch`, this rank's
    tensor-parallel shard of its pipeline stage (the stage's layers, `modeling.pipeline`; the embedding on the first
    stage, the final norm and output layer on the last).

    gpt: LayerNorm + GELU; llama: RMSNorm + SwiGLU + grouped-query attention; both with RoPE (base `rope_base`;
    Llama-3 scaling when `rope_scaling_factor` is set), tied or untied output layer, optional biases, optional per-head
    query/key norms (`qk_norm`) and mixture-of-experts layers (`moe`: this rank holds its expert-parallel share of
    the experts). With `hf` set and `load_weights`, the Hugging Face weights are converted and this rank's shard is
    loaded
    (`trainingrun.modeling.hf_io.load_megatron_state`); else every parameter is drawn from `seed` as the whole model's
    tensor of its name (`modeling.initialise`: the same model at every tensor-, pipeline- and expert-parallel layout).
    `parallel_output=False` gathers the logits over the vocabulary (full [.., V] on every TP rank). `options`: the
    attention backend, recomputation and fusion (`ModelOptions`; by default the attention resolved on `device`)."""
    from megatron.core import parallel_state  # deferred: megatron after prepare_device
    from megatron.core.models.gpt import GPTModel  # deferred: megatron

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    check_tp(arch, tp, ep)
    check_pp(arch, pp)
    if arch.moe is not None:
        patch_megatron_moe()
    scaling = arch.rope_scaling_factor
    config = transformer_config(arch, device, options, pipeline_size=pp, ep=ep)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(arch, device, options.attention, config),
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=arch.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_base,
        rope_scaling=scaling is not None,
        rope_scaling_factor=scaling if scaling is not None else 8.0,
    )
    model = model.to(device)
    _params_to_dtype(model, torch_dtype(arch.precision))
    if arch.moe is not None:
        mark_expert_params(model)
    ranks = dict(tp=(parallel_state.get_tensor_model_parallel_rank(), tp),
                 pp=(parallel_state.get_pipeline_model_parallel_rank(), pp),
                 ep=(parallel_state.get_expert_model_parallel_rank(), ep))
    if not (arch.hf and load_weights):  # the same model at every tensor-, pipeline- and expert-parallel layout
        initialise(model, arch, seed=seed, std=config.init_method_std, **ranks)
    else:
        state = load_megatron_state(arch.hf, arch, tp_rank=ranks["tp"][0], tp_size=tp, pp_rank=ranks["pp"][0],
                                    pp_size=pp, ep_rank=ranks["ep"][0], ep_size=ep)
        load_canonical_state(model, state)
    return model


def _params_to_dtype(model, dtype: torch.dtype) -> None:
    """Every floating-point parameter in `dtype`, as Megatron's `Float16Module` leaves a half-precision model.

    Megatron's linear layers honour `params_dtype`, but the local spec's norms are plain torch modules created in
    fp32. A bf16/fp16 model with fp32 norm weights computes them in fp32 and — worse — its optimizer keeps them in a
    separate fp32 group that Megatron's `sharded_state_dict` cannot map, so no checkpoint could be written. Only
    parameters are cast: RoPE's inverse frequencies are a plain fp32 attribute and stay so."""
    if dtype == torch.float32:
        return
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def load_canonical_state(model, state: dict[str, torch.Tensor]) -> None:
    """Copy a canonical (local-spec names) state dict of this rank's shard into `model` (either spec), casting to
    each parameter's dtype; ValueError naming missing, unexpected or misshapen tensors, before anything is copied
    (the model keeps its weights)."""
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    renamed = model_names(state, own.keys())
    missing = sorted(set(own) - set(renamed))
    unexpected = sorted(set(renamed) - set(own))
    if missing or unexpected:
        raise ValueError(f"weights do not fit the model: missing {missing[:6]}, unexpected {unexpected[:6]}")
    for key, value in renamed.items():
        if own[key].shape != value.shape:
            raise ValueError(f"weights do not fit the model: {key} has shape {tuple(value.shape)}, the model "
                             f"needs {tuple(own[key].shape)}")
    with torch.no_grad():
        for key, value in renamed.items():
            own[key].copy_(value.to(device=own[key].device, dtype=own[key].dtype))
