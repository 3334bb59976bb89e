"""TrainingRun spec and status models (`trainingrun.dev/v1alpha1`).

These pydantic models are the single source of the API: the CRD's OpenAPI schema is generated from them
(`trainingrun.api.crd`), and the cross-field rules are written once per model as CEL in `CEL_RULES` (they become the
CRD's `x-kubernetes-validations`) and mirrored in Python by the model validators below, so a spec loaded by the local
launcher, the rollout or the trainer is held to the same rules as one admitted by the API server. A test evaluates
every CEL rule with a real CEL engine beside its Python twin on passing and failing objects.

Field names are camelCase, as in every Kubernetes API; Python attribute names are snake_case.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, overload

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from trainingrun.api.constants import API_VERSION, KIND, MANAGED_BY_OPERATOR
from trainingrun.modeling.architecture import (
    ARCH_FIELDS,
    OPTIONAL_ARCH_FIELDS,
    TE_LAYERS_NEED_TE,
    TE_NEEDS_TE_LAYERS,
    Activation,
    Architecture,
    AttentionBackend,
    Family,
    Normalization,
    Precision,
    PresetName,
    TransformerImpl,
    resolve,
)
from trainingrun.modeling.hf_config import read_hf_architecture

# A Kubernetes resource quantity ("500m", "2Gi", 4). The CRD marks it x-kubernetes-int-or-string.
Quantity = int | str

# Every number of the API has bounds (a test walks the CRD schema to keep it so): a manifest cannot carry a value
# that some later computation overflows (a seed of 1e29, a clip threshold of 1e309).
INT64_MAX = 2**63 - 1
MAX_SEED = 2**32 - 1  # numpy's and torch's seeding accept it on every platform
MAX_SAMPLES = 2**53  # sample counts pass through float64 (LR schedule): exact up to 2^53
MAX_SECONDS = 2**31 - 1  # durations in seconds (~68 years)
MAX_TOKENS = 2**31 - 1  # token counts (token ids and offsets of one rank's payload are int32/int64)
MAX_LENGTH = 1_048_576  # sample length in tokens (= the largest model.seqLength)
MAX_SAMPLES_PER_ROLLOUT = 10_000_000


class Rule(BaseModel):
    """One cross-field rule: a CEL expression over `self` (the object it is attached to) and its message. `name`
    (unique within its model, not part of the CRD) is how the rule's Python twin and its test find it."""

    name: str
    rule: str
    message: str
    fieldPath: str | None = None  # noqa: N815 - Kubernetes' own name


