"""The model's architecture as one typed value, `Architecture`, and the tables a spec's model is resolved from.

Each process resolves its run's model once — `trainingrun.api.spec.model.ModelSpec.resolved()`: a preset, explicit
sizes, or a Hugging Face directory's config.json (`modeling.hf_config.read_hf_architecture`) — and passes the value
down to whatever builds, converts, gathers, scores or checks the model. Nothing here imports torch, so the API, the
operator and `trainingrun validate` use it for free.

Resolution of spec fields (`resolve`): the preset's values, the explicit fields over them, the family's defaults
(`FAMILY_DEFAULTS`) for what is still unset, then the derived sizes — `ffn_hidden_size` (`default_ffn_hidden_size`),
`num_query_groups` = heads, `head_dim` = hidden / heads. Families: `gpt` is LayerNorm + GELU (the original preset
family, no Hugging Face counterpart); `llama` is RMSNorm + SwiGLU + grouped-query attention (Llama, Mistral, Qwen2,
SmolLM2, ...; exports to Hugging Face). A family only sets defaults: explicit fields override them.

The plain form (`to_dict` / `from_dict`) is what checkpoints record (meta.json's `model`) and what the rollout's
config fingerprint hashes: snake_case keys, the family under `architecture`, and `kv_channels` (= `head_dim`, the key
older readers use). Growing the type: a new family adds its name to `Family` and a row to `FAMILY_DEFAULTS`; an
option some families lack (e.g. a mixture-of-experts block) is an optional sub-value defaulting to None, written to
the plain form only when set, so the records of existing runs (and their fingerprints) stay as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, get_args

Family = Literal["gpt", "llama"]
Normalization = Literal["LayerNorm", "RMSNorm"]
Activation = Literal["gelu", "swiglu"]
Precision = Literal["fp32", "bf16", "fp16"]
TransformerImpl = Literal["auto", "local", "transformer_engine"]
AttentionBackend = Literal["auto", "te", "flash", "sdpa"]  # how packed (THD) attention runs: modeling.model
PresetName = Literal["tiny", "small", "gpt-125m", "tiny-llama", "llama-1b", "llama-8b"]

FAMILIES: tuple[str, ...] = get_args(Family)

# What each family sets the fields it leaves unset to (the spec's explicit fields and a preset's values win).
FAMILY_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "gpt": MappingProxyType(dict(normalization="LayerNorm", activation="gelu", norm_epsilon=1e-5, rope_base=10000.0,
                                 tie_embeddings=False, add_bias_linear=False, add_qkv_bias=False)),
    "llama": MappingProxyType(dict(normalization="RMSNorm", activation="swiglu", norm_epsilon=1e-5,
                                   rope_base=10000.0, tie_embeddings=False, add_bias_linear=False,
                                   add_qkv_bias=False)),
})

MODEL_PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    # GPT family (LayerNorm + GELU)
    "tiny": MappingProxyType(dict(architecture="gpt", num_layers=2, hidden_size=64, num_attention_heads=4,
                                  vocab_size=256, seq_length=256)),
    "small": MappingProxyType(dict(architecture="gpt", num_layers=4, hidden_size=256, num_attention_heads=8,
                                   vocab_size=1024, seq_length=1024)),
    "gpt-125m": MappingProxyType(dict(architecture="gpt", num_layers=12, hidden_size=768, num_attention_heads=12,
                                      vocab_size=50304, seq_length=2048)),
    # Llama family (RMSNorm + SwiGLU + GQA); sizes of Llama 3.2 1B and Llama 3.1 8B (without their RoPE scaling)
    "tiny-llama": MappingProxyType(dict(architecture="llama", num_layers=2, hidden_size=64, num_attention_heads=4,
                                        num_query_groups=2, ffn_hidden_size=192, vocab_size=256, seq_length=256)),
    "llama-1b": MappingProxyType(dict(architecture="llama", num_layers=16, hidden_size=2048, num_attention_heads=32,
                                      num_query_groups=8, ffn_hidden_size=8192, vocab_size=128256, seq_length=8192,
                                      rope_base=500000.0, tie_embeddings=True)),
    "llama-8b": MappingProxyType(dict(architecture="llama", num_layers=32, hidden_size=4096, num_attention_heads=32,
                                      num_query_groups=8, ffn_hidden_size=14336, vocab_size=128256, seq_length=8192,
                                      rope_base=500000.0)),
})
if set(MODEL_PRESETS) != set(get_args(PresetName)):  # the API's enum of preset names is PresetName
    raise AssertionError(f"MODEL_PRESETS {sorted(MODEL_PRESETS)} differ from PresetName {get_args(PresetName)}")

# The spec fields (snake_case) that describe the architecture and its sizes: with `model.hf` they all come from the
# directory's config.json instead.
ARCH_FIELDS = ("architecture", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim",
               "ffn_hidden_size", "vocab_size", "normalization", "norm_epsilon", "activation", "rope_base",
               "tie_embeddings", "add_bias_linear", "add_qkv_bias")
# Architecture fields no family sets a default for (a Qwen3 query/key norm, a mixture-of-experts block).
OPTIONAL_ARCH_FIELDS = ("qk_norm", "moe")
# What a spec without `hf` or `preset` must set itself.
REQUIRED_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length")

# Fields the plain record holds only when set (not at their default), so that records written without them stay
# exactly as they were.
_RECORD_WHEN_SET = ("hf_model_type", "attention_backend", "qk_norm", "moe")
_INTS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim", "ffn_hidden_size",
         "vocab_size", "seq_length")
_BOOLS = ("tie_embeddings", "add_bias_linear", "add_qkv_bias", "qk_norm")
_CHOICES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "family": FAMILIES, "normalization": get_args(Normalization), "activation": get_args(Activation),
    "precision": get_args(Precision), "transformer_impl": get_args(TransformerImpl),
    "attention_backend": get_args(AttentionBackend),
})

# attentionBackend × transformerImpl pairs that cannot run: TE's attention exists only in TE's layer spec, which has
# no other (the API's CEL rules say the same at admission).
TE_NEEDS_TE_LAYERS = ("model.attentionBackend te is TransformerEngine's attention, which runs in its layer spec: set "
                      "transformerImpl auto or transformer_engine, or attentionBackend flash or sdpa")
TE_LAYERS_NEED_TE = ("model.transformerImpl transformer_engine runs TransformerEngine's own attention: set "
                     "attentionBackend auto or te (flash and sdpa are core attentions of the local layer spec)")
_CONTRADICTIONS: Mapping[tuple[str, str], str] = MappingProxyType({
    ("te", "local"): TE_NEEDS_TE_LAYERS,
    ("flash", "transformer_engine"): TE_LAYERS_NEED_TE,
    ("sdpa", "transformer_engine"): TE_LAYERS_NEED_TE,
})


def spec_field(name: str) -> str:
    """The spec's (camelCase) name of an architecture field, as error messages name it: `model.numQueryGroups`."""
    if name == "family":
        return "model.architecture"
    head, *rest = name.split("_")
    return "model." + head + "".join(part.capitalize() for part in rest)


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{spec_field(name)}: must be a positive integer, got {value!r}")


