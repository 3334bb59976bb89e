"""Megatron-core set-up: process groups, the GPT model, DDP wrapper, optimizer and LR scheduler (samples-based).

Import order matters on a CPU-only machine: call `prepare_device(cpu)` (which installs `cpu_compat`) before anything
imports megatron. Every function here takes plain values, so tests build exactly the trainer's model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


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
    from trainingrun.trainer import cpu_compat

    cpu_compat.install()
    return torch.device("cpu")


def init_distributed(device: torch.device, tp: int = 1, pp: int = 1, timeout_s: float = 600) -> None:
    """torch.distributed from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, then Megatron's parallel state."""
    import datetime

    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method="env://",
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def set_seed(seed: int) -> None:
    """Same seed on every rank: model init identical whatever the data-parallel size."""
    import random

    import numpy as np
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _dtype(precision: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def layer_impl(sizes: dict[str, Any], device: torch.device) -> str:
    """Which Megatron layer implementation `build_model` uses: "transformer_engine" or "local".

    `transformerImpl: auto` takes TransformerEngine on CUDA in bf16/fp16 when it imports, else the local spec.
    fp32 stays local under auto: TE's fused/flash attention kernels (the ones that take packed THD input) run only in
    fp16/bf16. `transformer_engine` insists (ValueError on CPU or without the package)."""
    want = str(sizes.get("transformer_impl", "auto"))
    have_te = False
    if device.type == "cuda":
        try:
            import transformer_engine  # noqa: F401

            have_te = True
        except ImportError:
            pass
    if want == "transformer_engine":
        if not have_te:
            raise ValueError("model.transformerImpl: transformer_engine needs CUDA and the transformer_engine package "
                             f"(device {device}; package {'present' if have_te else 'not importable here'}); allowed "
                             "here: local or auto")
        return "transformer_engine"
    if want == "auto" and have_te and str(sizes.get("precision", "fp32")) in ("bf16", "fp16"):
        return "transformer_engine"
    return "local"


def layer_spec(sizes: dict[str, Any], device: torch.device):
    """Megatron's TransformerEngine layer spec, or its local spec with the packed SDPA core attention
    (`layer_impl` decides). The norm type comes from the architecture (RMSNorm for llama)."""
    if layer_impl(sizes, device) == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from trainingrun.trainer.attention import PackedSDPAttention

    spec = get_gpt_layer_local_spec(normalization=str(sizes.get("normalization", "LayerNorm")))
    spec.submodules.self_attention.submodules.core_attention = PackedSDPAttention
    return spec


def transformer_config(sizes: dict[str, Any], device: torch.device):
    """Megatron `TransformerConfig` of a resolved model spec (`ModelSpec.resolved()`); no dropout, so runs are
    reproducible, and no fusions that need CUDA kernels."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    dtype = _dtype(str(sizes.get("precision", "fp32")))
    swiglu = sizes.get("activation", "gelu") == "swiglu"
    bias = bool(sizes.get("add_bias_linear", False))
    heads = int(sizes["num_attention_heads"])
    return TransformerConfig(
        num_layers=int(sizes["num_layers"]),
        hidden_size=int(sizes["hidden_size"]),
        num_attention_heads=heads,
        num_query_groups=int(sizes.get("num_query_groups") or heads),
        kv_channels=int(sizes.get("kv_channels") or int(sizes["hidden_size"]) // heads),
        ffn_hidden_size=int(sizes["ffn_hidden_size"]),
        normalization=str(sizes.get("normalization", "LayerNorm")),
        layernorm_epsilon=float(sizes.get("norm_epsilon", 1e-5)),
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=bias,
        add_qkv_bias=bias or bool(sizes.get("add_qkv_bias", False)),
        use_cpu_initialization=device.type == "cpu",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
    )


def build_model(sizes: dict[str, Any], device: torch.device, *, load_weights: bool = True,
                parallel_output: bool = True):
    """THE model builder (trainer, scoring, in-process inference): a Megatron `GPTModel` of a resolved model spec
    (`ModelSpec.resolved()`), this rank's tensor-parallel shard.

    gpt: LayerNorm + GELU; llama: RMSNorm + SwiGLU + grouped-query attention; both with RoPE (base `rope_base`;
    Llama-3 scaling when `rope_scaling_factor` is set), tied or untied output layer, optional biases. With `hf` set
    and `load_weights`, the Hugging Face weights are converted and this rank's shard is loaded
    (`trainingrun.modeling.hf_io.load_megatron_state`); else the parameters keep Megatron's seeded initialisation.
    `parallel_output=False` gathers the logits over the vocabulary (full [.., V] on every TP rank)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from trainingrun.modeling import convert

    tp = parallel_state.get_tensor_model_parallel_world_size()
    convert.check_tp(sizes, tp)
    scaling = sizes.get("rope_scaling_factor")
    model = GPTModel(
        config=transformer_config(sizes, device),
        transformer_layer_spec=layer_spec(sizes, device),
        vocab_size=int(sizes["vocab_size"]),
        max_sequence_length=int(sizes["seq_length"]),
        pre_process=True,
        post_process=True,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=bool(sizes.get("tie_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=sizes.get("rope_base", 10000),
        rope_scaling=scaling is not None,
        rope_scaling_factor=float(scaling) if scaling is not None else 8.0,
    )
    model = model.to(device)
    _params_to_dtype(model, _dtype(str(sizes.get("precision", "fp32"))))
    if sizes.get("hf") and load_weights:
        from trainingrun.modeling.hf_io import load_megatron_state

        state = load_megatron_state(sizes["hf"], sizes, tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                                    tp_size=tp)
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


def build_gpt(sizes: dict[str, Any], device: torch.device):
    """Former name of `build_model` (callers that build a preset)."""
    return build_model(sizes, device)


def load_canonical_state(model, state: dict[str, torch.Tensor]) -> None:
    """Copy a canonical (local-spec names) state dict of this rank's shard into `model` (either spec), casting to
    each parameter's dtype; ValueError naming missing, unexpected or misshapen tensors."""
    from trainingrun.modeling.convert import model_names

    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    renamed = model_names(state, own.keys())
    missing = sorted(set(own) - set(renamed))
    unexpected = sorted(set(renamed) - set(own))
    if missing or unexpected:
        raise ValueError(f"weights do not fit the model: missing {missing[:6]}, unexpected {unexpected[:6]}")
    with torch.no_grad():
        for key, value in renamed.items():
            target = own[key]
            if target.shape != value.shape:
                raise ValueError(f"weights do not fit the model: {key} has shape {tuple(value.shape)}, the model "
                                 f"needs {tuple(target.shape)}")
            target.copy_(value.to(device=target.device, dtype=target.dtype))


def wrap_ddp(model):
    """Megatron DistributedDataParallel (fp32 grad buffer, gradients summed over DP then scaled by 1/DP)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False,
        average_in_collective=False,
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    ddp.broadcast_params()  # identical start on every DP rank, whatever each one initialised
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    return ddp


# fp16 dynamic loss scaling starts here (Megatron's default 2^32 would skip ~16 steps before it is usable; 2^16 is
# torch.amp's default). Halved after 2 consecutive overflows (hysteresis), doubled after 1000 clean steps.
FP16_INITIAL_LOSS_SCALE = 2.0**16


@dataclass
class OptimSettings:
    lr: float
    min_lr: float
    warmup_samples: int
    decay_samples: int | None
    decay_style: str
    weight_decay: float
    clip_grad: float
    beta1: float
    beta2: float


def build_optimizer(ddp_model, opt: OptimSettings, precision: str = "fp32"):
    """`get_megatron_optimizer` (AdamW) and an `OptimizerParamScheduler` whose steps are samples.

    The scheduler counts samples: warmup over `warmup_samples`, decay until `decay_samples`, and the trainer calls
    `step(increment=GBS_s)`. Megatron requires warmup < decay: with decay unset the LR stays constant after warmup
    (style constant, decay length warmup + 1); with warmup == decay the decay length is warmup + 1 sample.

    As Megatron's own training loop does, the model config's `grad_scale_func` is the optimizer's `scale_loss`: the
    forward/backward schedule multiplies each micro-batch's loss by the current loss scale before backward, and the
    optimizer divides the gradients by it again (fp16: dynamic scaling from `FP16_INITIAL_LOSS_SCALE`, halved after
    overflows, a step with inf/nan gradients skipped; bf16/fp32: scale 1).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = OptimizerConfig(
        optimizer="adam",
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.beta1,
        adam_beta2=opt.beta2,
        clip_grad=opt.clip_grad,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        params_dtype=_dtype(precision),
        use_distributed_optimizer=False,
        initial_loss_scale=FP16_INITIAL_LOSS_SCALE,
    )
    optimizer = get_megatron_optimizer(config, [ddp_model])
    ddp_model.config.grad_scale_func = optimizer.scale_loss
    if opt.decay_samples is None:
        style, decay = "constant", opt.warmup_samples + 1
    else:
        style, decay = opt.decay_style, max(opt.decay_samples, opt.warmup_samples + 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if opt.warmup_samples > 0 else opt.lr,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=opt.warmup_samples,
        lr_decay_steps=decay,
        lr_decay_style=style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def optim_settings(spec_optimizer) -> OptimSettings:
    """From `spec.trainer.optimizer` (api.models.OptimizerSpec)."""
    o = spec_optimizer
    return OptimSettings(
        lr=o.lr, min_lr=o.min_lr, warmup_samples=o.warmup_samples, decay_samples=o.decay_samples,
        decay_style=o.decay_style, weight_decay=o.weight_decay, clip_grad=o.clip_grad,
        beta1=o.adam_beta1, beta2=o.adam_beta2,
    )
