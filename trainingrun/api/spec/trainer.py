"""`spec.trainer`: the trainer pods (data-parallel ranks, parallelism, micro-batching), the loss and its policy
options, the advantage estimator, the optimizer and LR schedule, checkpoints and Megatron's performance options.

The enums of the loss and the advantages are named here once (`LossType`, `AdvantageEstimator`, ...): the programs
that implement them take their values from these aliases (`typing.get_args`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trainingrun.api.spec.base import (
    CLAIMS_RULE,
    MAX_RESOURCE_CLAIMS,
    MAX_SAMPLES,
    MAX_SAMPLES_PER_ROLLOUT,
    MAX_SECONDS,
    MAX_TOKENS,
    ApiModel,
    PodResourceClaim,
    ResourceRequirements,
    Rule,
    check_claims,
)

LossType = Literal["sft", "policy_gradient", "ppo"]
LossNormalization = Literal["sample", "token"]
OldLogprobs = Literal["engine", "trainer"]  # pi_old of the policy ratio
CorrectionType = Literal["none", "tis", "mask"]  # policyLoss.rolloutCorrection.type
Level = Literal["token", "sequence"]  # per token or per sequence: rolloutCorrection.level, policyLoss.ratioLevel
AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"]
StdNormalization = Literal["population", "unbiased"]
LoRATarget = Literal["attention_qkv", "attention_out", "mlp_in", "mlp_out", "experts"]  # = modeling.lora_targets


class OptimizerSpec(ApiModel):
    """AdamW with a warmup + decay schedule counted in samples (the global batch size varies per step)."""

    CEL_RULES = (
        Rule(name="min-lr-at-most-lr", rule="self.minLr <= self.lr", message="minLr must be <= lr",
             fieldPath=".minLr"),
        Rule(
            name="warmup-within-decay",
            rule="!has(self.decaySamples) || self.warmupSamples <= self.decaySamples",
            message="warmupSamples must be <= decaySamples",
            fieldPath=".warmupSamples",
        ),
    )

    lr: float = Field(3e-4, gt=0, le=1, description="Peak learning rate.")
    min_lr: float = Field(0.0, ge=0, le=1, description="Learning rate at the end of the decay.")
    warmup_samples: int = Field(0, ge=0, le=MAX_SAMPLES, description="Samples of linear warmup from 0 to lr.")
    decay_samples: int | None = Field(
        None, ge=1, le=MAX_SAMPLES,
        description="Samples (warmup included) after which lr reaches minLr; unset: no decay."
    )
    decay_style: Literal["cosine", "linear", "constant"] = Field("cosine", description="Shape of the decay.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay.")
    clip_grad: float = Field(1.0, ge=0, le=1e6, description="Gradient norm clipping; 0 turns clipping off.")
    adam_beta1: float = Field(0.9, gt=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, gt=0, lt=1, description="AdamW beta2.")
    distributed: bool = Field(
        False, description="Megatron's distributed optimizer (ZeRO-1): the fp32 main parameters and Adam moments are "
        "sharded over the data-parallel ranks (their memory / DP), gradients are reduce-scattered and parameters "
        "all-gathered after each step instead of one all-reduce (the same bytes on the wire). Its checkpoints load at "
        "any data-parallel size, not at another tensorParallelSize, and not into the plain optimizer (or back).")

    @model_validator(mode="after")
    def _rules(self) -> OptimizerSpec:
        if self.min_lr > self.lr:
            raise ValueError(self.cel_rule("min-lr-at-most-lr").message)
        if self.decay_samples is not None and self.warmup_samples > self.decay_samples:
            raise ValueError(self.cel_rule("warmup-within-decay").message)
        return self


class CheckpointSpec(ApiModel):
    """Periodic checkpoints of model, optimizer, scheduler and progress; trainers resume from the newest."""

    interval: int = Field(0, ge=0, le=MAX_SECONDS, description="Save every `interval` optimizer steps; 0 saves only at the end.")
    path: str = Field("/checkpoints", min_length=1, description="Directory (a shared volume in a cluster).")
    keep: int = Field(2, ge=1, le=1000, description="Complete checkpoints kept; older ones are deleted.")


class RolloutCorrectionSpec(ApiModel):
    """Correction of the train–inference mismatch (docs/rl.md, "Policy loss"): ρ = π_old/π_engine per token,
    or at level sequence the geometric mean of the sample's per-token ρ."""

    CEL_RULES = (
        Rule(name="lower-threshold-for-mask", rule="!has(self.lowerThreshold) || self.type == 'mask'",
             message="rolloutCorrection.lowerThreshold is for type mask only", fieldPath=".lowerThreshold"),
        Rule(name="lower-below-threshold", rule="!has(self.lowerThreshold) || self.lowerThreshold < self.threshold",
             message="rolloutCorrection.lowerThreshold must be below threshold", fieldPath=".lowerThreshold"),
    )

    type: CorrectionType = Field(
        "none", description="none; tis: each token's loss times min(ρ, threshold) (truncated importance sampling); "
                            "mask: tokens (level token) or whole samples (level sequence) whose ρ lies outside "
                            "[lowerThreshold, threshold] are left out of the loss.")
    level: Level = Field(
        "token", description="token: ρ per token; sequence: the geometric mean of the sample's per-token ρ.")
    threshold: float = Field(2.0, ge=1.0, le=1e6, description="Upper bound of ρ (tis truncates at it).")
    lower_threshold: float | None = Field(None, ge=0.0, le=1.0,
                                          description="mask: lower bound of ρ; unset: 1 / threshold.")

    @model_validator(mode="after")
    def _rules(self) -> RolloutCorrectionSpec:
        if self.lower_threshold is not None and self.type != "mask":
            raise ValueError(self.cel_rule("lower-threshold-for-mask").message)
        if self.lower_threshold is not None and not self.lower_threshold < self.threshold:
            raise ValueError(self.cel_rule("lower-below-threshold").message)
        return self