class ApiModel(BaseModel):
    """Base: camelCase field names, unknown fields rejected, validated on assignment."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        allow_inf_nan=False,
    )
    # CEL rules attached to this object in the CRD (x-kubernetes-validations). Python twins: model validators, which
    # raise `ValueError(cls.cel_rule(name).message)`.
    CEL_RULES: ClassVar[tuple[Rule, ...]] = ()

    @classmethod
    def cel_rule(cls, name: str) -> Rule:
        """This model's CEL rule called `name`."""
        for rule in cls.CEL_RULES:
            if rule.name == name:
                return rule
        raise KeyError(f"{cls.__name__} has no CEL rule {name!r}; it has {[r.name for r in cls.CEL_RULES]}")

    def to_dict(self) -> dict[str, Any]:
        """The object as the API server would store it: camelCase, defaults filled in, unset optionals omitted."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class ResourceRequirements(ApiModel):
    """Compute resources of a container, as in a Pod spec."""

    requests: dict[str, Quantity] = Field(default_factory=dict, description="Minimum resources, e.g. cpu: 2.")
    limits: dict[str, Quantity] = Field(default_factory=dict, description="Maximum resources, e.g. memory: 8Gi.")


# --------------------------------------------------------------------------------------------------------- model
# The architecture tables (presets, family defaults, the fields that describe an architecture) and the resolved,
# typed value live in `trainingrun.modeling.architecture`; the fields below are their spec (and CRD) side.
def _camel(name: str) -> str:
    return to_camel(name)


class MoESpec(ApiModel):
    """A mixture-of-experts MLP (Qwen3-MoE / Mixtral style): SwiGLU experts behind a softmax top-k router, in every
    layer or every `sparseStep`-th one outside `denseLayers`. A model.hf model takes all of it from config.json."""

    CEL_RULES = (
        Rule(name="top-k-within-experts", rule="self.topK <= self.numExperts",
             message="topK must be <= numExperts", fieldPath=".topK"),
    )

    num_experts: int = Field(..., ge=1, le=1024, description="Routed experts per MoE layer.")
    top_k: int = Field(..., ge=1, le=64, description="Experts each token is routed to.")
    ffn_hidden_size: int = Field(..., ge=8, le=1048576, description="Hidden size of one expert's SwiGLU MLP.")
    norm_topk_prob: bool = Field(True, description="Renormalise the chosen experts' probabilities to sum 1 (Mixtral "
                                                   "and Qwen3-MoE do; false: the plain softmax probabilities).")
    sparse_step: int = Field(1, ge=1, le=1024, description="Every sparseStep-th layer is a mixture of experts.")
    dense_layers: list[Annotated[int, Field(ge=0, le=1023)]] = Field(
        default_factory=list, max_length=1024, description="Layer indices that keep a dense MLP (ffnHiddenSize).")
    shared_expert_ffn_size: int | None = Field(None, ge=8, le=1048576,
                                               description="A shared expert of this size beside the routed ones.")
    shared_expert_gate: bool = Field(False, description="Scale the shared expert by a sigmoid gate (Qwen2-MoE).")

    @model_validator(mode="after")
    def _rules(self) -> MoESpec:
        if self.top_k > self.num_experts:
            raise ValueError(self.cel_rule("top-k-within-experts").message)
        return self

    def fields(self) -> dict[str, Any]:
        """The `modeling.architecture.MoE` fields (snake_case)."""
        return self.model_dump(by_alias=False)


class ModelSpec(ApiModel):
    """The model to train: a Hugging Face directory (`hf`), a preset, explicit sizes, or a preset with some fields
    overridden. Architecture `gpt` is LayerNorm + GELU; `llama` is RMSNorm + SwiGLU + grouped-query attention (the
    Llama family, which exports to Hugging Face)."""

    CEL_RULES = (
        Rule(
            name="model-source",
            rule="has(self.hf) || has(self.preset) || (has(self.numLayers) && has(self.hiddenSize)"
            " && has(self.numAttentionHeads) && has(self.vocabSize) && has(self.seqLength))",
            message="set model.hf, model.preset, or all of numLayers, hiddenSize, numAttentionHeads, vocabSize and "
            "seqLength",
        ),
        Rule(
            name="heads-divide-hidden-size",
            rule="!has(self.hiddenSize) || !has(self.numAttentionHeads) || has(self.headDim)"
            " || self.hiddenSize % self.numAttentionHeads == 0",
            message="hiddenSize must be divisible by numAttentionHeads (or set headDim)",
            fieldPath=".hiddenSize",
        ),
        Rule(
            name="query-groups-divide-heads",
            rule="!has(self.numQueryGroups) || !has(self.numAttentionHeads)"
            " || self.numAttentionHeads % self.numQueryGroups == 0",
            message="numAttentionHeads must be divisible by numQueryGroups",
            fieldPath=".numQueryGroups",
        ),
        Rule(
            name="hf-alone",
            rule="!has(self.hf) || (!has(self.preset) && !has(self.architecture) && !has(self.numLayers)"
            " && !has(self.hiddenSize) && !has(self.numAttentionHeads) && !has(self.numQueryGroups)"
            " && !has(self.headDim) && !has(self.ffnHiddenSize) && !has(self.vocabSize) && !has(self.normalization)"
            " && !has(self.normEpsilon) && !has(self.activation) && !has(self.ropeBase) && !has(self.tieEmbeddings)"
            " && !has(self.addBiasLinear) && !has(self.addQkvBias) && !has(self.qkNorm) && !has(self.moe))",
            message="with model.hf the architecture and sizes come from its config.json: set only seqLength, "
            "precision, transformerImpl and attentionBackend beside it (not preset or architecture fields)",
            fieldPath=".hf",
        ),
        # The attention backend and the layer spec it runs in (docs/trainer.md, "Attention backends").
        Rule(name="te-attention-needs-te-layers",
             rule="self.attentionBackend != 'te' || self.transformerImpl != 'local'",
             message=TE_NEEDS_TE_LAYERS, fieldPath=".attentionBackend"),
        Rule(name="te-layers-need-te-attention",
             rule="self.transformerImpl != 'transformer_engine' || self.attentionBackend in ['auto', 'te']",
             message=TE_LAYERS_NEED_TE, fieldPath=".attentionBackend"),
        Rule(name="flash-needs-half-precision",
             rule="self.attentionBackend != 'flash' || self.precision != 'fp32'",
             message="model.attentionBackend flash runs in bf16 or fp16 (flash kernels have no fp32): set precision "
             "bf16 or fp16, or attentionBackend sdpa or auto", fieldPath=".attentionBackend"),
    )

    hf: str | None = Field(
        None, min_length=1,
        description="Local Hugging Face model directory (config.json, *.safetensors, tokenizer.json; in a cluster a "
        "path on a mounted volume): architecture, sizes, initial weights and the run's tokenizer. Nothing is "
        "downloaded.",
    )
    preset: PresetName | None = Field(
        None, description="Named model; explicit fields below override its values."
    )
    architecture: Family | None = Field(
        None, description="gpt: LayerNorm + GELU; llama: RMSNorm + SwiGLU + grouped-query attention. Default: the "
        "preset's, else gpt. Sets the defaults of the fields below."
    )
    num_layers: int | None = Field(None, ge=1, le=1024, description="Transformer layers.")
    hidden_size: int | None = Field(None, ge=8, le=65536, description="Hidden size.")
    num_attention_heads: int | None = Field(None, ge=1, le=1024, description="Attention (query) heads.")
    num_query_groups: int | None = Field(
        None, ge=1, le=1024, description="Key/value heads (grouped-query attention); default numAttentionHeads."
    )
    head_dim: int | None = Field(None, ge=1, le=4096, description="Size of one head (default hiddenSize / heads).")
    ffn_hidden_size: int | None = Field(
        None, ge=8, le=1048576, description="MLP hidden size (default 4 × hiddenSize for gpt, 8/3 × hiddenSize rounded up to a "
        "multiple of 64 for llama)."
    )
    vocab_size: int | None = Field(None, ge=2, le=1048576, description="Vocabulary size (token ids < vocabSize).")
    seq_length: int | None = Field(
        None, ge=8, le=1048576,
        description="Longest sample in tokens (positions). With hf: default and upper bound its max_position_embeddings.",
    )
    normalization: Normalization | None = Field(None, description="Norm layers (gpt: LayerNorm, "
                                                                              "llama: RMSNorm).")
    norm_epsilon: float | None = Field(None, gt=0, le=1, description="Epsilon of the norm layers (default 1e-5).")
    activation: Activation | None = Field(
        None, description="MLP activation: gelu, or swiglu (gated SiLU, as Llama). Default: gpt gelu, llama swiglu."
    )
    rope_base: float | None = Field(None, gt=0, le=1e12, description="Rotary position embedding base (theta; default 10000).")
    tie_embeddings: bool | None = Field(
        None, description="Share the input embedding with the output layer (default false)."
    )
    add_bias_linear: bool | None = Field(None, description="Biases in every linear layer (default false).")
    add_qkv_bias: bool | None = Field(
        None, description="Bias on the query/key/value projection only, as Qwen2 (default false)."
    )
    qk_norm: bool | None = Field(
        None, description="RMSNorm over each query and key head before RoPE, as Qwen3 (llama; default false)."
    )
    moe: MoESpec | None = Field(None, description="Mixture-of-experts MLPs (llama architecture; default: dense).")
    precision: Precision = Field("fp32", description="Parameter and compute precision.")
    transformer_impl: TransformerImpl = Field(
        "auto",
        description="Megatron layer implementation. auto: TransformerEngine on GPU in bf16/fp16 when it is "
        "installed, else local (Megatron's own layers with an SDPA core attention that handles packed sequences); "
        "transformer_engine: required (the trainer refuses to start without it or on CPU).",
    )
    attention_backend: AttentionBackend = Field(
        "auto",
        description="Attention of packed (THD) micro-batches. te: TransformerEngine's fused attention (in its layer "
        "spec: transformerImpl auto or transformer_engine); flash: torch's variable-length flash attention (CUDA, "
        "bf16/fp16; local spec); sdpa: torch SDPA, one causal call per packed sample (any device, memory linear in T; local spec). "
        "auto: te, then flash, then sdpa, the first the device offers (the trainer logs the choice). A named backend "
        "the device cannot run stops the trainer at start-up (exit 78) naming what is missing.",
    )

    @model_validator(mode="after")
    def _rules(self) -> ModelSpec:
        explicit = (self.num_layers, self.hidden_size, self.num_attention_heads, self.vocab_size, self.seq_length)
        if self.hf is None and self.preset is None and any(v is None for v in explicit):
            raise ValueError(self.cel_rule("model-source").message)
        if self.hidden_size is not None and self.num_attention_heads is not None and self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(self.cel_rule("heads-divide-hidden-size").message)
        if self.num_query_groups is not None and self.num_attention_heads is not None:
            if self.num_attention_heads % self.num_query_groups:
                raise ValueError(self.cel_rule("query-groups-divide-heads").message)
        if self.hf is not None:
            clash = [_camel(k) for k in ("preset", *ARCH_FIELDS, *OPTIONAL_ARCH_FIELDS) if getattr(self, k) is not None]
            if clash:
                raise ValueError(f"{self.cel_rule('hf-alone').message}; remove {', '.join(clash)}")
        if self.attention_backend == "te" and self.transformer_impl == "local":
            raise ValueError(self.cel_rule("te-attention-needs-te-layers").message)
        if self.transformer_impl == "transformer_engine" and self.attention_backend not in ("auto", "te"):
            raise ValueError(self.cel_rule("te-layers-need-te-attention").message)
        if self.attention_backend == "flash" and self.precision == "fp32":
            raise ValueError(self.cel_rule("flash-needs-half-precision").message)
        return self

    @overload
    def resolved(self) -> Architecture: ...
    @overload
    def resolved(self, read_hf: bool) -> Architecture | None: ...

    def resolved(self, read_hf: bool = True) -> Architecture | None:
        """The model's architecture (`trainingrun.modeling.architecture.Architecture`): of the preset and explicit
        fields, or read from `hf`'s config.json (`modeling.hf_config.read_hf_architecture`). ValueError naming the
        field on a bad combination. Each process calls it once and passes the value down. `read_hf=False` skips the
        I/O where the directory is not mounted (the operator): it checks what the spec itself says and returns None
        for an `hf` model."""
        if self.hf is not None:
            if not read_hf:
                return None
            return read_hf_architecture(self.hf, seq_length=self.seq_length, precision=self.precision,
                                        transformer_impl=self.transformer_impl,
                                        ).replace(attention_backend=self.attention_backend)
        return resolve(self.preset, precision=self.precision, transformer_impl=self.transformer_impl,
                       attention_backend=self.attention_backend, seq_length=self.seq_length,
                       **{k: getattr(self, k) for k in ARCH_FIELDS},
                       qk_norm=self.qk_norm, moe=None if self.moe is None else self.moe.fields())


# ------------------------------------------------------------------------------------------------------- trainer
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

    type: Literal["none", "tis", "mask"] = Field(
        "none", description="none; tis: each token's loss times min(ρ, threshold) (truncated importance sampling); "
                            "mask: tokens (level token) or whole samples (level sequence) whose ρ lies outside "
                            "[lowerThreshold, threshold] are left out of the loss.")
    level: Literal["token", "sequence"] = Field(
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
    old_logprobs: Literal["engine", "trainer"] = Field(
        "engine", description="pi_old of the ratio: the engine's log-probabilities, or the trainer's own from a "
                              "forward-only pass before a rollout's first update (the engine's then stay the "
                              "behaviour policy of rolloutCorrection).")
    rollout_correction: RolloutCorrectionSpec = Field(
        default_factory=lambda: RolloutCorrectionSpec(),
        description="Correction of the gap between the engine's and the trainer's log-probabilities.")
    ratio_level: Literal["token", "sequence"] = Field(
        "token", description="ppo: token ratios, or sequence (GSPO): the sample's length-normalised sequence ratio, "
                             "clipped per sequence.")
    clip_ratio_c: float | None = Field(None, gt=1.0, le=1000.0,
                                       description="ppo dual clip: the loss of a negative advantage is at most "
                                                   "-A * clipRatioC; unset: off.")
    entropy_coef: float = Field(0.0, ge=0.0, le=10.0,
                                description="Entropy bonus: the loss minus entropyCoef times the policy's entropy "
                                            "at each trained token; 0: off.")


class AdvantageSpec(ApiModel):
    """How the rollout turns a group's rewards into advantages (docs/rl.md, "Advantages"), once per group."""

    estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"] = Field(
        "grpo", description="grpo: (r - group mean) / (group std + 1e-6); dr_grpo: r - group mean; rloo: r - mean of "
                            "the group's other rewards; reinforce_pp: r - group mean, then normalised over the step.")
    std_normalization: Literal["population", "unbiased"] = Field(
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


class TrainerSpec(ApiModel):
    """The trainer pods: data-parallel ranks, parallelism, micro-batching, loss and optimizer."""

    CEL_RULES = (
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
            rule="self.lossType == 'ppo' || !has(self.policyLoss) || (self.policyLoss.ratioLevel == 'token' && "
            "!has(self.policyLoss.clipRatioC))",
            message="policyLoss.ratioLevel sequence and clipRatioC shape the ppo ratio: they need lossType ppo",
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
    )

    replicas: int = Field(1, ge=1, le=4096, description="Trainer pods; with one process each, the data-parallel ranks.")
    gpus_per_replica: int = Field(0, ge=0, le=16, description="GPUs per trainer pod (nvidia.com/gpu); 0 trains on CPU.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="Megatron tensor-parallel size.")
    pipeline_parallel_size: int = Field(1, ge=1, le=256, description="Megatron pipeline-parallel size.")
    expert_parallel_size: int = Field(
        1, ge=1, le=1024, description="Expert-parallel size (mixtures of experts): each group of this many "
        "data-parallel ranks splits the experts between them; it must divide the data-parallel size and the experts.")
    moe: TrainerMoESpec = Field(default_factory=TrainerMoESpec, description="Mixture-of-experts training settings.")
    max_tokens_per_gpu: int | None = Field(
        None, ge=1, le=MAX_TOKENS, alias="maxTokensPerGPU", description="Dynamic micro-batches: token cap per micro-batch."
    )
    micro_batch_size: int | None = Field(None, ge=1, le=MAX_SAMPLES_PER_ROLLOUT, description="Static micro-batches: samples per micro-batch.")
    microbatch_multiple: int = Field(
        1, ge=1, le=1024, description="Micro-batches per rank per step are a multiple of this (virtual pipeline)."
    )
    loss_type: Literal["sft", "policy_gradient", "ppo"] = Field(
        "sft", description="Masked cross-entropy, policy gradient, or ppo: the clipped importance-sampling objective "
                           "against the generator's log-probabilities (generated rollouts).")
    policy_loss: PolicyLossSpec = Field(default_factory=lambda: PolicyLossSpec(),
                                        description="Settings of the policy losses (ppo, policy_gradient).")
    advantage: AdvantageSpec = Field(default_factory=lambda: AdvantageSpec(),
                                     description="Advantage estimator of generated and synthetic rollouts.")
    loss_normalization: Literal["sample", "token"] = Field(
        "sample", description="Divide by the step's samples (mean over each sample's tokens) or its loss tokens."
    )
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec, description="Optimizer and LR schedule.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpointing.")
    performance: PerformanceSpec = Field(default_factory=PerformanceSpec,
                                         description="Megatron's performance options (all off by default).")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="Resources of each trainer container."
    )
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
        if self.loss_type != "ppo" and (pl.ratio_level != "token" or pl.clip_ratio_c is not None):
            raise ValueError(self.cel_rule("ratio-options-need-ppo").message)
        if self.world_size % (self.tensor_parallel_size * self.pipeline_parallel_size * self.expert_parallel_size):
            raise ValueError(self.cel_rule("expert-parallel-divides-data-parallel").message)
        if self.performance.overlap_param_gather and not self.optimizer.distributed:
            raise ValueError(self.cel_rule("param-gather-overlap-needs-distributed-optimizer").message)
        return self

    @property
    def world_size(self) -> int:
        return self.replicas * max(self.gpus_per_replica, 1)

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_parallel_size * self.pipeline_parallel_size)


