"""The model's architecture as one typed value, `Architecture`, and the tables a spec's model is resolved from.

Each process resolves its run's model once — `trainingrun.api.models.ModelSpec.resolved()`: a preset, explicit
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
# What a spec without `hf` or `preset` must set itself.
REQUIRED_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length")

# Fields the plain record holds only when set (not at their default), so that records written without them stay
# exactly as they were.
_RECORD_WHEN_SET = ("hf_model_type", "attention_backend")
_INTS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim", "ffn_hidden_size",
         "vocab_size", "seq_length")
_BOOLS = ("tie_embeddings", "add_bias_linear", "add_qkv_bias")
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

    @property
    def gated(self) -> bool:
        """SwiGLU: the first MLP layer holds the gate and the up projection ([2f, h])."""
        return self.activation == "swiglu"

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
    unknown = sorted(set(fields) - {*ARCH_FIELDS, "seq_length"})
    if unknown:
        raise ValueError(f"model: {', '.join(unknown)} is not an architecture field; allowed: "
                         f"{', '.join((*ARCH_FIELDS, 'seq_length'))}")
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