class PolicyLossSpec(ApiModel):
    """The policy objectives of generated rollouts (docs/rl.md, "Policy loss"): the clipped importance-sampling
    objective (PPO/GRPO) with separate low/high clip (DAPO's clip-higher), optional dual clip, token or sequence
    (GSPO) ratios, the old policy, the train–inference mismatch correction and an entropy bonus."""

    clip_low: float = Field(0.2, ge=0.0, le=1.0, description="The ratio is clipped below at 1 - clipLow.")
    clip_high: float = Field(0.28, ge=0.0, le=10.0, description="The ratio is clipped above at 1 + clipHigh.")
    kl_coef: float = Field(0.0, ge=0.0, le=100.0, description="Weight of the KL penalty to the initial policy (k3 "
                                                              "estimator); 0: off (no reference model).")
    old_logprobs: OldLogprobs = Field(
        "engine", description="pi_old of the ratio: the engine's log-probabilities, or the trainer's own from a "
                              "forward-only pass before a rollout's first update (the engine's then stay the "
                              "behaviour policy of rolloutCorrection).")
    rollout_correction: RolloutCorrectionSpec = Field(
        default_factory=lambda: RolloutCorrectionSpec(),
        description="Correction of the gap between the engine's and the trainer's log-probabilities.")
    ratio_level: Level = Field(
        "token", description="ppo: token ratios, or sequence (GSPO): the sample's length-normalised sequence ratio, "
                             "clipped per sequence.")
    clip_ratio_c: float = Field(3.0, gt=1.0, le=1000.0,
                                description="ppo dual clip: the loss of a negative advantage is at most "
                                            "-A * clipRatioC (verl's default 3); other losses ignore it.")
    entropy_coef: float = Field(0.0, ge=0.0, le=10.0,
                                description="Entropy bonus: the loss minus entropyCoef times the policy's entropy "
                                            "at each trained token; 0: off.")


class AdvantageSpec(ApiModel):
    """How the rollout turns a group's rewards into advantages (docs/rl.md, "Advantages"), once per group."""

    estimator: AdvantageEstimator = Field(
        "grpo", description="grpo: (r - group mean) / (group std + 1e-6); dr_grpo: r - group mean; rloo: r - mean of "
                            "the group's other rewards; reinforce_pp: r - group mean, then normalised over the step.")
    std_normalization: StdNormalization = Field(
        "population", description="The std of grpo's group and of reinforce_pp's step: population (/n) or unbiased "
                                  "(/(n - 1)).")