# ------------------------------------------------------------------------------------------------------- rollout
class SyntheticSource(ApiModel):
    """A learnable, seeded task: each prompt of random tokens is answered by the task applied to it, with
    heavy-tailed lengths; each sample of a group gets a reward (fraction of correct answer tokens under noise)."""

    CEL_RULES = (Rule(name="min-length-at-most-max", rule="self.minLength <= self.maxLength",
                      message="minLength must be <= maxLength"),)

    task: Literal["reverse", "sort", "copy"] = Field("reverse", description="What the response does to the prompt.")
    min_length: int = Field(4, ge=1, le=MAX_LENGTH, description="Shortest prompt in tokens.")
    max_length: int = Field(48, ge=1, le=MAX_LENGTH, description="Longest prompt in tokens (lengths are heavy-tailed up to it).")
    vocab_size: int | None = Field(None, ge=4, le=1048576, description="Token ids used (default: the model's vocabSize).")

    @model_validator(mode="after")
    def _rules(self) -> SyntheticSource:
        if self.min_length > self.max_length:
            raise ValueError(self.cel_rule("min-length-at-most-max").message)
        return self


class JsonlSource(ApiModel):
    """Samples, one per line, each with reward or advantage: pre-tokenized (group, tokens, loss_mask or
    prompt_length), text (prompt, response) or chat (messages); text and chat lines are tokenised with the tokenizer
    of model.hf, the loss mask covering the response or the assistant turns."""

    path: str = Field(..., min_length=1, description="Path of the .jsonl file (inside the rollout pod).")


# ---------------------------------------------------------------------------------------- generated rollouts (RL)
class SyntheticPrompts(ApiModel):
    """Built-in token tasks a tiny model can learn by RL: prompt = random content tokens + separator; the answer is
    the task applied to them, then the end token. Token ids: 0 pad, 1 separator, 2 end, 3.. content."""

    CEL_RULES = (Rule(name="min-length-at-most-max", rule="self.minLength <= self.maxLength",
                      message="minLength must be <= maxLength"),)

    task: Literal["copy", "reverse", "sort", "successor"] = Field(
        "reverse", description="copy, reverse or sort the prompt; successor: each token's next content id (cyclic).")
    min_length: int = Field(1, ge=1, le=4096, description="Shortest prompt in content tokens.")
    max_length: int = Field(4, ge=1, le=4096, description="Longest prompt in content tokens (uniform in between).")
    vocab_size: int | None = Field(None, ge=4, le=1048576, description="Token ids used (default: the model's vocabSize).")

    @model_validator(mode="after")
    def _rules(self) -> SyntheticPrompts:
        if self.min_length > self.max_length:
            raise ValueError(self.cel_rule("min-length-at-most-max").message)
        return self


class ReasoningGymPrompts(ApiModel):
    """Prompts and answers from a reasoning-gym task (PyPI `reasoning-gym`, offline)."""

    name: str = Field(..., min_length=1, max_length=128, description="Task name, e.g. basic_arithmetic, chain_sum.")
    config: dict[str, Any] = Field(default_factory=dict, description="Task settings passed to create_dataset.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Dataset seed (default: spec.seed).")
    size: int = Field(1000, ge=1, le=10_000_000, description="Prompts in the dataset (drawn in order, then again).")


class PromptsJsonl(ApiModel):
    """A jsonl file of prompts: one object per line with `prompt` (text) or `prompt_tokens` (ids), and optionally
    `answer` (the reference the reward compares with) and `meta`."""

    path: str = Field(..., min_length=1, description="Path of the .jsonl file (inside the rollout pod).")


class PromptsSpec(ApiModel):
    """Where the prompts of a generated rollout come from."""

    CEL_RULES = (
        Rule(name="reasoning-gym-settings", rule="self.type != 'reasoningGym' || has(self.reasoningGym)",
             message="prompts type reasoningGym needs prompts.reasoningGym"),
        Rule(name="jsonl-settings", rule="self.type != 'jsonl' || has(self.jsonl)",
             message="prompts type jsonl needs prompts.jsonl.path"),
    )

    type: Literal["synthetic", "reasoningGym", "jsonl"] = Field("synthetic", description="Prompt source kind.")
    synthetic: SyntheticPrompts = Field(default_factory=SyntheticPrompts, description="Built-in token task.")
    reasoning_gym: ReasoningGymPrompts | None = Field(None, description="A reasoning-gym task.")
    jsonl: PromptsJsonl | None = Field(None, description="A jsonl file of prompts.")
    template: str = Field(
        "{prompt}", min_length=1, max_length=4096,
        description="Text prompts are formatted with this template ({prompt} = the question) before tokenizing.",
    )
    chat: bool = Field(False, description="Render each text prompt as one user message with the tokenizer's chat "
                                          "template (model.hf), ending with the generation prompt.")

    @model_validator(mode="after")
    def _rules(self) -> PromptsSpec:
        if self.type == "reasoningGym" and self.reasoning_gym is None:
            raise ValueError(self.cel_rule("reasoning-gym-settings").message)
        if self.type == "jsonl" and self.jsonl is None:
            raise ValueError(self.cel_rule("jsonl-settings").message)
        return self


class SamplingSpec(ApiModel):
    """How completions are sampled."""

    temperature: float = Field(1.0, ge=0.0, le=10.0, description="Softmax temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: keep the most likely tokens up to top_p.")
    max_new_tokens: int = Field(32, ge=1, le=131072, description="Longest completion in tokens.")
    stop: list[str] = Field(default_factory=list, max_length=16,
                            description="Stop strings (text tasks): the completion ends after the first one.")
    stop_token_ids: list[Annotated[int, Field(ge=0, le=1048576)]] = Field(default_factory=list, max_length=64,
                                      description="Token ids that end a completion (besides the end-of-text token).")


class OverlongSpec(ApiModel):
    """DAPO's overlong shaping: a completion of L tokens gets penalty · min(0, (maxNewTokens − buffer − L) / buffer)
    added to its reward (0 up to maxNewTokens − buffer tokens, −penalty at maxNewTokens)."""

    buffer: int = Field(..., ge=1, le=131072, description="Tokens before maxNewTokens over which the penalty grows.")
    penalty: float = Field(1.0, ge=0.0, le=1e6, description="The penalty at maxNewTokens.")


class RewardSpec(ApiModel):
    """How a completion is scored. A reward that raises, runs past timeoutSeconds or returns a non-finite number is
    recorded as failed (reward failedReward), counted in metrics, and never stops the rollout."""

    CEL_RULES = (
        Rule(name="function-named", rule="self.type != 'function' || has(self.function)",
             message="reward type function needs reward.function"),
    )

    type: Literal["exact_match", "token_match", "reasoning_gym", "math_verify", "function"] = Field(
        "exact_match",
        description="exact_match: 1 if the answer is exactly the reference; token_match: fraction of answer "
                    "positions right (synthetic tasks); reasoning_gym: the task's own scorer; math_verify: "
                    "math-verify against the reference; function: reward.function.",
    )
    function: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$",
        description="module:function called as function(response, reference) -> float.",
    )
    timeout_seconds: float = Field(10.0, gt=0.0, le=3600.0, description="Longest a reward may take.")
    failed_reward: float = Field(0.0, ge=-1e6, le=1e6, description="Reward of a sample whose reward failed.")
    workers: int = Field(1, ge=1, le=64, description="Processes scoring in parallel (reasoning_gym, math_verify, "
                                                     "function).")
    overlong: OverlongSpec | None = Field(
        None, description="DAPO's overlong reward shaping: a linear penalty over the last `buffer` tokens before "
                          "sampling.maxNewTokens, added to the reward; unset: off.")

    @model_validator(mode="after")
    def _rules(self) -> RewardSpec:
        if self.type == "function" and self.function is None:
            raise ValueError(self.cel_rule("function-named").message)
        return self


