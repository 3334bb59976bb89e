"""The trainer's Megatron DDP wrapper, optimizer (AdamW, fp16 loss scaling) and LR scheduler counted in samples.

The model itself is built by `trainingrun.modeling.model.build_model`; Megatron is imported inside the functions
here because the CPU shim must be installed first (`modeling.model.prepare_device`).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainingrun.modeling.model import torch_dtype


def wrap_ddp(model):
    """Megatron DistributedDataParallel (fp32 grad buffer, gradients summed over DP then scaled by 1/DP)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # deferred: megatron
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads  # deferred: megatron

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
