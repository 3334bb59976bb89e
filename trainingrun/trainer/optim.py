"""The trainer's Megatron DDP wrapper, optimizer (AdamW, fp16 loss scaling) and LR scheduler counted in samples,
and Megatron's performance options (`spec.trainer.performance`, `optimizer.distributed`) checked for the device.

The model itself is built by `trainingrun.modeling.model.build_model`; Megatron is imported inside the functions
here because the CPU shim must be installed first (`modeling.model.prepare_device`).

Performance options (`performance_settings`): each is off by default; on a device where Megatron cannot run one it
is refused with a ValueError naming the field and what is missing (the trainer exits 78), never silently dropped.
The gradient-accumulation fusion needs CUDA and apex's extension, so it is refused on CPU; every other option trains
on CPU, the distributed optimizer's checkpoints resuming too (tests/integration/test_performance_options.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.model import AttentionChoice, ModelOptions, torch_dtype


@dataclass(frozen=True)
class DDPSettings:
    """What the DDP wrapper and the optimizer do besides the math (`spec.trainer.performance`, `optimizer.distributed`):
    the defaults are the plain all-reduce of an fp32 gradient buffer after the backward pass."""

    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    grad_reduce_in_fp32: bool = True


def wrap_ddp(model, settings: DDPSettings = DDPSettings()):
    """Megatron DistributedDataParallel (gradients summed over DP then scaled by 1/DP; buffer type, overlap and the
    distributed optimizer's reduce-scatter as `settings` say)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # deferred: megatron
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads  # deferred: megatron

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=settings.grad_reduce_in_fp32, overlap_grad_reduce=settings.overlap_grad_reduce,
        overlap_param_gather=settings.overlap_param_gather,
        use_distributed_optimizer=settings.distributed_optimizer, average_in_collective=False,
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    ddp.broadcast_params()  # identical start on every DP rank, whatever each one initialised
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    return ddp


def params_current(ddp) -> None:
    """Make every rank's parameters the updated ones before anything reads them outside a forward (a checkpoint, a
    weight publish): with the parameter-gather overlap the distributed optimizer's all-gather otherwise waits for the
    next forward. Collective over the data-parallel group; a no-op without the overlap."""
    if ddp.ddp_config.use_distributed_optimizer and ddp.ddp_config.overlap_param_gather:
        ddp.start_param_sync(force_sync=True)


def grad_accumulation_fusion_unavailable(device) -> str | None:
    """Why Megatron's gradient-accumulation fusion cannot run here (None: it can)."""
    if device.type != "cuda":
        return f"it runs CUDA kernels (device {device})"
    try:  # probed by name: an optional compiled extension of apex (CUDA machines only)
        importlib.import_module("fused_weight_gradient_mlp_cuda")
    except ImportError:
        return ("apex's fused_weight_gradient_mlp_cuda extension does not import (Megatron's output layer needs it "
                "under either layer spec)")
    return None


def performance_settings(trainer_spec, arch: Architecture, device, attention: AttentionChoice
                         ) -> tuple[ModelOptions, DDPSettings]:
    """`spec.trainer.performance` and `optimizer.distributed` (api.spec.trainer.TrainerSpec) for `arch` on `device`: the
    model's options (with the resolved `attention`) and the DDP settings. ValueError naming the field when the
    device cannot run an option, or numLayers does not fit the model (module docstring)."""
    perf, distributed = trainer_spec.performance, trainer_spec.optimizer.distributed
    fusion = perf.gradient_accumulation_fusion
    missing = grad_accumulation_fusion_unavailable(device) if fusion else None
    if missing:
        raise ValueError(f"trainer.performance.gradientAccumulationFusion: not available here: {missing}; allowed "
                         "here: false")
    rc = perf.recompute
    granularity = None if rc.granularity == "none" else rc.granularity
    method = layers = None
    if granularity == "full":
        method, layers = rc.method, rc.num_layers or 1
        if layers > arch.num_layers:
            raise ValueError(f"trainer.performance.recompute.numLayers: {layers} is more than the model's "
                             f"{arch.num_layers} layers; allowed: 1 to {arch.num_layers}")
        if method == "uniform" and arch.num_layers % layers:
            raise ValueError(f"trainer.performance.recompute.numLayers: {layers} does not divide the model's "
                             f"{arch.num_layers} layers into chunks (method uniform); allowed: a divisor of "
                             f"{arch.num_layers}, or method block")
    options = ModelOptions(attention=attention, recompute_granularity=granularity, recompute_method=method,
                           recompute_num_layers=layers, gradient_accumulation_fusion=fusion)
    ddp = DDPSettings(distributed_optimizer=distributed, overlap_grad_reduce=perf.overlap_grad_reduce,
                      overlap_param_gather=perf.overlap_param_gather,
                      grad_reduce_in_fp32=perf.grad_reduce_dtype == "fp32")
    return options, ddp


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
    """`get_megatron_optimizer` (AdamW; the distributed optimizer when `ddp_model` was wrapped for it) and an
    `OptimizerParamScheduler` whose steps are samples.

    The scheduler counts samples: warmup over `warmup_samples`, decay until `decay_samples`, and the trainer calls
    `step(increment=GBS_s)`. Megatron requires warmup < decay: with decay unset the LR stays constant after warmup
    (style constant, decay length warmup + 1); with warmup == decay the decay length is warmup + 1 sample.

    As Megatron's own training loop does, the model config's `grad_scale_func` is the optimizer's `scale_loss`: the
    forward/backward schedule multiplies each micro-batch's loss by the current loss scale before backward, and the
    optimizer divides the gradients by it again (fp16: dynamic scaling from `FP16_INITIAL_LOSS_SCALE`, halved after
    overflows, a step with inf/nan gradients skipped; bf16/fp32: scale 1).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # deferred: megatron
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # deferred: megatron

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
        params_dtype=torch_dtype(precision),
        use_distributed_optimizer=ddp_model.ddp_config.use_distributed_optimizer,
        overlap_param_gather=ddp_model.ddp_config.overlap_param_gather,
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
    """From `spec.trainer.optimizer` (api.spec.trainer.OptimizerSpec)."""
    o = spec_optimizer
    return OptimSettings(
        lr=o.lr, min_lr=o.min_lr, warmup_samples=o.warmup_samples, decay_samples=o.decay_samples,
        decay_style=o.decay_style, weight_decay=o.weight_decay, clip_grad=o.clip_grad,
        beta1=o.adam_beta1, beta2=o.adam_beta2,
    )