class EnvironmentSpec(ApiModel):
    """Multi-turn episodes (docs/rl.md, "Multi-turn"): each prompt starts groupSize episodes of an environment that
    answers every model turn with an observation, a reward and whether the episode is done; the environment's
    rewards replace `reward`. Environments run in worker processes with per-call timeouts and limits; one that hangs,
    raises, returns something malformed or too large, or exits ends that episode as failed (counted)."""

    CEL_RULES = (
        Rule(name="environment-class-named", rule="self.type != 'class' || has(self.className)",
             message="environment type class needs environment.className (module:Class)"),
        Rule(name="environment-class-only-for-class", rule="self.type == 'class' || !has(self.className)",
             message="environment.className is only for environment type class"),
    )

    type: Literal["calculator", "reasoningGym", "class"] = Field(
        "calculator",
        description="calculator: the model calls <calc>EXPR</calc>, gets the value back, and its final answer is "
                    "scored against the prompt's answer; reasoningGym: the prompt's reasoning-gym task, answered "
                    "again after feedback until right or out of attempts; class: environment.className.",
    )
    class_name: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$",
        description="module:Class of a user environment, built as Class(**config) for every episode.",
    )
    config: dict[str, Any] = Field(default_factory=dict, description="Keyword settings of the environment.")
    max_turns: int = Field(4, ge=1, le=1024, description="Model turns per episode; an episode not done after them "
                                                         "is truncated.")
    max_tokens: int | None = Field(
        None, ge=2, le=MAX_LENGTH,
        description="Cap on an episode's tokens (first observation, turns and observations); default and at most "
                    "model seqLength. An episode that reaches it is truncated.")
    episode_reward: Literal["sum", "final"] = Field(
        "sum", description="The episode's reward: the sum of its per-turn rewards, or the last turn's.")
    samples: Literal["episode", "turn"] = Field(
        "episode", description="episode: one sample per episode; turn: one sample per model turn (its context "
                               "unmasked), each with the episode's reward: a group then has a variable sample count.")
    truncation: Literal["mask", "penalize"] = Field(
        "mask", description="Truncated episodes: mask (their loss mask is zero: they train nothing) or penalize "
                            "(their reward is truncationReward).")
    truncation_reward: float = Field(0.0, ge=-1e6, le=1e6, description="Reward of a truncated episode (penalize).")
    failed_reward: float = Field(0.0, ge=-1e6, le=1e6, description="Reward of an episode whose environment failed.")
    timeout_seconds: float = Field(10.0, gt=0.0, le=3600.0, description="Longest one environment call may take.")
    workers: int = Field(1, ge=1, le=256, description="Environment worker processes.")
    memory_mib: int = Field(1024, ge=16, le=1_048_576,
                            description="Address space an environment worker may add beyond its start (MiB).")
    max_observation_tokens: int = Field(
        512, ge=1, le=MAX_LENGTH,
        description="Longest observation in tokens (text beyond 16 characters per token is refused unread).")

    @model_validator(mode="after")
    def _rules(self) -> EnvironmentSpec:
        if self.type == "class" and self.class_name is None:
            raise ValueError(self.cel_rule("environment-class-named").message)
        if self.type != "class" and self.class_name is not None:
            raise ValueError(self.cel_rule("environment-class-only-for-class").message)
        return self


class GenerateSource(ApiModel):
    """Rollouts generated by the policy itself: groupSize completions per prompt, scored by the reward (or groupSize
    multi-turn episodes per prompt with an environment)."""

    CEL_RULES = (
        Rule(name="overlong-buffer-within-max-new-tokens",
             rule="!has(self.reward) || !has(self.reward.overlong) || self.reward.overlong.buffer <= "
             "(has(self.sampling) ? self.sampling.maxNewTokens : 32)",
             message="reward.overlong.buffer must be at most sampling.maxNewTokens", fieldPath=".reward.overlong"),
    )

    prompts: PromptsSpec = Field(default_factory=PromptsSpec, description="Where prompts come from.")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec,
                                   description="Sampling settings (per model turn with an environment).")
    reward: RewardSpec = Field(default_factory=RewardSpec, description="The reward (not used with an environment).")
    environment: EnvironmentSpec | None = Field(
        None, description="Multi-turn episodes with an environment instead of single completions.")

    @model_validator(mode="after")
    def _rules(self) -> GenerateSource:
        if self.reward.overlong is not None and self.reward.overlong.buffer > self.sampling.max_new_tokens:
            raise ValueError(self.cel_rule("overlong-buffer-within-max-new-tokens").message)
        return self


class VLLMSettings(ApiModel):
    """The vllm engine: the run's own server (rollout.engine.type vllm without url; started by the local launcher, in
    a cluster a pod + Service of the operator) and the dtype weights are published in."""

    image: str = Field("vllm/vllm-openai:v0.32.0", min_length=1,
                       description="Image of the engine pod (cluster): the official vLLM image.")
    gpus: int = Field(0, ge=0, le=64, description="GPUs of the engine pod (cluster; its tensor-parallel size).")
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements,
                                            description="Resources of the engine container (cluster).")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Weights and compute dtype of the engine; published weights are converted to it.")
    max_model_len: int | None = Field(None, ge=16, le=1_048_576,
                                      description="Longest prompt + completion; unset: model.seqLength.")
    kv_cache_gib: int = Field(2, ge=1, le=4096, description="KV cache GiB on CPU (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_gib: float = Field(
        80.0, gt=0, le=65536, alias="gpuMemoryGiB",
        description="Memory of one engine GPU in GiB: the memory plan's budget (`trainingrun plan`). vLLM takes "
        "--gpu-memory-utilization (default 0.9) of it for weights, activations and KV cache; the plan refuses a run "
        "whose share cannot hold the weights per GPU and one sequence of maxModelLen, or whose weight-sync buffers "
        "do not fit beside it. Not checked for CPU engines (gpus 0).")
    concurrency: int = Field(64, ge=1, le=4096, description="Requests the rollout keeps in flight per engine (the "
                                                            "dispatch's per-engine cap).")
    args: list[str] = Field(default_factory=list, max_length=64, description="Extra server arguments.")
    stall_seconds: int = Field(
        60, ge=1, le=86400,
        description="An engine with requests in flight that has answered nothing for this long is reported as "
                    "stalled and its unanswered prompts go to the other engines.")
    load_timeout_seconds: int = Field(
        300, ge=10, le=86400,
        description="Longest one engine may take to load a weight version (connect to the sender included) before "
                    "the load counts as failed; kept below failurePolicy.progressDeadlineSeconds.")


class EngineSpec(ApiModel):
    """The inference engine of generated rollouts."""

    CEL_RULES = (
        Rule(name="replicas-of-own-servers", rule="!has(self.url) || !has(self.replicas) || self.replicas == 1",
             message="engine.replicas counts the run's own vLLM servers; with engine.url list your servers there "
             "(comma-separated URLs)", fieldPath=".replicas"),
    )

    type: Literal["megatron", "vllm"] = Field(
        "megatron", description="megatron: in the rollout process with the run's model code; vllm: a pool of "
                                "OpenAI-compatible vLLM servers.")
    url: str | None = Field(None, min_length=1, max_length=8192, pattern=r"^https?://[^,\s]+(,https?://[^,\s]+)*$",
                            description="URL of a vLLM server the user runs (type vllm), or several, comma-separated "
                                        "(a pool); unset: the run's own.")
    replicas: int = Field(1, ge=1, le=256, description="The run's own vLLM servers (type vllm without url): a pool, "
                                                       "each with its own engine.vllm.gpus.")
    max_batch: int = Field(256, ge=1, le=65536, description="Sequences generated together (megatron).")
    vllm: VLLMSettings = Field(default_factory=VLLMSettings, description="The run's own vLLM server (type vllm).")

    @model_validator(mode="after")
    def _rules(self) -> EngineSpec:
        if self.url is not None and self.replicas != 1:
            raise ValueError(self.cel_rule("replicas-of-own-servers").message)
        return self

    @property
    def urls(self) -> list[str]:
        """The user's servers (`url`, comma-separated); [] for the run's own."""
        return self.url.split(",") if self.url else []


class WeightSyncSpec(ApiModel):
    """How trained weights reach the engine after every rollout (generated rollouts only)."""

    type: Literal["store", "disk", "broadcast"] = Field(
        "store", description="store: raw tensors through the run's store (megatron engine); disk: an HF directory "
                             "on a shared volume; broadcast: a torch.distributed group with the engine (vllm).")
    path: str | None = Field(None, min_length=1,
                             description="disk: directory of the published HF directories, on a volume the engine "
                                         "mounts too; unset: <checkpoint.path>/weights.")
    port: int = Field(0, ge=0, le=65535,
                      description="broadcast: trainer 0's port the engine fetches weights from; 0: a free one "
                                  "(local runs), 29600 in a cluster.")
    bucket_mib: int = Field(
        512, ge=1, le=16384, alias="bucketMiB",
        description="Size of one weight-sync bucket in MiB: weights move to the engines in buckets of this size, and "
        "no trainer process holds more than two of them of sync memory (counted by the memory plan on every trainer "
        "GPU and engine GPU).")
    logprob_tolerance: float | None = Field(
        None, gt=0.0, le=100.0,
        description="maxPolicyLag 0: a step whose logprob_abs_diff (engine vs trainer on the same weights) exceeds "
                    "this says the engine does not hold the trainer's weights; unset: by engine dtype (float32 "
                    "0.01, bfloat16/float16 0.3).")
    on_logprob_mismatch: Literal["warn", "fail"] = Field(
        "warn", description="What a logprob_abs_diff above logprobTolerance does: warn (a line in the trainer's log) "
                            "or fail the run (exit 78: a restart would load the same weights).")


class SourceSpec(ApiModel):
    """Where samples come from."""

    CEL_RULES = (
        Rule(name="jsonl-settings", rule="self.type != 'jsonl' || has(self.jsonl)",
             message="type jsonl needs source.jsonl.path"),
        Rule(name="jsonl-only-for-jsonl", rule="self.type != 'synthetic' || !has(self.jsonl)",
             message="source.jsonl is only for type jsonl"),
        Rule(name="generate-settings", rule="self.type != 'generate' || has(self.generate)",
             message="type generate needs source.generate"),
    )

    type: Literal["synthetic", "jsonl", "generate"] = Field(
        "synthetic", description="synthetic/jsonl: replay samples with given rewards; generate: the policy generates "
                                 "its own rollouts.")
    synthetic: SyntheticSource = Field(default_factory=SyntheticSource, description="Settings of the synthetic task.")
    jsonl: JsonlSource | None = Field(None, description="Settings of the jsonl source.")
    generate: GenerateSource | None = Field(None, description="Settings of generated rollouts.")

    @model_validator(mode="after")
    def _rules(self) -> SourceSpec:
        if self.type == "jsonl" and self.jsonl is None:
            raise ValueError(self.cel_rule("jsonl-settings").message)
        if self.type == "synthetic" and self.jsonl is not None:
            raise ValueError(self.cel_rule("jsonl-only-for-jsonl").message)
        if self.type == "generate" and self.generate is None:
            raise ValueError(self.cel_rule("generate-settings").message)
        return self


