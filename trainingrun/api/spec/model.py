"""`spec.model`: the model to train (a Hugging Face directory, a preset or explicit sizes) and its mixture of
experts; `ModelSpec.resolved()` gives the typed `modeling.architecture.Architecture` each process resolves once."""

from __future__ import annotations

from typing import Annotated, Any, overload

from pydantic import Field, model_validator
from pydantic.alias_generators import to_camel

from trainingrun.api.spec.base import ApiModel, Rule
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
    adapter: str | None = Field(
        None, min_length=1, max_length=4096,
        description="A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors; e.g. `trainingrun "
        "export-hf --adapter` of an SFT run) whose adapters the run starts from instead of fresh ones; needs "
        "trainer.lora with the adapter's rank, alpha and targets.")
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
