"""A TrainingRun spec's memory plan: the spec's fields as the plain settings of `trainingrun.modeling.memory` (the one
plan function), the plan, and what does not fit as (field, message) pairs. `trainingrun validate` and every manifest
loader (`api.checks`), the operator (`operator.checks`) and `trainingrun plan` (`api.memory_cli`) all come here.

The model: a preset or explicit sizes resolve from the spec alone; a `model.hf` model needs its config.json, read
where the directory is (`read_hf=True`: `validate`, `plan`, the trainer's own loader at start-up) and not otherwise
(the operator: the directory is on the pods' volume), or from `hf_config` (a directory holding a config.json, for
planning a model that is not on this machine: `trainingrun plan --hf-config DIR`). No model, no plan (None).
"""

from __future__ import annotations

from pathlib import Path

from trainingrun.api.models import TrainingRun, TrainingRunSpec
from trainingrun.modeling.architecture import Architecture, check_parallel
from trainingrun.modeling.hf_config import read_hf_architecture
from trainingrun.modeling.memory import (
    VLLM_GPU_MEMORY_UTILIZATION,
    VLLM_MAX_NUM_BATCHED_TOKENS,
    VLLM_MAX_NUM_SEQS,
    EngineSettings,
    MemoryPlan,
    SyncSettings,
    TrainerSettings,
    memory_plan,
)


def resolve_model(spec: TrainingRunSpec, *, read_hf: bool = True, hf_config: str | Path | None = None
                  ) -> Architecture | None:
    """The spec's architecture for planning, or None where it cannot be known here (module docstring) or the model
    is refused (reported by the checks that resolve it)."""
    model = spec.model
    try:
        if model.hf is not None and hf_config is not None:
            return read_hf_architecture(hf_config, seq_length=model.seq_length, precision=model.precision,
                                        transformer_impl=model.transformer_impl,
                                        ).replace(attention_backend=model.attention_backend, hf=model.hf)
        if model.hf is not None and (not read_hf or not (Path(model.hf) / "config.json").is_file()):
            return None
        arch = model.resolved()
        check_parallel(arch, spec.trainer.tensor_parallel_size, spec.trainer.expert_parallel_size)
    except ValueError:
        return None
    return arch


def _vllm_arg(args: list[str], name: str, cast, default):
    """The value of `--name V` or `--name=V` in vLLM's extra arguments (the last one wins), else `default`."""
    value = default
    for i, arg in enumerate(args):
        text = None
        if arg == name and i + 1 < len(args):
            text = args[i + 1]
        elif arg.startswith(name + "="):
            text = arg.split("=", 1)[1]
        if text is not None:
            try:
                value = cast(text)
            except ValueError:
                pass  # vLLM refuses it at start-up, naming it
    return value


def plan_settings(spec: TrainingRunSpec, arch: Architecture
                  ) -> tuple[TrainerSettings, EngineSettings | None, SyncSettings]:
    """The plan's settings from a spec (`modeling.memory`): the trainer's, the run's own vLLM servers' (None when
    the run starts none) and the weight sync's."""
    ts = spec.trainer
    perf, pl = ts.performance, ts.policy_loss
    generated = spec.rollout.source.type == "generate"
    if ts.max_tokens_per_gpu is not None:
        tokens, token_field = ts.max_tokens_per_gpu, "trainer.maxTokensPerGPU"
    else:
        tokens, token_field = (ts.micro_batch_size or 1) * arch.seq_length, "trainer.microBatchSize"
    trainer = TrainerSettings(
        gpus_per_replica=ts.gpus_per_replica, tensor_parallel=ts.tensor_parallel_size,
        pipeline_parallel=ts.pipeline_parallel_size, expert_parallel=ts.expert_parallel_size,
        data_parallel=ts.data_parallel_size, tokens=tokens, token_field=token_field,
        distributed_optimizer=ts.optimizer.distributed, grad_reduce_dtype=perf.grad_reduce_dtype,
        recompute=perf.recompute.granularity, recompute_method=perf.recompute.method,
        recompute_num_layers=perf.recompute.num_layers,
        gradient_accumulation_fusion=perf.gradient_accumulation_fusion,
        reference_model=ts.loss_type == "ppo" and pl.kl_coef > 0,
        entropy=generated or (ts.loss_type != "sft" and pl.entropy_coef > 0),
        gpu_memory_gib=ts.gpu_memory_gib,
        lora_rank=ts.lora.rank if ts.lora is not None else 0,
        lora_targets=tuple(ts.lora.targets) if ts.lora is not None else ())
    engine = None
    e = spec.rollout.engine
    if generated and e.type == "vllm" and e.url is None:
        v = e.vllm
        engine = EngineSettings(
            replicas=e.replicas, gpus=v.gpus * v.nodes, dtype=v.dtype,  # TP over all nodes of a replica
            max_model_len=v.max_model_len or arch.seq_length,
            kv_cache_gib=v.kv_cache_gib,
            gpu_memory_utilization=_vllm_arg(v.args, "--gpu-memory-utilization", float, VLLM_GPU_MEMORY_UTILIZATION),
            max_num_batched_tokens=_vllm_arg(v.args, "--max-num-batched-tokens", int, VLLM_MAX_NUM_BATCHED_TOKENS),
            max_num_seqs=_vllm_arg(v.args, "--max-num-seqs", int, VLLM_MAX_NUM_SEQS),
            gpu_memory_gib=v.gpu_memory_gib)
    sync = SyncSettings(synced=generated, type=spec.weight_sync.type, bucket_mib=spec.weight_sync.bucket_mib,
                        versions_kept=spec.rollout.max_policy_lag + 1, engine_dtype=e.vllm.dtype)
    return trainer, engine, sync


def spec_plan(run: TrainingRun, *, read_hf: bool = True, hf_config: str | Path | None = None) -> MemoryPlan | None:
    """The memory plan of a (schema-valid) run; None when its model cannot be resolved here."""
    arch = resolve_model(run.spec, read_hf=read_hf, hf_config=hf_config)
    if arch is None:
        return None
    trainer, engine, sync = plan_settings(run.spec, arch)
    return memory_plan(arch, trainer, engine, sync)


def plan_problems(run: TrainingRun, *, read_hf: bool = True) -> list[tuple[str, str]]:
    """(spec field path, message) for each role whose plan does not fit its GPUs: the budget field, the role, the
    terms that overflow and the fields that change them. Empty when it fits, on CPUs, or without a model here."""
    plan = spec_plan(run, read_hf=read_hf)
    return [] if plan is None else plan.problems()