class FilterSpec(ApiModel):
    """Filters applied to each rollout before it is split into steps; they make the sample count vary."""

    zero_variance: bool = Field(True, description="Drop groups whose rewards all equal (dynamic sampling).")
    max_length: int | None = Field(None, ge=1, le=MAX_LENGTH, description="Drop samples longer than this many tokens.")


class StepPolicy(ApiModel):
    """How a rollout's samples are split into optimizer steps."""

    CEL_RULES = (
        Rule(
            name="batch-size-with-fixed",
            rule="self.policy == 'fixed' ? has(self.globalBatchSize) : !has(self.globalBatchSize)",
            message="policy fixed needs globalBatchSize (groups per step); policy dynamic takes none",
            fieldPath=".globalBatchSize",
        ),
    )

    policy: Literal["fixed", "dynamic"] = Field(
        "dynamic", description="fixed: globalBatchSize groups per step, leftover carried over; dynamic: one step per rollout."
    )
    global_batch_size: int | None = Field(None, ge=1, le=MAX_SAMPLES_PER_ROLLOUT, description="Groups per step with policy fixed.")

    @model_validator(mode="after")
    def _rules(self) -> StepPolicy:
        if (self.policy == "fixed") != (self.global_batch_size is not None):
            raise ValueError(self.cel_rule("batch-size-with-fixed").message)
        return self


class RolloutSpec(ApiModel):
    """The rollout pod: produce samples, filter them, split them into steps, schedule and publish."""

    CEL_RULES = (
        Rule(
            name="whole-groups",
            rule="self.samplesPerRollout % self.groupSize == 0",
            message="samplesPerRollout must be a multiple of groupSize",
            fieldPath=".samplesPerRollout",
        ),
        Rule(
            name="partial-needs-over-sampling",
            rule="!has(self.partialRollout) || !self.partialRollout || (has(self.overSampling) && self.overSampling > 0.0)",
            message="partialRollout continues completions cut by over-sampling's abort: set overSampling > 0",
            fieldPath=".partialRollout",
        ),
        Rule(
            name="over-sampling-single-turn",
            rule="!has(self.overSampling) || self.overSampling == 0.0 || !has(self.source) || "
                 "!has(self.source.generate) || !has(self.source.generate.environment)",
            message="overSampling aborts single completions; multi-turn episodes (source.generate.environment) are "
                    "not over-sampled: set overSampling 0 or remove the environment",
            fieldPath=".overSampling",
        ),
    )

    source: SourceSpec = Field(default_factory=SourceSpec, description="Where samples come from.")
    samples_per_rollout: int = Field(64, ge=1, le=MAX_SAMPLES_PER_ROLLOUT, description="Samples produced per rollout, before filters.")
    group_size: int = Field(4, ge=1, le=4096, description="Samples per prompt (a group; never split across steps).")
    filters: FilterSpec = Field(default_factory=FilterSpec, description="Sample filters.")
    steps: StepPolicy = Field(default_factory=StepPolicy, description="Step policy.")
    num_rollouts: int = Field(10, ge=1, le=1_000_000_000, description="Rollouts in the run.")
    max_pending_rollouts: int = Field(2, ge=1, le=1024, description="Published but unconsumed rollouts allowed.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Inference engine (source type generate).")
    max_policy_lag: int = Field(
        0, ge=0, le=64,
        description="Bounded staleness (source type generate): rollout k is generated with the weights trained on "
                    "rollouts < k - maxPolicyLag; 0 is strictly on-policy, 1 generates one rollout while the "
                    "previous one trains.",
    )
    over_sampling: float = Field(
        0.0, ge=0.0, le=4.0,
        description="Generated rollouts: extra prompts drawn per rollout, as a fraction of samplesPerRollout / "
                    "groupSize. Once samplesPerRollout / groupSize groups passed the filters, the requests still "
                    "running are aborted and their prompts go back to the front of the prompt stream, in order.")
    partial_rollout: bool = Field(
        False,
        description="Generated rollouts: completions cut by an abort keep their tokens and log-probabilities and are "
                    "continued in the next rollout under newer weights (every token records its weight version); "
                    "rollouts are then generated with the newest published weights, at least k - maxPolicyLag.")
    stale_tokens: Literal["drop", "mask"] = Field(
        "drop",
        description="partialRollout: a cut completion whose oldest token is older than maxPolicyLag allows is "
                    "dropped (counted; its prompt is generated afresh) or kept with its old tokens masked out of "
                    "the loss.")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="Resources of the rollout container."
    )

    @model_validator(mode="after")
    def _rules(self) -> RolloutSpec:
        if self.samples_per_rollout % self.group_size:
            raise ValueError(self.cel_rule("whole-groups").message)
        if self.partial_rollout and not self.over_sampling > 0:
            raise ValueError(self.cel_rule("partial-needs-over-sampling").message)
        if self.over_sampling > 0 and self.source.generate is not None and self.source.generate.environment is not None:
            raise ValueError(self.cel_rule("over-sampling-single-turn").message)
        return self


# ---------------------------------------------------------------------------------------------- store / metrics
class StoreSpec(ApiModel):
    """The shared store between rollout and trainers."""

    CEL_RULES = (Rule(name="url-or-managed", rule="!(has(self.url) && self.managed)",
                      message="set store.url or store.managed, not both"),)

    url: str | None = Field(
        None,
        pattern=r"^(file|redis)://.+",
        description="file:///path or redis://host:port/db. Unset: a file store in the run directory (local runs).",
    )
    managed: bool = Field(False, description="The operator runs a Redis pod and service for this run.")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Resources of the managed Redis pod; empty: requests cpu 250m, memory 2Gi and limit memory 2Gi "
        "(size it for maxPendingRollouts + 1 rollouts of payload).",
    )

    @model_validator(mode="after")
    def _rules(self) -> StoreSpec:
        if self.url is not None and self.managed:
            raise ValueError(self.cel_rule("url-or-managed").message)
        return self


class TensorBoardSpec(ApiModel):
    """TensorBoard event files written by trainer rank 0, one scalar per numeric field of the step record."""

    enabled: bool = Field(True, description="Write event files.")
    path: str | None = Field(
        None, min_length=1,
        description="Directory of the event files; relative paths are inside the output directory (a local run's "
                    "directory, in a cluster trainer.checkpoint.path). Unset: <output directory>/tensorboard.",
    )


class SecretKeySelector(ApiModel):
    """A key of a Secret in the run's namespace."""

    name: str = Field(..., min_length=1, max_length=253, description="Secret name.")
    key: str = Field("api-key", min_length=1, max_length=253, description="Key in the Secret.")


class WandbSpec(ApiModel):
    """Weights & Biases logging from trainer rank 0 (the same per-step fields as TensorBoard). The run id is kept
    with the checkpoints, so a restarted or resumed run continues the same W&B run. Online mode needs
    WANDB_API_KEY in the trainers' environment."""

    project: str = Field(..., min_length=1, max_length=128, description="W&B project.")
    entity: str | None = Field(None, min_length=1, description="W&B entity (user or team); unset: your default.")
    mode: Literal["online", "offline"] = Field(
        "online", description="online: stream to W&B; offline: write files under <output directory>/wandb for "
                              "`wandb sync` later."
    )
    name: str | None = Field(None, min_length=1, description="Display name (default: metadata.name).")
    group: str | None = Field(None, min_length=1, description="W&B group.")
    tags: list[str] = Field(default_factory=list, max_length=64, description="W&B tags.")
    api_key_secret: SecretKeySelector | None = Field(
        None, description="Secret holding the W&B API key, given to the trainer pods as WANDB_API_KEY (online mode "
                          "in a cluster). Local runs use the launcher's environment."
    )


class MetricsSpec(ApiModel):
    """Prometheus metrics served by every trainer and the rollout pod, and experiment tracking by step."""

    enabled: bool = Field(True, description="Serve /metrics.")
    port: int = Field(9400, ge=1, le=65535, description="Port of /metrics (local runs use port, port+1, ...).")
    linger_seconds: int = Field(
        0, ge=0, le=3600,
        description="Trainers (after the last step) and the rollout (after the last rollout) keep serving /metrics "
                    "this long, so a scrape sees their final values.",
    )
    tensorboard: TensorBoardSpec = Field(default_factory=TensorBoardSpec, description="TensorBoard event files.")
    wandb: WandbSpec | None = Field(None, description="Weights & Biases logging (off when unset).")


class FailureRule(ApiModel):
    """One rule of the failure policy (`trainingrun.failure_policy`): `action` for a failure that matches every
    condition given (a condition left out matches anything); the first rule that matches decides."""

    CEL_RULES = (
        Rule(
            name="restart-role-names-a-role",
            rule="self.action != 'RestartRole' || (has(self.roles) && size(self.roles) > 0 && !('trainer' in "
            "self.roles))",
            message="action RestartRole restarts the rollout or one engine replica alone: give roles [rollout] and/or "
            "[engine]; the trainers are one torch.distributed group fenced by the attempt number, so a trainer failure "
            "restarts the group (RestartGroup), fails the run (FailRun) or uses no restart (Ignore)",
            fieldPath=".roles",
        ),
    )

    name: str | None = Field(None, min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                             description="A name for events and messages (optional).")
    roles: list[Literal["rollout", "trainer", "engine"]] = Field(
        default_factory=list, max_length=3, description="The failed process's role; empty: any role.")
    exit_codes: list[Annotated[int, Field(ge=1, le=255)]] = Field(
        default_factory=list, max_length=32, description="Exit codes as a container reports them (a process killed "
        "by signal N: 128 + N, e.g. 137 for SIGKILL); empty: any code.")
    reasons: list[Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z][A-Za-z0-9]*$")]] = Field(
        default_factory=list, max_length=32, description="Any of these reasons: the container's (OOMKilled, Error, "
        "...), the pod's (Evicted, DeadlineExceeded, ...), a disruption condition's (DisruptionTarget, "
        "EvictionByEvictionAPI, PreemptionByScheduler, TerminationTarget, ...) or the policy's own (Disrupted, "
        "Deleted, ProgressDeadlineExceeded, Signal); empty: any reason.")
    action: Literal["RestartGroup", "RestartRole", "FailRun", "Ignore"] = Field(
        ..., description="RestartGroup: the rollout and the trainers restart as the next attempt (maxRestarts); "
        "RestartRole: the rollout or the failed engine replica restarts alone (the role's budget); FailRun: the run "
        "fails; Ignore: restarted as the role's default does, using no budget.")

    @model_validator(mode="after")
    def _rules(self) -> FailureRule:
        if self.action == "RestartRole" and (not self.roles or "trainer" in self.roles):
            raise ValueError(self.cel_rule("restart-role-names-a-role").message)
        return self