def default_ffn_hidden_size(family: str, hidden_size: int) -> int:
    """4·hidden for GPT; for SwiGLU models 8/3·hidden rounded up to a multiple of 64 (same parameter count)."""
    if family == "llama":
        return -(-(8 * hidden_size // 3) // 64) * 64
    return 4 * hidden_size


@dataclass(frozen=True)
class MoE:
    """The mixture-of-experts block of an `Architecture` (None: every MLP is dense). Layer i is a mixture of experts
    when i is not in `dense_layers` and (i + 1) is a multiple of `sparse_step` (Qwen-MoE's `decoder_sparse_step` and
    `mlp_only_layers`); the other layers keep the dense MLP of `Architecture.ffn_hidden_size`."""

    num_experts: int
    top_k: int  # experts per token
    ffn_hidden_size: int  # of one expert (Hugging Face moe_intermediate_size; Mixtral's intermediate_size)
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum 1 (Mixtral: always)
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()
    shared_expert_ffn_size: int | None = None  # a shared expert beside the routed ones (Qwen2-MoE)
    shared_expert_gate: bool = False  # its output scaled by sigmoid(gate · x)
    aux_loss_coeff: float = 0.0  # the load-balancing loss's coefficient (Hugging Face router_aux_loss_coef)

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "ffn_hidden_size", "sparse_step"):
            _check_positive_int(f"moe.{name}", getattr(self, name))
        if self.top_k > self.num_experts:
            raise ValueError(f"model.moe.topK: {self.top_k} exceeds numExperts {self.num_experts}; allowed: 1 to "
                             f"{self.num_experts}")
        if self.shared_expert_ffn_size is not None:
            _check_positive_int("moe.shared_expert_ffn_size", self.shared_expert_ffn_size)
        elif self.shared_expert_gate:
            raise ValueError("model.moe.sharedExpertGate: true needs model.moe.sharedExpertFfnSize")
        for name in ("norm_topk_prob", "shared_expert_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{spec_field('moe.' + name)}: must be true or false, got {getattr(self, name)!r}")
        layers = tuple(self.dense_layers)
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in layers):
            raise ValueError(f"model.moe.denseLayers: must be layer indices >= 0, got {list(layers)!r}")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(layers))))
        coeff = self.aux_loss_coeff
        if not isinstance(coeff, (int, float)) or isinstance(coeff, bool) or not 0 <= coeff < float("inf"):
            raise ValueError(f"model.moe.auxLossCoeff: must be a number >= 0, got {coeff!r}")
        object.__setattr__(self, "aux_loss_coeff", float(coeff))

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0

    @classmethod
    def from_dict(cls, data: Any) -> MoE:
        if isinstance(data, MoE):
            return data
        if not isinstance(data, Mapping):
            raise ValueError(f"model.moe: must be an object of mixture-of-experts fields, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"model.moe: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(names))}")
        values = dict(data)
        if "dense_layers" in values and isinstance(values["dense_layers"], list):
            values["dense_layers"] = tuple(values["dense_layers"])
        try:
            return cls(**values)
        except TypeError as exc:  # a required field missing
            raise ValueError(f"model.moe: {exc}") from None


