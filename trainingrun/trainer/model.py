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


def layer_spec(device: torch.device):
    """TransformerEngine spec on GPU when TE is installed; else the local spec with the packed SDPA core attention."""
    if device.type == "cuda":
        try:
            import transformer_engine  # noqa: F401
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            return get_gpt_layer_with_transformer_engine_spec()
        except ImportError:
            pass
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from trainingrun.trainer.attention import PackedSDPAttention

    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = PackedSDPAttention
    return spec


def build_gpt(sizes: dict[str, Any], device: torch.device):
    """A Megatron `GPTModel` (RoPE, untied output layer, no dropout: runs are reproducible) from resolved sizes."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    dtype = _dtype(str(sizes.get("precision", "fp32")))
    config = TransformerConfig(
        num_layers=int(sizes["num_layers"]),
        hidden_size=int(sizes["hidden_size"]),
        num_attention_heads=int(sizes["num_attention_heads"]),
        ffn_hidden_size=int(sizes["ffn_hidden_size"]),
        use_cpu_initialization=device.type == "cpu",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        add_bias_linear=False,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(device),
        vocab_size=int(sizes["vocab_size"]),
        max_sequence_length=int(sizes["seq_length"]),
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    return model.to(device)


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
    )
    optimizer = get_megatron_optimizer(config, [ddp_model])
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