class RoleBudget(ApiModel):
    """Restarts of one role alone (RestartRole): how many, and the backoff before each."""

    max_restarts: int | None = Field(
        None, ge=0, le=1000, description="Restarts of this role alone (all its replicas together) before the run "
        "fails; unset: failurePolicy.maxRestarts.")
    backoff_seconds: int | None = Field(
        None, ge=0, le=86400, description="Wait before such a restart, doubling like the group's; unset: "
        "failurePolicy.backoffSeconds.")


class RoleBudgets(ApiModel):
    """The budgets of the roles that restart alone."""

    rollout: RoleBudget = Field(default_factory=RoleBudget, description="The rollout process (pod).")
    engine: RoleBudget = Field(default_factory=RoleBudget, description="The run's vLLM server(s).")


class FailurePolicy(ApiModel):
    """What happens when a pod fails or the run stops making progress (`trainingrun.failure_policy`)."""

    max_restarts: int = Field(
        3, ge=0, le=1000, description="Whole-group restarts after application failures before the run is Failed; "
        "evicted or preempted pods restart the group without using one (counted in status.disruptions).")
    backoff_seconds: int = Field(
        10, ge=0, le=86400, description="Wait before a restart: backoffSeconds after a disruption; after the n-th "
        "counted restart backoffSeconds × 2^(n-1), at most max(backoffSeconds, 360).")
    progress_deadline_seconds: int | None = Field(
        None, ge=1, le=MAX_SECONDS,
        description="No new step for this long counts as a failure (hang detection); time in which the operator could "
        "not read progress from the store does not count. Unset: off."
    )
    terminating_timeout_seconds: int = Field(
        120, ge=0, le=MAX_SECONDS, description="How long pods of an older attempt that are still terminating (e.g. on a "
        "lost node) may delay a restart; after it they no longer block the next attempt (the message names them).")
    rules: list[FailureRule] = Field(
        default_factory=list, max_length=32, description="Rules by role, exit code and reason, tried in order before "
        "the default rules (a disruption uses no restart; exit code 78 fails the run; the rollout and an engine "
        "restart alone; anything else restarts the group); the first that matches decides.")
    roles: RoleBudgets = Field(default_factory=RoleBudgets, description="Budgets of restarting one role alone.")


class Toleration(ApiModel):
    """A pod toleration (core/v1 Toleration)."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)


class PodTemplateOverrides(ApiModel):
    """Pod settings applied to every pod of the run (rollout and trainers)."""

    CEL_RULES = (
        Rule(
            name="mounts-name-volumes",
            rule="(!has(self.volumes) || self.volumes.all(v, has(v.name))) && (!has(self.volumeMounts) ||"
            " self.volumeMounts.all(m, has(m.name) && has(m.mountPath) && has(self.volumes)"
            " && self.volumes.exists(v, has(v.name) && v.name == m.name)))",
            message="every volume needs a name; every volumeMount needs name and mountPath, and names a volume "
            "of podTemplate.volumes",
            fieldPath=".volumeMounts",
        ),
    )

    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Pod tolerations.")
    affinity: dict[str, Any] | None = Field(None, description="Pod affinity (core/v1 Affinity), passed through.")
    priority_class_name: str | None = Field(None, description="Pod priorityClassName.")
    service_account_name: str | None = Field(None, description="Pod serviceAccountName.")
    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra pod annotations.")
    volumes: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Pod volumes (core/v1 Volume), e.g. a ReadWriteMany claim for checkpoints or rollout data.",
    )
    volume_mounts: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Mounts (core/v1 VolumeMount) added to every container, e.g. at trainer.checkpoint.path.",
    )

    @model_validator(mode="after")
    def _rules(self) -> PodTemplateOverrides:
        names = {v.get("name") for v in self.volumes}
        if None in names or not all(
            m.get("name") in names and m.get("mountPath") for m in self.volume_mounts
        ):
            raise ValueError(self.cel_rule("mounts-name-volumes").message)
        return self


class GangScheduling(ApiModel):
    """Schedule the rollout and trainer pods of an attempt together (`trainingrun.operator.gang`)."""

    enabled: bool = Field(False, description="Group the rollout and trainer pods of each attempt.")
    provider: Literal["volcano", "coscheduling", "kubernetes"] = Field(
        "volcano", description="volcano: Volcano's PodGroup; coscheduling: scheduler-plugins' PodGroup; kubernetes: "
        "Kubernetes' own Workload and PodGroup (scheduling.k8s.io v1beta1 or v1alpha2, whichever the cluster serves).")
    queue: str | None = Field(
        None, min_length=1, max_length=253,
        description="Volcano queue of the PodGroup (unset: Volcano's default queue); not used by the others.")


class KueueTopology(ApiModel):
    """Kueue's Topology Aware Scheduling for one role's pods (with spec.queueName): each level is a node label key of
    the cluster's Kueue Topology (e.g. cloud.google.com/gce-topology-block, or nvidia.com/gpu.clique for an NVLink
    domain)."""

    CEL_RULES = (
        Rule(name="required-or-preferred", rule="!(has(self.required) && has(self.preferred))",
             message="set placement.<role>.kueue.required or .preferred, not both"),
        Rule(name="slice-level-and-size", rule="has(self.sliceRequired) == has(self.sliceSize)",
             message="placement.<role>.kueue.sliceRequired and sliceSize go together: each slice of sliceSize pods "
             "(by rank) is placed inside one domain of the sliceRequired level"),
    )

    required: str | None = Field(None, min_length=1, max_length=253, description="All the role's pods inside one "
                                 "domain of this level, or none runs (kueue.x-k8s.io/podset-required-topology).")
    preferred: str | None = Field(None, min_length=1, max_length=253, description="Inside one domain of this level "
                                  "when it fits, else the next level up (kueue.x-k8s.io/podset-preferred-topology).")
    slice_required: str | None = Field(None, min_length=1, max_length=253, description="Each slice of sliceSize pods "
                                       "inside one domain of this level (kueue.x-k8s.io/podset-slice-required-"
                                       "topology), e.g. one model replica's trainer pods in one NVLink domain.")
    slice_size: int | None = Field(None, ge=1, le=4096, description="Pods per slice (kueue.x-k8s.io/podset-slice-"
                                   "size); trainers are ordered by rank, so a slice is consecutive ranks.")

    @model_validator(mode="after")
    def _rules(self) -> KueueTopology:
        if self.required is not None and self.preferred is not None:
            raise ValueError(self.cel_rule("required-or-preferred").message)
        if (self.slice_required is None) != (self.slice_size is None):
            raise ValueError(self.cel_rule("slice-level-and-size").message)
        return self


class VolcanoTopology(ApiModel):
    """Volcano's network topology for one role's pods (with gangScheduling provider volcano): a sub-group of the
    attempt's PodGroup whose pods stay within one HyperNode tier."""

    CEL_RULES = (
        Rule(name="one-tier", rule="!(has(self.highestTierAllowed) && has(self.highestTierName))",
             message="set placement.<role>.volcano.highestTierAllowed or highestTierName, not both"),
    )

    mode: Literal["hard", "soft"] = Field("hard", description="hard: the pods must stay within the tier; soft: "
                                          "preferred.")
    highest_tier_allowed: int | None = Field(None, ge=0, le=64, description="The highest HyperNode tier the pods may "
                                             "span (1: one leaf switch).")
    highest_tier_name: str | None = Field(None, min_length=1, max_length=253,
                                          description="The highest tier by its name.")
    sub_group_size: int | None = Field(None, ge=1, le=4096, description="Pods per sub-group kept within the tier "
                                       "(consecutive ranks); unset: all the role's pods together.")

    @model_validator(mode="after")
    def _rules(self) -> VolcanoTopology:
        if self.highest_tier_allowed is not None and self.highest_tier_name is not None:
            raise ValueError(self.cel_rule("one-tier").message)
        return self


class RolePlacement(ApiModel):
    """Topology-aware placement of one role's pods: Kueue's or Volcano's (`trainingrun.operator.gang`)."""

    kueue: KueueTopology | None = Field(None, description="Kueue Topology Aware Scheduling (needs spec.queueName).")
    volcano: VolcanoTopology | None = Field(None, description="Volcano network topology (needs gangScheduling "
                                            "provider volcano).")


class Placement(ApiModel):
    """Topology-aware placement per role."""

    rollout: RolePlacement = Field(default_factory=RolePlacement, description="The rollout pod.")
    trainer: RolePlacement = Field(default_factory=RolePlacement, description="The trainer pods.")


# CEL terms of the spec's rules below. The API server defaults fields before it evaluates rules, but an object that is
# left out (rollout, rollout.engine, weightSync) has no defaults inside it: each term guards for that.
_GENERATED = "has(self.rollout) && has(self.rollout.source) && self.rollout.source.type == 'generate'"
_VLLM = "has(self.rollout.engine) && self.rollout.engine.type == 'vllm'"
_SYNC = "(has(self.weightSync) ? self.weightSync.type : 'store')"
_PLACED = "(has(self.placement) && has(self.placement.{role}) && has(self.placement.{role}.{kind}))"


