"""Hugging Face `config.json` ↔ `modeling.architecture.Architecture` (plain Python, no torch).

Reading (`hf_architecture`) accepts the Llama family as transformers writes it — `model_type` llama, mistral
(without a sliding window shorter than the sequence) and qwen2 (bias on q/k/v) — in both the v4 form (`rope_theta`,
`rope_scaling`) and the v5 form (`rope_parameters`). Anything this trainer would silently compute differently is
refused with the config key named: another activation than SiLU, attention bias without MLP bias (Megatron has one
switch for every linear layer), RoPE scaling other than Llama 3's, sliding windows, query/key norms.

Writing (`hf_config_for`) is the inverse; when the run was initialised from a Hugging Face directory, its original
config.json is the base and only the architecture keys are overwritten, so token ids, chat settings and the like
survive an export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainingrun.modeling.architecture import Architecture

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# Megatron's Llama-3 RoPE scaling has these constants built in (rotary_pos_embedding._apply_scaling).
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class HFConfigError(ValueError):
    """config.json cannot be mapped onto a model this trainer builds; the message names the key."""


def read_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    try:
        text = path.read_text()
    except OSError as exc:
        where = "" if Path(hf_dir).is_absolute() else f" (relative to {Path.cwd()})"
        raise HFConfigError(f"model.hf: cannot read {path}{where}: {exc.strerror or exc}") from None
    try:
        cfg = json.loads(text)
    except ValueError as exc:
        raise HFConfigError(f"model.hf: {path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise HFConfigError(f"model.hf: {path} must hold a JSON object")
    return cfg


def _rope(cfg: dict[str, Any], where: str) -> tuple[float, float | None]:
    """(rope base, Llama-3 scaling factor or None) from either config form."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:  # transformers v5
        base, scaling = params.get("rope_theta"), params
    else:
        base, scaling = cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling")
    if not isinstance(base, (int, float)) or isinstance(base, bool) or base <= 0:
        raise HFConfigError(f"{where}: rope_theta: must be a positive number, got {base!r}")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")) if scaling else "default"
    if kind == "default":
        return float(base), None
    if kind == "llama3":
        for key, value in LLAMA3_ROPE.items():
            if float(scaling.get(key, value)) != value:
                raise HFConfigError(f"{where}: rope_scaling.{key}: {scaling.get(key)} is not supported (Megatron's "
                                    f"Llama-3 RoPE scaling uses {value})")
        return float(base), float(scaling.get("factor", 8.0))
    raise HFConfigError(f"{where}: rope_scaling: type {kind!r} is not supported; allowed: none (default) or llama3")