class TrainerMoESpec(ApiModel):
    """How a mixture-of-experts model trains (ignored for a dense model)."""

    routing_replay: bool = Field(
        False, description="Route every generated token through the experts the generator chose for it (the "
        "in-process megatron engine records them), so the trainer's log-probabilities match the generator's at "
        "maxPolicyLag 0. Needs generated rollouts with rollout.engine.type megatron.")
    aux_loss_coeff: float | None = Field(
        None, ge=0.0, le=100.0, description="Coefficient of the per-sample load-balancing loss; unset: the model's "
        "(config.json router_aux_loss_coef, 0 for a model without model.hf); 0: off.")


class RecomputeSpec(ApiModel):
    """Activation recomputation: keep fewer activations for the backward pass and compute them again there."""

    CEL_RULES = (
        Rule(name="layers-for-full", rule="!has(self.numLayers) || self.granularity == 'full'",
             message="recompute.numLayers is for granularity full only", fieldPath=".numLayers"),
        Rule(name="block-needs-layers",
             rule="self.granularity != 'full' || self.method != 'block' || has(self.numLayers)",
             message="recompute method block needs recompute.numLayers (how many layers are recomputed)",
             fieldPath=".numLayers"),
    )

    granularity: Literal["none", "selective", "full"] = Field(
        "none", description="none: every activation kept. selective: the core attention is recomputed in backward "
        "(its inputs kept; costs about one more attention forward; saves its output and log-sum-exp). full: whole layers are recomputed from their inputs (costs about one more forward of those "
        "layers, ~1/3 more compute when all are; saves their activations).")
    method: Literal["uniform", "block"] = Field(
        "uniform", description="full only. uniform: the layers are split into chunks of numLayers (default 1) and "
        "only each chunk's input is kept; block: the first numLayers layers are recomputed, the others keep their "
        "activations.")
    num_layers: int | None = Field(None, ge=1, le=1024, description="full only: layers per chunk (uniform, default "
                                   "1) or layers recomputed (block); at most model.numLayers.")

    @model_validator(mode="after")
    def _rules(self) -> RecomputeSpec:
        if self.num_layers is not None and self.granularity != "full":
            raise ValueError(self.cel_rule("layers-for-full").message)
        if self.granularity == "full" and self.method == "block" and self.num_layers is None:
            raise ValueError(self.cel_rule("block-needs-layers").message)
        return self


class PerformanceSpec(ApiModel):
    """Megatron's speed switches. Every default is the safe one (nothing overlapped, fp32 gradient reduction, no
    recomputation, no fusion); docs/trainer.md ("Performance options") gives what each costs and saves."""

    overlap_grad_reduce: bool = Field(
        False, description="Reduce gradients bucket by bucket while the backward of the last micro-batch still runs "
        "(hides the data-parallel all-reduce / reduce-scatter behind compute; same result).")
    overlap_param_gather: bool = Field(
        False, description="With optimizer.distributed: all-gather the updated parameters during the next forward, "
        "layer by layer, instead of right after the optimizer step (same result).")
    grad_reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="Type of the gradient buffer and its data-parallel reduction. bf16 (model.precision "
        "bf16) halves the buffer's memory and the bytes reduced, at the cost of rounding the accumulated gradient "
        "(8 mantissa bits) over micro-batches and ranks; the optimizer still updates fp32 main parameters.")
    recompute: RecomputeSpec = Field(default_factory=RecomputeSpec, description="Activation recomputation.")
    gradient_accumulation_fusion: bool = Field(
        False, description="Fuse the weight-gradient matmul with its accumulation into the fp32 gradient buffer (one "
        "kernel, no temporary gradient). Needs CUDA and apex's fused_weight_gradient_mlp_cuda extension (Megatron's "
        "own output layer uses it under either layer spec); refused without them.")