class TrainingRunSpec(ApiModel):
    """Desired state of a TrainingRun."""

    CEL_RULES = (
        Rule(
            name="ppo-needs-generate",
            rule="self.trainer.lossType != 'ppo' || (has(self.rollout) && has(self.rollout.source) && "
            "self.rollout.source.type == 'generate')",
            message="trainer.lossType ppo needs generated rollouts (rollout.source.type generate): it compares the "
            "trainer's log-probabilities with the generator's",
            fieldPath=".trainer.lossType",
        ),
        # The engine of generated rollouts and how the trained weights reach it (`trainingrun.trainer.weights`,
        # `trainingrun.vllm.publish`): store for the megatron engine; disk or broadcast for vllm, which loads them as
        # a Hugging Face model (so it needs model.hf).
        Rule(
            name="store-sync-needs-megatron",
            rule=f"!({_GENERATED}) || {_SYNC} != 'store' || !({_VLLM})",
            message="weightSync.type store reaches the megatron engine only; with rollout.engine.type vllm set "
            "weightSync.type disk or broadcast",
            fieldPath=".weightSync.type",
        ),
        Rule(
            name="disk-broadcast-sync-need-vllm",
            rule=f"!({_GENERATED}) || !({_SYNC} in ['disk', 'broadcast']) || ({_VLLM})",
            message="weightSync.type disk and broadcast reach the vllm engine only; with rollout.engine.type megatron "
            "set weightSync.type store",
            fieldPath=".weightSync.type",
        ),
        Rule(
            name="policy-options-need-generate",
            rule=f"({_GENERATED}) || !has(self.trainer.policyLoss) || (self.trainer.policyLoss.oldLogprobs == "
            "'engine' && (!has(self.trainer.policyLoss.rolloutCorrection) || "
            "self.trainer.policyLoss.rolloutCorrection.type == 'none'))",
            message="trainer.policyLoss.oldLogprobs trainer and rolloutCorrection compare with the engine's "
            "log-probabilities: they need generated rollouts (rollout.source.type generate)",
            fieldPath=".trainer.policyLoss",
        ),
        Rule(
            name="greedy-groups-never-vary",
            rule=f"!({_GENERATED}) || !has(self.rollout.source.generate.sampling) || "
            "self.rollout.source.generate.sampling.temperature > 0.0 || self.rollout.groupSize < 2 || "
            "(has(self.rollout.filters) && !self.rollout.filters.zeroVariance)",
            message="rollout.source.generate.sampling.temperature 0 (greedy) gives every completion of a group the "
            "same tokens and reward, so with groupSize > 1 the zero-variance filter drops every group and the run "
            "can never train; set temperature > 0, groupSize 1, or rollout.filters.zeroVariance false",
            fieldPath=".rollout.source.generate.sampling.temperature",
        ),
        Rule(
            name="routing-replay-needs-megatron-engine",
            rule="!has(self.trainer.moe) || !has(self.trainer.moe.routingReplay) || !self.trainer.moe.routingReplay"
            f" || (({_GENERATED}) && !({_VLLM}))",
            message="trainer.moe.routingReplay needs generated rollouts (rollout.source.type generate) with "
            "rollout.engine.type megatron: it records the experts each generated token was routed to (the vllm engine "
            "does not hand them over yet)",
            fieldPath=".trainer.moe.routingReplay",
        ),
        Rule(
            name="routing-replay-without-partial-rollouts",
            rule="!has(self.trainer.moe) || !has(self.trainer.moe.routingReplay) || !self.trainer.moe.routingReplay"
            " || !has(self.rollout.partialRollout) || !self.rollout.partialRollout",
            message="trainer.moe.routingReplay with rollout.partialRollout: a continued completion's experts are not "
            "recorded across the cut yet, so its routes could not be replayed; set one of them false",
            fieldPath=".trainer.moe.routingReplay",
        ),
        Rule(
            name="bf16-grad-reduce-needs-bf16",
            rule="!has(self.trainer.performance) || !has(self.trainer.performance.gradReduceDtype)"
            " || self.trainer.performance.gradReduceDtype != 'bf16'"
            " || (has(self.model.precision) && self.model.precision == 'bf16')",
            message="trainer.performance.gradReduceDtype bf16 reduces gradients in the parameters' type: set "
            "model.precision bf16, or gradReduceDtype fp32",
            fieldPath=".trainer.performance.gradReduceDtype",
        ),
        Rule(
            name="vllm-needs-hf",
            rule=f"!({_GENERATED}) || !({_VLLM}) || has(self.model.hf)",
            message="rollout.engine.type vllm loads Hugging Face weights: set model.hf to a Hugging Face directory "
            "(in a cluster on a volume of podTemplate, which the engine pod mounts too)",
            fieldPath=".model.hf",
        ),
        # A transition rule (oldSelf: the stored object on an update): the controller that owns a run is chosen when
        # it is created. No Python twin: a single object has no old version.
        Rule(
            name="managed-by-immutable",
            rule="has(self.managedBy) == has(oldSelf.managedBy) && (!has(self.managedBy) || self.managedBy == "
            "oldSelf.managedBy)",
            message="spec.managedBy is immutable: it cannot be set, changed or removed after the run is created",
            fieldPath=".managedBy",
        ),
        Rule(
            name="kueue-placement-needs-queue",
            rule=f"has(self.queueName) || !({_PLACED.format(role='trainer', kind='kueue')} || "
            f"{_PLACED.format(role='rollout', kind='kueue')})",
            message="placement.<role>.kueue is Kueue's Topology Aware Scheduling: set queueName (a LocalQueue whose "
            "ClusterQueue has a topology-aware ResourceFlavor)",
            fieldPath=".placement",
        ),
        Rule(
            name="volcano-placement-needs-volcano",
            rule="(has(self.gangScheduling) && self.gangScheduling.enabled && has(self.gangScheduling.provider) && "
            f"self.gangScheduling.provider == 'volcano') || !({_PLACED.format(role='trainer', kind='volcano')} || "
            f"{_PLACED.format(role='rollout', kind='volcano')})",
            message="placement.<role>.volcano is Volcano's network topology: set gangScheduling.enabled with provider "
            "volcano",
            fieldPath=".placement",
        ),
        Rule(
            name="slices-divide-the-pods",
            rule="!has(self.placement) || !has(self.placement.trainer) || ((!has(self.placement.trainer.kueue) || "
            "!has(self.placement.trainer.kueue.sliceSize) || self.trainer.replicas % "
            "self.placement.trainer.kueue.sliceSize == 0) && (!has(self.placement.trainer.volcano) || "
            "!has(self.placement.trainer.volcano.subGroupSize) || self.trainer.replicas % "
            "self.placement.trainer.volcano.subGroupSize == 0))",
            message="placement.trainer.kueue.sliceSize and placement.trainer.volcano.subGroupSize must divide "
            "trainer.replicas (every slice is full)",
            fieldPath=".placement.trainer",
        ),
    )

    image: str = Field("ghcr.io/trainingrun/trainer-te:0.1.0", min_length=1, description="Image of rollout and trainers.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent", description="Pull policy.")
    seed: int = Field(1234, ge=0, le=MAX_SEED, description="Seed of data, model init and sampling.")
    model: ModelSpec = Field(..., description="Model to train.")
    trainer: TrainerSpec = Field(..., description="Trainer pods.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Rollout pod.")
    store: StoreSpec = Field(default_factory=StoreSpec, description="Shared store.")
    metrics: MetricsSpec = Field(default_factory=MetricsSpec, description="Metrics.")
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec,
                                        description="Weights to the engine (generated rollouts).")
    failure_policy: FailurePolicy = Field(default_factory=FailurePolicy, description="Restarts and hang detection.")
    suspend: bool = Field(False, description="Delete the pods and keep the run (resume from checkpoint on false).")
    active_deadline_seconds: int | None = Field(None, ge=1, le=MAX_SECONDS, description="Fail the run after this long running.")
    ttl_seconds_after_finished: int | None = Field(None, ge=0, le=MAX_SECONDS, description="Delete the run this long after it ends.")
    scheduler_name: str | None = Field(None, description="Pod schedulerName (e.g. volcano).")
    queue_name: str | None = Field(
        None, min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="Kueue LocalQueue in the run's namespace: the rollout and trainer pods of each attempt carry "
        "Kueue's pod-group labels (kueue.x-k8s.io/queue-name, pod-group-name, pod-group-total-count), so Kueue admits "
        "them as one workload; until then they wait, gated, and the run is Pending (WaitingForAdmission).")
    gang_scheduling: GangScheduling = Field(default_factory=GangScheduling, description="Gang scheduling.")
    placement: Placement = Field(default_factory=Placement, description="Topology-aware placement per role (Kueue "
                                 "topology annotations or Volcano network topology).")
    managed_by: str | None = Field(
        None, min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*"
        r"[A-Za-z0-9])?$",
        description=f"The controller that runs this TrainingRun (a domain-prefixed path); unset or "
        f"{MANAGED_BY_OPERATOR!r}: the trainingrun operator; anything else (e.g. kueue.x-k8s.io/multikueue): the "
        "operator creates nothing and writes no status. Immutable.")
    pod_template: PodTemplateOverrides = Field(
        default_factory=PodTemplateOverrides, description="Pod settings for every pod of the run."
    )

    @model_validator(mode="after")
    def _rules(self) -> TrainingRunSpec:
        generated = self.rollout.source.type == "generate"
        if self.trainer.loss_type == "ppo" and not generated:
            raise ValueError(self.cel_rule("ppo-needs-generate").message)
        vllm, sync = self.rollout.engine.type == "vllm", self.weight_sync.type
        if generated and sync == "store" and vllm:
            raise ValueError(self.cel_rule("store-sync-needs-megatron").message)
        if generated and sync in ("disk", "broadcast") and not vllm:
            raise ValueError(self.cel_rule("disk-broadcast-sync-need-vllm").message)
        if self.trainer.moe.routing_replay and not (generated and not vllm):
            raise ValueError(self.cel_rule("routing-replay-needs-megatron-engine").message)
        if self.trainer.moe.routing_replay and self.rollout.partial_rollout:
            raise ValueError(self.cel_rule("routing-replay-without-partial-rollouts").message)
        if generated and vllm and self.model.hf is None:
            raise ValueError(self.cel_rule("vllm-needs-hf").message)
        placed = {(role, kind) for role in ("rollout", "trainer") for kind in ("kueue", "volcano")
                  if getattr(getattr(self.placement, role), kind) is not None}
        if placed & {("rollout", "kueue"), ("trainer", "kueue")} and self.queue_name is None:
            raise ValueError(self.cel_rule("kueue-placement-needs-queue").message)
        gang = self.gang_scheduling
        if placed & {("rollout", "volcano"), ("trainer", "volcano")} and not (gang.enabled and gang.provider == "volcano"):
            raise ValueError(self.cel_rule("volcano-placement-needs-volcano").message)
        t = self.placement.trainer
        sizes = [x for x in (t.kueue.slice_size if t.kueue else None, t.volcano.sub_group_size if t.volcano else None)
                 if x is not None]
        if any(self.trainer.replicas % size for size in sizes):
            raise ValueError(self.cel_rule("slices-divide-the-pods").message)
        pl = self.trainer.policy_loss
        if not generated and (pl.old_logprobs != "engine" or pl.rollout_correction.type != "none"):
            raise ValueError(self.cel_rule("policy-options-need-generate").message)
        gen = self.rollout.source.generate
        if generated and gen is not None and gen.sampling.temperature <= 0 and self.rollout.group_size >= 2 \
                and self.rollout.filters.zero_variance:
            raise ValueError(self.cel_rule("greedy-groups-never-vary").message)
        if self.trainer.performance.grad_reduce_dtype == "bf16" and self.model.precision != "bf16":
            raise ValueError(self.cel_rule("bf16-grad-reduce-needs-bf16").message)
        return self