def hf_architecture(cfg: dict[str, Any], where: str = "config.json") -> Architecture:
    """The architecture of a Hugging Face config (seq_length = its max_position_embeddings; precision,
    transformer_impl and hf at their defaults: `read_hf_architecture` sets them for a run)."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFConfigError(f"{where}: model_type: {model_type!r} is not supported; allowed: "
                            f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family models)")

    def need_int(key: str, default: Any = None) -> int:
        value = cfg.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise HFConfigError(f"{where}: {key}: must be a positive integer, got {value!r}")
        return value

    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise HFConfigError(f"{where}: hidden_act: {act!r} is not supported; allowed: silu (SwiGLU MLP)")
    heads = need_int("num_attention_heads")
    hidden = need_int("hidden_size")
    groups = need_int("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    if not isinstance(head_dim, int) or head_dim < 1:
        raise HFConfigError(f"{where}: head_dim: must be a positive integer, got {head_dim!r}")
    if heads % groups:
        raise HFConfigError(f"{where}: num_key_value_heads: {groups} does not divide num_attention_heads {heads}")
    seq = need_int("max_position_embeddings", 2048)
    if model_type == "qwen2":
        qkv_bias, bias = True, False
        if cfg.get("use_sliding_window"):
            raise HFConfigError(f"{where}: use_sliding_window: true is not supported (full attention only)")
    else:
        attn_bias, mlp_bias = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))
        if attn_bias != mlp_bias:
            raise HFConfigError(f"{where}: attention_bias: {attn_bias} with mlp_bias {mlp_bias} is not supported: "
                                "Megatron puts biases on every linear layer or on none (set both alike)")
        bias, qkv_bias = attn_bias, False
    window = cfg.get("sliding_window")
    if model_type == "mistral" and window is not None and int(window) < seq:
        raise HFConfigError(f"{where}: sliding_window: {window} < max_position_embeddings {seq} is not supported "
                            "(full attention only)")
    base, scaling = _rope(cfg, where)
    eps = cfg.get("rms_norm_eps", 1e-6)
    layers, ffn, vocab = need_int("num_hidden_layers"), need_int("intermediate_size"), need_int("vocab_size")
    try:
        return Architecture(
            family="llama",
            num_layers=layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=groups,
            head_dim=int(head_dim),
            ffn_hidden_size=ffn,
            vocab_size=vocab,
            seq_length=seq,
            normalization="RMSNorm",
            norm_epsilon=eps,
            activation="swiglu",
            rope_base=base,
            rope_scaling_factor=scaling,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            add_bias_linear=bias,
            add_qkv_bias=qkv_bias,
            hf_model_type=model_type,
        )
    except ValueError as exc:  # a value the architecture refuses (rms_norm_eps <= 0, ...)
        raise HFConfigError(f"{where}: {exc}") from None


def read_hf_architecture(hf_dir: str | Path, *, seq_length: int | None = None, precision: str = "fp32",
                         transformer_impl: str = "auto") -> Architecture:
    """The architecture of a run initialised from the Hugging Face directory `hf_dir` (`spec.model.hf`): its
    config.json, with `seq_length` (default and upper bound: max_position_embeddings), the run's precision and layer
    implementation, and `hf` = the directory."""
    arch = hf_architecture(read_config(hf_dir), where=f"model.hf: {Path(hf_dir) / 'config.json'}")
    if seq_length is not None:
        if seq_length > arch.seq_length:
            raise ValueError(f"model.seqLength: {seq_length} exceeds the model's max_position_embeddings "
                             f"{arch.seq_length} (config.json of {hf_dir})")
    else:
        seq_length = arch.seq_length
    return arch.replace(seq_length=seq_length, precision=precision, transformer_impl=transformer_impl,
                        hf=str(hf_dir))


def exportable(arch: Architecture) -> str | None:
    """None if `arch` has a Hugging Face counterpart, else why not (one line)."""
    if arch.family != "llama" or arch.normalization != "RMSNorm" or arch.activation != "swiglu":
        return (f"architecture {arch.family} ({arch.normalization} + {arch.activation}) has "
                "no Hugging Face counterpart; only llama-architecture models (RMSNorm + SwiGLU) export")
    if arch.add_qkv_bias and arch.add_bias_linear:
        return "addQkvBias together with addBiasLinear has no Hugging Face counterpart"
    return None


def hf_config_for(arch: Architecture, base: dict[str, Any] | None = None, dtype: str = "float32") -> dict[str, Any]:
    """A config.json for `arch` (LlamaForCausalLM, or Qwen2ForCausalLM for q/k/v-only bias). `base`: the config the
    run started from; its other keys (token ids, ...) are kept."""
    why = exportable(arch)
    if why:
        raise HFConfigError(f"export-hf: {why}")
    qwen = arch.add_qkv_bias
    model_type = "qwen2" if qwen else (base or {}).get("model_type", "llama")
    if model_type == "qwen2" and not qwen:
        model_type = "llama"
    cfg = dict(base or {})
    for stale in ("rope_parameters", "rope_scaling", "rope_theta", "quantization_config", "_name_or_path",
                  "torch_dtype", "dtype", "transformers_version"):
        cfg.pop(stale, None)
    arch_name = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]
    cfg.update({
        "architectures": [arch_name],
        "model_type": model_type,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.ffn_hidden_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_query_groups,
        "head_dim": arch.head_dim,
        "vocab_size": arch.vocab_size,
        "max_position_embeddings": max(arch.seq_length, int((base or {}).get("max_position_embeddings", 0))),
        "rms_norm_eps": arch.norm_epsilon,
        "hidden_act": "silu",
        "rope_theta": arch.rope_base,
        "rope_scaling": None if arch.rope_scaling_factor is None else
        {"rope_type": "llama3", "factor": arch.rope_scaling_factor, **LLAMA3_ROPE},
        "tie_word_embeddings": arch.tie_embeddings,
        "torch_dtype": dtype,
    })
    if model_type == "qwen2":
        cfg.setdefault("use_sliding_window", False)
    else:
        cfg["attention_bias"] = arch.add_bias_linear
        cfg["mlp_bias"] = arch.add_bias_linear
    if model_type == "mistral":
        cfg["sliding_window"] = None
    cfg.setdefault("initializer_range", 0.02)
    cfg.setdefault("use_cache", True)
    return cfg