class LoRASpec(ApiModel):
    """Low-rank adapters (docs/trainer.md, "LoRA"): the base weights are frozen (no gradients, no optimizer state),
    each targeted linear layer gains (alpha / rank) · B · A · dropout(x), one adapter per Hugging Face projection (as
    PEFT's), A drawn from the run's seed, B zero. The rank is checked against the resolved model (at most the smaller
    dimension of every targeted projection) where the model is known."""

    CEL_RULES = (
        Rule(name="targets-unique", rule="!has(self.targets) || self.targets.all(t, self.targets.exists_one(u, u == t))",
             message="lora.targets must not repeat a target", fieldPath=".targets"),
    )

    rank: int = Field(..., ge=1, le=1024, description="Rank r of every adapter (A: r x in, B: out x r).")
    alpha: float | None = Field(None, gt=0, le=1e6, description="The adapters' output is scaled by alpha / rank; "
                                "unset: 2 x rank (a scale of 2).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input (not the base's) while "
                           "training; 0: off.")
    targets: list[LoRATarget] = Field(
        default_factory=lambda: ["attention_qkv", "attention_out", "mlp_in", "mlp_out"], min_length=1, max_length=5,
        description="Linear layers that get adapters: attention_qkv (q, k, v projections), attention_out (o), mlp_in "
        "(gate and up), mlp_out (down) — of a mixture of experts its dense MLP layers —, experts (a mixture of "
        "experts' routed experts: an adapter per expert on its fused gate/up and one on its down; not with "
        "rollout.engine.type vllm).")

    @model_validator(mode="after")
    def _rules(self) -> LoRASpec:
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(self.cel_rule("targets-unique").message)
        return self

    @property
    def resolved_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank


class TrainerSpec(ApiModel):
    """The trainer pods: data-parallel ranks, parallelism, micro-batching, loss and optimizer."""

    CEL_RULES = (
        CLAIMS_RULE,
        Rule(
            name="one-micro-batching",
            rule="has(self.maxTokensPerGPU) != has(self.microBatchSize)",
            message="set exactly one of maxTokensPerGPU (dynamic micro-batches) and microBatchSize (static)",
        ),
        Rule(
            name="parallel-sizes-divide-world",
            rule="(self.replicas * (self.gpusPerReplica > 0 ? self.gpusPerReplica : 1)) %"
            " (self.tensorParallelSize * self.pipelineParallelSize) == 0",
            message="replicas × max(gpusPerReplica, 1) must be divisible by tensorParallelSize × pipelineParallelSize",
            fieldPath=".replicas",
        ),
        Rule(
            name="ppo-correction-needs-trainer-old-logprobs",
            rule="self.lossType != 'ppo' || !has(self.policyLoss) || !has(self.policyLoss.rolloutCorrection) || "
            "self.policyLoss.rolloutCorrection.type == 'none' || self.policyLoss.oldLogprobs == 'trainer'",
            message="policyLoss.rolloutCorrection with lossType ppo needs policyLoss.oldLogprobs trainer (with "
            "oldLogprobs engine pi_old is the engine's own, so rho = pi_old / pi_engine is 1 and nothing is corrected)",
            fieldPath=".policyLoss.rolloutCorrection",
        ),
        Rule(
            name="sft-has-no-old-policy",
            rule="self.lossType != 'sft' || !has(self.policyLoss) || (self.policyLoss.oldLogprobs == 'engine' && "
            "(!has(self.policyLoss.rolloutCorrection) || self.policyLoss.rolloutCorrection.type == 'none'))",
            message="lossType sft has no policy ratio: policyLoss.oldLogprobs trainer and rolloutCorrection need "
            "lossType ppo or policy_gradient",
            fieldPath=".policyLoss",
        ),
        Rule(
            name="ratio-options-need-ppo",
            rule="self.lossType == 'ppo' || !has(self.policyLoss) || self.policyLoss.ratioLevel == 'token'",
            message="policyLoss.ratioLevel sequence shapes the ppo ratio: it needs lossType ppo",
            fieldPath=".policyLoss",
        ),
        Rule(
            name="expert-parallel-divides-data-parallel",
            rule="(self.replicas * (self.gpusPerReplica > 0 ? self.gpusPerReplica : 1)) %"
            " (self.tensorParallelSize * self.pipelineParallelSize * self.expertParallelSize) == 0",
            message="expertParallelSize must divide the data-parallel size (replicas × max(gpusPerReplica, 1) / "
            "(tensorParallelSize × pipelineParallelSize)): the experts are split within the data-parallel group",
            fieldPath=".expertParallelSize",
        ),
        Rule(
            name="param-gather-overlap-needs-distributed-optimizer",
            rule="!has(self.performance) || !has(self.performance.overlapParamGather)"
            " || !self.performance.overlapParamGather"
            " || (has(self.optimizer) && has(self.optimizer.distributed) && self.optimizer.distributed)",
            message="performance.overlapParamGather overlaps the distributed optimizer's parameter all-gather: set "
            "optimizer.distributed true, or overlapParamGather false",
            fieldPath=".performance.overlapParamGather",
        ),
        # What the trainer's extra passes do not run under yet (docs/trainer.md, "Parallelism: what runs, what is
        # refused"): the frozen reference model of the KL penalty and the forward-only pi_old pass.
        Rule(
            name="kl-penalty-not-pipelined",
            rule="self.pipelineParallelSize == 1 || self.lossType != 'ppo' || !has(self.policyLoss)"
            " || self.policyLoss.klCoef == 0.0",
            message="policyLoss.klCoef > 0 (lossType ppo) needs the reference model, which is not pipelined "
            "(pipelineParallelSize > 1); allowed: klCoef 0, or pipelineParallelSize 1",
            fieldPath=".policyLoss.klCoef",
        ),
        Rule(
            name="trainer-old-logprobs-not-pipelined",
            rule="self.pipelineParallelSize == 1 || !has(self.policyLoss) || self.policyLoss.oldLogprobs != 'trainer'",
            message="policyLoss.oldLogprobs trainer recomputes pi_old by a forward-only pass that is not pipelined yet "
            "(pipelineParallelSize > 1); allowed: oldLogprobs engine, or pipelineParallelSize 1",
            fieldPath=".policyLoss.oldLogprobs",
        ),
        Rule(
            name="trainer-old-logprobs-not-expert-parallel",
            rule="self.expertParallelSize == 1 || !has(self.policyLoss) || self.policyLoss.oldLogprobs != 'trainer'",
            message="policyLoss.oldLogprobs trainer recomputes pi_old by a forward-only pass that does not yet pad the "
            "micro-batches of an expert-parallel group nor replay routes (expertParallelSize > 1); allowed: "
            "oldLogprobs engine, or expertParallelSize 1",
            fieldPath=".policyLoss.oldLogprobs",
        ),
    )

    replicas: int = Field(1, ge=1, le=4096, description="Trainer pods; with one process each, the data-parallel ranks.")
    gpus_per_replica: int = Field(0, ge=0, le=16, description="GPUs per trainer pod (nvidia.com/gpu); 0 trains on CPU.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="Megatron tensor-parallel size.")
    pipeline_parallel_size: int = Field(1, ge=1, le=256, description="Megatron pipeline-parallel size.")
    expert_parallel_size: int = Field(
        1, ge=1, le=1024, description="Expert-parallel size (mixtures of experts): each group of this many "
        "data-parallel ranks splits the experts between them; it must divide the data-parallel size and the experts.")
    moe: TrainerMoESpec = Field(default_factory=TrainerMoESpec, description="Mixture-of-experts training settings.")
    lora: LoRASpec | None = Field(None, description="Train low-rank adapters on the frozen base instead of every "
                                  "weight; unset: full training.")
    max_tokens_per_gpu: int | None = Field(
        None, ge=1, le=MAX_TOKENS, alias="maxTokensPerGPU", description="Dynamic micro-batches: token cap per micro-batch."
    )
    micro_batch_size: int | None = Field(None, ge=1, le=MAX_SAMPLES_PER_ROLLOUT, description="Static micro-batches: samples per micro-batch.")
    microbatch_multiple: int = Field(
        1, ge=1, le=1024, description="Micro-batches per rank per step are a multiple of this (virtual pipeline)."
    )
    loss_type: LossType = Field(
        "sft", description="Masked cross-entropy, policy gradient, or ppo: the clipped importance-sampling objective "
                           "against the generator's log-probabilities (generated rollouts).")
    policy_loss: PolicyLossSpec = Field(default_factory=lambda: PolicyLossSpec(),
                                        description="Settings of the policy losses (ppo, policy_gradient).")
    advantage: AdvantageSpec = Field(default_factory=lambda: AdvantageSpec(),
                                     description="Advantage estimator of generated and synthetic rollouts.")
    loss_normalization: LossNormalization = Field(
        "sample", description="Divide by the step's samples (mean over each sample's tokens) or its loss tokens."
    )
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec, description="Optimizer and LR schedule.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpointing.")
    performance: PerformanceSpec = Field(default_factory=PerformanceSpec,
                                         description="Megatron's performance options (all off by default).")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="Resources of each trainer container."
    )
    resource_claims: list[PodResourceClaim] = Field(
        default_factory=list, max_length=MAX_RESOURCE_CLAIMS,
        description="Devices each trainer pod claims by dynamic resource allocation (core/v1 PodResourceClaim); "
        "with claims the GPUs come from them (no nvidia.com/gpu is requested) and gpusPerReplica says how many GPUs "
        "the claims give each pod (its processes and the memory plan count them).")
    gpu_memory_gib: float = Field(
        80.0, gt=0, le=65536, alias="gpuMemoryGiB",
        description="Memory of one trainer GPU in GiB, as nvidia-smi reports it (80 for an A100/H100 80GB, 140 for an "
        "H200): the "
        "memory plan's budget. `trainingrun validate` and the operator refuse a run whose plan (`trainingrun plan`: "
        "weights, gradients, optimizer states, activations and logits at the token cap, attention, sync buffers, per "
        "GPU) does not fit, naming the terms and the fields that change them. Not checked for CPU trainers "
        "(gpusPerReplica 0).")

    @model_validator(mode="after")
    def _rules(self) -> TrainerSpec:
        if (self.max_tokens_per_gpu is None) == (self.micro_batch_size is None):
            raise ValueError(self.cel_rule("one-micro-batching").message)
        if self.world_size % (self.tensor_parallel_size * self.pipeline_parallel_size):
            raise ValueError(self.cel_rule("parallel-sizes-divide-world").message)
        pl = self.policy_loss
        correcting = pl.rollout_correction.type != "none"
        if self.loss_type == "ppo" and correcting and pl.old_logprobs != "trainer":
            raise ValueError(self.cel_rule("ppo-correction-needs-trainer-old-logprobs").message)
        if self.loss_type == "sft" and (pl.old_logprobs != "engine" or correcting):
            raise ValueError(self.cel_rule("sft-has-no-old-policy").message)
        if self.loss_type != "ppo" and pl.ratio_level != "token":
            raise ValueError(self.cel_rule("ratio-options-need-ppo").message)
        if self.world_size % (self.tensor_parallel_size * self.pipeline_parallel_size * self.expert_parallel_size):
            raise ValueError(self.cel_rule("expert-parallel-divides-data-parallel").message)
        if self.performance.overlap_param_gather and not self.optimizer.distributed:
            raise ValueError(self.cel_rule("param-gather-overlap-needs-distributed-optimizer").message)
        if self.pipeline_parallel_size > 1 and self.loss_type == "ppo" and pl.kl_coef > 0:
            raise ValueError(self.cel_rule("kl-penalty-not-pipelined").message)
        if self.pipeline_parallel_size > 1 and pl.old_logprobs == "trainer":
            raise ValueError(self.cel_rule("trainer-old-logprobs-not-pipelined").message)
        if self.expert_parallel_size > 1 and pl.old_logprobs == "trainer":
            raise ValueError(self.cel_rule("trainer-old-logprobs-not-expert-parallel").message)
        check_claims(self.resource_claims)
        return self

    @property
    def world_size(self) -> int:
        return self.replicas * max(self.gpus_per_replica, 1)

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_parallel_size * self.pipeline_parallel_size)