# -------------------------------------------------------------------------------------------------------- status
Phase = Literal["Pending", "Running", "Restarting", "Succeeded", "Failed", "Suspended"]
PHASES: tuple[str, ...] = ("Pending", "Running", "Restarting", "Succeeded", "Failed", "Suspended")
TERMINAL_PHASES: frozenset[str] = frozenset({"Succeeded", "Failed"})


# Longest status.message / condition message the CRD admits; the operator cuts longer ones to fit (a status patch
# with a longer one would be refused as a whole).
MESSAGE_MAX_LENGTH = 4096


class Condition(ApiModel):
    """A Kubernetes condition (metav1.Condition conventions): one per type, keyed by type."""

    type: str = Field(..., max_length=316, pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                      r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
                      description="Running, Restarting, Suspended, Succeeded, Failed (lifecycle: one is True at a "
                      "time), PodsReady (False while Pending: why), ProgressUnknown (True while the store's progress "
                      "cannot be read).")
    status: Literal["True", "False", "Unknown"] = Field(..., description="True, False or Unknown.")
    observed_generation: int | None = Field(None, ge=0, le=INT64_MAX,
                                            description="The spec generation the condition was set from.")
    reason: str | None = Field(None, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
                               description="CamelCase reason.")
    message: str | None = Field(None, max_length=MESSAGE_MAX_LENGTH, description="Human-readable detail.")
    last_transition_time: str | None = Field(None, description="RFC 3339 time of the last change of status.")


class RoleRestartStatus(ApiModel):
    """Restarts of one replica of a role that restarts alone (the rollout, an engine replica): the role's budget is
    counted here, in the run's status, never in a child (a deleted pod never resets it)."""

    role: Literal["rollout", "engine"] = Field(..., description="The role.")
    replica: int = Field(0, ge=0, le=4096, description="The replica (engines); 0 for the rollout.")
    restarts: int = Field(0, ge=0, le=INT64_MAX, description="Restarts counted against failurePolicy.roles.<role>.")
    uncounted: int = Field(0, ge=0, le=INT64_MAX, description="Restarts that used no budget (disruptions, Ignore "
                           "rules); restarts + uncounted is the replica's current pod generation.")
    last_failure: str | None = Field(None, max_length=MESSAGE_MAX_LENGTH, description="What failed last time.")
    last_restart_time: str | None = Field(None, description="When the last restart was decided (RFC 3339).")
    backoff_seconds: int = Field(0, ge=0, le=MAX_SECONDS, description="The wait after lastRestartTime before the "
                                 "replacement is created.")
    replacing: bool = Field(False, description="The replacement pod of the current generation was not seen yet.")
    down: bool = Field(False, description="An engine replica out of the pool: it failed with "
                       "failurePolicy.roles.engine's budget spent while other replicas served; not replaced again "
                       "(the run fails once no replica is left).")


class PaceAnchor(ApiModel):
    """The progress the pace (for estimatedRemainingSeconds) is measured from: the first record of an attempt."""

    attempt: int = Field(0, ge=0, le=INT64_MAX, description="The trainers' attempt of that record.")
    rollouts_done: int = Field(0, ge=0, le=INT64_MAX, description="Rollouts done then.")
    time: str = Field(..., description="When that record was written (RFC 3339).")


class ProgressStatus(ApiModel):
    """How far the run is, from the trainers' progress record (`trainingrun.contract.progress`)."""

    percentage: int = Field(0, ge=0, le=100, description="Rollouts trained, in percent of rollout.numRollouts.")
    estimated_remaining_seconds: int | None = Field(
        None, ge=0, le=INT64_MAX, description="At this attempt's pace so far; unset until it is known.")
    rollouts_done: int = Field(0, ge=0, le=INT64_MAX, description="Rollouts trained (the one in training counts).")
    rollouts_total: int = Field(0, ge=0, le=INT64_MAX, description="spec.rollout.numRollouts.")
    updated_at: str | None = Field(None, description="When the trainers wrote the record (RFC 3339).")
    pace_from: PaceAnchor | None = Field(None, description="What the pace is measured from.")


class TrainingRunStatus(ApiModel):
    """Observed state of a TrainingRun, written by the operator from what it observes."""

    phase: Phase | None = Field(None, description="Pending, Running, Restarting, Succeeded, Failed or Suspended.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Conditions, one per type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    restarts: int = Field(0, ge=0, le=INT64_MAX, description="Whole-group restarts after application failures so far.")
    disruptions: int = Field(0, ge=0, le=INT64_MAX, description="Whole-group restarts after evicted, preempted or lost "
                             "pods (not counted against maxRestarts).")
    attempt: int = Field(0, ge=0, le=INT64_MAX, description="Current attempt (pods carry it as a label).")
    trainer_replicas: int | None = Field(None, ge=1, le=4096, description="Trainer pods of the current attempt "
                                         "(spec.trainer.replicas when it started).")
    step: int = Field(0, ge=0, le=INT64_MAX, description="Optimizer steps completed.")
    samples_consumed: int = Field(0, ge=0, le=INT64_MAX, description="Samples trained on so far.")
    last_global_batch_size: int = Field(0, ge=0, le=INT64_MAX, description="Samples in the last step.")
    rollout: int = Field(0, ge=0, le=INT64_MAX, description="Rollouts consumed.")
    start_time: str | None = Field(None, description="When the run started (RFC 3339).")
    completion_time: str | None = Field(None, description="When the run ended (RFC 3339).")
    observed_generation: int | None = Field(None, ge=0, le=INT64_MAX,
                                            description="The spec generation this status reflects.")
    message: str | None = Field(None, max_length=MESSAGE_MAX_LENGTH,
                                description="Last important message (e.g. why the run failed).")
    role_restarts: list[RoleRestartStatus] = Field(
        default_factory=list, max_length=4097, description="Restarts of the rollout and of each engine replica "
        "alone (failurePolicy RestartRole), one entry per replica that restarted.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["role", "replica"]})
    progress: ProgressStatus | None = Field(None, description="Percentage, rollouts done of the total and an "
                                            "estimate of the time left, from the trainers' progress record.")


class ObjectMeta(BaseModel):
    """The part of metadata this package reads; the rest passes through."""

    model_config = ConfigDict(extra="allow")
    name: str = Field("run", min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class TrainingRun(BaseModel):
    """A whole TrainingRun manifest."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    api_version: Literal[API_VERSION] = Field(API_VERSION, alias="apiVersion")  # type: ignore[valid-type]
    kind: Literal[KIND] = KIND  # type: ignore[valid-type]
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: TrainingRunSpec
    status: TrainingRunStatus | None = None


def parse_trainingrun(doc: dict[str, Any]) -> TrainingRun:
    """A TrainingRun from a decoded manifest (plain JSON values), validated strictly: no type coercion (`true` or
    `"2"` is not an integer), as the CRD's schema; raises pydantic.ValidationError on bad input."""
    return TrainingRun.model_validate(doc, strict=True)


ALL_MODELS: tuple[type[ApiModel], ...] = (
    ModelSpec,
    MoESpec,
    OptimizerSpec,
    CheckpointSpec,
    TrainerMoESpec,
    RecomputeSpec,
    PerformanceSpec,
    TrainerSpec,
    SyntheticSource,
    JsonlSource,
    SyntheticPrompts,
    ReasoningGymPrompts,
    PromptsJsonl,
    PromptsSpec,
    SamplingSpec,
    OverlongSpec,
    RewardSpec,
    EnvironmentSpec,
    GenerateSource,
    EngineSpec,
    WeightSyncSpec,
    RolloutCorrectionSpec,
    PolicyLossSpec,
    AdvantageSpec,
    SourceSpec,
    FilterSpec,
    StepPolicy,
    RolloutSpec,
    StoreSpec,
    TensorBoardSpec,
    SecretKeySelector,
    WandbSpec,
    MetricsSpec,
    FailureRule,
    RoleBudget,
    RoleBudgets,
    FailurePolicy,
    Toleration,
    PodTemplateOverrides,
    GangScheduling,
    KueueTopology,
    VolcanoTopology,
    RolePlacement,
    Placement,
    TrainingRunSpec,
    Condition,
    RoleRestartStatus,
    PaceAnchor,
    ProgressStatus,
    TrainingRunStatus,
    ResourceRequirements,
)