@dataclass(frozen=True)
class Architecture:
    """A model this trainer builds, fully resolved (see the module docstring). Invalid values are refused on
    construction with a ValueError naming the spec field, what was wrong and what is allowed."""

    family: Family  # the spec's model.architecture
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # key/value heads (grouped-query attention)
    head_dim: int  # size of one attention head (Megatron's kv_channels)
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int  # positions (longest sample in tokens)
    normalization: Normalization
    norm_epsilon: float
    activation: Activation
    rope_base: float
    rope_scaling_factor: float | None = None  # Llama-3 RoPE scaling (from a Hugging Face config only)
    tie_embeddings: bool = False
    add_bias_linear: bool = False  # biases in every linear layer
    add_qkv_bias: bool = False  # bias on the query/key/value projection only (Qwen2)
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3)
    moe: MoE | None = None  # mixture-of-experts MLPs (None: dense)
    # how the model is run, and where its initial weights come from
    precision: Precision = "fp32"
    transformer_impl: TransformerImpl = "auto"
    attention_backend: AttentionBackend = "auto"  # te | flash | sdpa, or auto: what the device offers
    hf: str | None = None  # Hugging Face directory of the initial weights (None: Megatron's seeded initialisation)
    hf_model_type: str | None = None  # config.json's model_type, when read from one

    def __post_init__(self) -> None:
        for name in _INTS:
            _check_positive_int(name, getattr(self, name))
        for name in ("norm_epsilon", "rope_base", "rope_scaling_factor"):
            value = getattr(self, name)
            if value is None and name == "rope_scaling_factor":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ValueError(f"{spec_field(name)}: must be a positive number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{spec_field(name)}: must be true or false, got {getattr(self, name)!r}")
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{spec_field(name)}: {getattr(self, name)!r} is not supported; allowed: "
                                 f"{', '.join(allowed)}")
        if (self.attention_backend, self.transformer_impl) in _CONTRADICTIONS:
            raise ValueError(_CONTRADICTIONS[self.attention_backend, self.transformer_impl])
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"model.numQueryGroups: {self.num_query_groups} does not divide numAttentionHeads "
                             f"{self.num_attention_heads}; allowed: a divisor of numAttentionHeads")
        if self.moe is not None:
            object.__setattr__(self, "moe", MoE.from_dict(self.moe))
            if self.family != "llama" or not self.gated:
                raise ValueError("model.moe: mixture-of-experts layers are SwiGLU experts of the llama architecture; "
                                 "allowed with architecture llama and activation swiglu")
            if self.add_bias_linear:
                raise ValueError("model.moe: experts without biases only (Megatron's MoE layer has none); set "
                                 "addBiasLinear false")
            if any(i >= self.num_layers for i in self.moe.dense_layers):
                raise ValueError(f"model.moe.denseLayers: {list(self.moe.dense_layers)} names layers past numLayers "
                                 f"{self.num_layers}")
            if not self.moe_layers:
                raise ValueError("model.moe: no layer is a mixture of experts (sparseStep and denseLayers leave none)")

    @property
    def gated(self) -> bool:
        """SwiGLU: the first MLP layer holds the gate and the up projection ([2f, h])."""
        return self.activation == "swiglu"

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the mixture-of-experts layers (empty for a dense model)."""
        if self.moe is None:
            return ()
        return tuple(i for i in range(self.num_layers) if self.moe.is_moe_layer(i))

    @property
    def qkv_bias(self) -> bool:
        """Whether the query/key/value projection has a bias (every linear layer has one, or only it)."""
        return self.add_bias_linear or self.add_qkv_bias

    def replace(self, **changes: Any) -> Architecture:
        """A copy with `changes` applied (and checked again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The plain form checkpoints record and the rollout's fingerprint hashes (see the module docstring)."""
        out = dataclasses.asdict(self)
        out["architecture"] = out.pop("family")
        out["kv_channels"] = self.head_dim
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in _RECORD_WHEN_SET:
            if out[name] == defaults[name]:
                del out[name]
        if "moe" in out:
            out["moe"]["dense_layers"] = list(out["moe"]["dense_layers"])
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Architecture:
        """Inverse of `to_dict` (a checkpoint's record). ValueError naming a missing, unknown or invalid key."""
        if not isinstance(data, Mapping):
            raise ValueError(f"model: must be an object of architecture fields, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)} - {"family"}
        unknown = sorted(set(data) - names - {"architecture", "kv_channels"})
        if unknown:
            raise ValueError(f"model: unknown architecture field(s) {', '.join(unknown)} (written by a newer "
                             "trainingrun?)")
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name != "family"]
        missing = [k for k in ("architecture", *required) if k not in data]
        if missing:
            raise ValueError(f"model: architecture field(s) {', '.join(missing)} missing")
        if "kv_channels" in data and data["kv_channels"] != data["head_dim"]:
            raise ValueError(f"model: kv_channels {data['kv_channels']!r} differs from head_dim {data['head_dim']!r}")
        values = {k: v for k, v in data.items() if k in names}
        return cls(family=data["architecture"], **values)


def resolve(preset: str | None = None, *, precision: str = "fp32", transformer_impl: str = "auto",
            attention_backend: str = "auto", **fields: Any) -> Architecture:
    """The architecture of a preset and/or explicit spec fields (snake_case names of `ARCH_FIELDS` and seq_length;
    None means unset), as the module docstring describes. ValueError naming the field on a bad combination."""
    unknown = sorted(set(fields) - {*ARCH_FIELDS, *OPTIONAL_ARCH_FIELDS, "seq_length"})
    if unknown:
        raise ValueError(f"model: {', '.join(unknown)} is not an architecture field; allowed: "
                         f"{', '.join((*ARCH_FIELDS, *OPTIONAL_ARCH_FIELDS, 'seq_length'))}")
    if preset is not None and preset not in MODEL_PRESETS:
        raise ValueError(f"model.preset: {preset!r} is not a preset; allowed: {', '.join(MODEL_PRESETS)}")
    values: dict[str, Any] = dict(MODEL_PRESETS[preset]) if preset is not None else {}
    values.update({k: v for k, v in fields.items() if v is not None})
    family = values.pop("architecture", "gpt")
    if family not in FAMILY_DEFAULTS:
        raise ValueError(f"model.architecture: {family!r} is not supported; allowed: {', '.join(FAMILIES)}")
    missing = [spec_field(k) for k in REQUIRED_FIELDS if k not in values]
    if missing:
        raise ValueError(f"model: set model.hf, model.preset, or all of numLayers, hiddenSize, numAttentionHeads, "
                         f"vocabSize and seqLength (missing {', '.join(missing)})")
    values = {**FAMILY_DEFAULTS[family], **values}
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    _check_positive_int("hidden_size", hidden)
    _check_positive_int("num_attention_heads", heads)
    values.setdefault("ffn_hidden_size", default_ffn_hidden_size(family, hidden))
    values.setdefault("num_query_groups", heads)
    if "head_dim" not in values:
        if hidden % heads:
            raise ValueError(f"model.hiddenSize: {hidden} is not divisible by numAttentionHeads {heads}; allowed: a "
                             "multiple of numAttentionHeads, or set model.headDim")
        values["head_dim"] = hidden // heads
    return Architecture(family=family, precision=precision, transformer_impl=transformer_impl,
                        attention_backend=attention_backend, **values)


def check_parallel(arch: Architecture, tp: int, ep: int) -> None:
    """ValueError naming the trainer field when the architecture cannot run at tensor-parallel size `tp` and
    expert-parallel size `ep` (the rules that need the resolved model; `trainingrun validate` applies them to models
    it can resolve, every trainer at start-up)."""
    if ep > 1 and arch.moe is None:
        raise ValueError(f"trainer.expertParallelSize: {ep} needs a mixture-of-experts model (model.moe, or model.hf "
                         "of a qwen3_moe, qwen2_moe or mixtral model); allowed for this dense model: 1")
    if arch.moe is not None and arch.moe.num_experts % ep:
        raise ValueError(f"trainer.expertParallelSize: {ep} does not divide the model's {arch.moe.num_experts} "
                         "experts; allowed: a divisor of the number of experts")
    if arch.moe is not None and tp > 1:
        raise ValueError(f"trainer.tensorParallelSize: {tp} with a mixture-of-experts model needs sequence "
                         "parallelism, which the packed variable-length micro-batches do not use; allowed: 1 (split "
                         "the experts with trainer.expertParallelSize instead)")
