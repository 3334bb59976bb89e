"""Hugging Face `config.json` ↔ `modeling.architecture.Architecture` (plain Python, no torch).

Reading (`hf_architecture`) accepts the llama-family models transformers writes, in both the v4 form
(`rope_theta`, `rope_scaling`) and the v5 form (`rope_parameters`):

| model_type | what it adds to Llama |
|---|---|
| llama, mistral | — (mistral without a sliding window shorter than the sequence) |
| qwen2 | bias on q/k/v |
| qwen3 | per-head RMSNorm on queries and keys (`qk_norm`), `head_dim` |
| qwen3_moe | qwen3 + mixture-of-experts MLPs (`num_experts`, `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`, `decoder_sparse_step`, `mlp_only_layers`, `router_aux_loss_coef`) |
| qwen2_moe | qwen2 + mixture-of-experts MLPs with a sigmoid-gated shared expert (`shared_expert_intermediate_size`) |
| mixtral | mixture-of-experts MLPs (`num_local_experts`, `num_experts_per_tok`; the top-k probabilities renormalised) |

Anything this trainer would silently compute differently is refused with the config key named: another activation
than SiLU, attention bias without MLP bias (Megatron has one switch for every linear layer), RoPE scaling other than
Llama 3's, sliding windows (`sliding_window`, `use_sliding_window`, `layer_types`), Mixtral's router jitter.

Writing (`hf_config_for`) is the inverse; the model type written is `export_model_type(arch)` (the type the run was
read from when it still fits). When the run was initialised from a Hugging Face directory, its original config.json
is the base and only the architecture keys are overwritten, so token ids, chat settings and the like survive an
export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainingrun.modeling.architecture import Architecture, MoE

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")
# transformers' class of each model type (config.json's "architectures")
CAUSAL_LM_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                   "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                   "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
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
    qwen3 = model_type in ("qwen3", "qwen3_moe")
    heads = need_int("num_attention_heads")
    hidden = need_int("hidden_size")
    groups = need_int("num_key_value_heads", heads) if cfg.get("num_key_value_heads") is not None else heads
    head_dim = cfg.get("head_dim") or (128 if qwen3 and "head_dim" not in cfg else hidden // heads)
    if not isinstance(head_dim, int) or head_dim < 1:
        raise HFConfigError(f"{where}: head_dim: must be a positive integer, got {head_dim!r}")
    if heads % groups:
        raise HFConfigError(f"{where}: num_key_value_heads: {groups} does not divide num_attention_heads {heads}")
    seq = need_int("max_position_embeddings", 2048)
    layers = need_int("num_hidden_layers")
    _refuse_sliding_window(cfg, model_type, seq, where)
    if model_type in ("qwen2", "qwen2_moe"):
        qkv_bias, bias = bool(cfg.get("qkv_bias", True)), False
    elif qwen3:
        if cfg.get("attention_bias"):
            raise HFConfigError(f"{where}: attention_bias: true (biases on q/k/v and o_proj) is not supported: "
                                "Megatron's o_proj bias comes with MLP biases (allowed: false)")
        qkv_bias, bias = False, False
    else:
        attn_bias, mlp_bias = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))
        if attn_bias != mlp_bias:
            raise HFConfigError(f"{where}: attention_bias: {attn_bias} with mlp_bias {mlp_bias} is not supported: "
                                "Megatron puts biases on every linear layer or on none (set both alike)")
        bias, qkv_bias = attn_bias, False
    base, scaling = _rope(cfg, where)
    eps = cfg.get("rms_norm_eps", 1e-6)
    ffn, vocab = need_int("intermediate_size"), need_int("vocab_size")
    moe = _moe(cfg, model_type, layers, where, need_int) if model_type in MOE_MODEL_TYPES else None
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
            qk_norm=qwen3,
            moe=moe,
            hf_model_type=model_type,
        )
    except ValueError as exc:  # a value the architecture refuses (rms_norm_eps <= 0, top-k > experts, ...)
        raise HFConfigError(f"{where}: {exc}") from None


def _refuse_sliding_window(cfg: dict[str, Any], model_type: str, seq: int, where: str) -> None:
    """Sliding-window attention is not built (the packed SDPA core attention attends to the whole document)."""
    if cfg.get("use_sliding_window"):
        raise HFConfigError(f"{where}: use_sliding_window: true is not supported (full attention only; allowed: "
                            "false)")
    window = cfg.get("sliding_window")
    if model_type in ("mistral", "mixtral") and window is not None and int(window) < seq:
        raise HFConfigError(f"{where}: sliding_window: {window} < max_position_embeddings {seq} is not supported "
                            "(full attention only; allowed: null or at least max_position_embeddings)")
    kinds = cfg.get("layer_types")
    if isinstance(kinds, list) and any(k != "full_attention" for k in kinds):
        raise HFConfigError(f"{where}: layer_types: {sorted(set(kinds))} is not supported (full attention only; "
                            "allowed: full_attention)")


def _moe(cfg: dict[str, Any], model_type: str, layers: int, where: str, need_int) -> MoE:
    """The mixture-of-experts block of a qwen3_moe, qwen2_moe or mixtral config (transformers' defaults for absent
    keys)."""
    if model_type == "mixtral":
        if float(cfg.get("router_jitter_noise", 0.0) or 0.0) != 0.0:
            raise HFConfigError(f"{where}: router_jitter_noise: {cfg['router_jitter_noise']} is not supported "
                                "(allowed: 0)")
        experts = need_int("num_local_experts", 8)
        ffn, norm, step, dense, shared = need_int("intermediate_size"), True, 1, [], None
    else:
        key = "num_experts" if "num_experts" in cfg else "num_local_experts"
        experts = need_int(key, 128 if model_type == "qwen3_moe" else 60)
        ffn = need_int("moe_intermediate_size", 768 if model_type == "qwen3_moe" else 1408)
        norm = cfg.get("norm_topk_prob", False)
        step = need_int("decoder_sparse_step", 1)
        dense = cfg.get("mlp_only_layers") or []
        if not isinstance(dense, list) or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < layers
                                              for i in dense):
            raise HFConfigError(f"{where}: mlp_only_layers: must be a list of layer indices in [0, {layers}), "
                                f"got {dense!r}")
        shared = need_int("shared_expert_intermediate_size", 5632) if model_type == "qwen2_moe" else None
    if not isinstance(norm, bool):
        raise HFConfigError(f"{where}: norm_topk_prob: must be true or false, got {norm!r}")
    top_k = need_int("num_experts_per_tok", 2 if model_type == "mixtral" else 8 if model_type == "qwen3_moe" else 4)
    coeff = cfg.get("router_aux_loss_coef", 0.001)
    if not isinstance(coeff, (int, float)) or isinstance(coeff, bool) or coeff < 0:
        raise HFConfigError(f"{where}: router_aux_loss_coef: must be a number >= 0, got {coeff!r}")
    try:
        return MoE(num_experts=experts, top_k=top_k, ffn_hidden_size=ffn, norm_topk_prob=norm, sparse_step=step,
                   dense_layers=tuple(dense), shared_expert_ffn_size=shared, shared_expert_gate=shared is not None,
                   aux_loss_coeff=float(coeff))
    except ValueError as exc:
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


def export_model_type(arch: Architecture) -> str:
    """The Hugging Face model type `arch` exports as: the type it was read from when that still describes it, else
    the first that does (HFConfigError naming what has no counterpart)."""
    why = exportable(arch)
    if why:
        raise HFConfigError(f"export-hf: {why}")
    moe = arch.moe
    if moe is not None:
        if moe.shared_expert_ffn_size is not None:
            return "qwen2_moe"
        return "qwen3_moe" if arch.qk_norm else "mixtral"
    if arch.qk_norm:
        return "qwen3"
    if arch.add_qkv_bias:
        return "qwen2"
    return arch.hf_model_type if arch.hf_model_type in ("llama", "mistral") else "llama"


def exportable(arch: Architecture) -> str | None:
    """None if `arch` has a Hugging Face counterpart, else why not (one line)."""
    if arch.family != "llama" or arch.normalization != "RMSNorm" or arch.activation != "swiglu":
        return (f"architecture {arch.family} ({arch.normalization} + {arch.activation}) has "
                "no Hugging Face counterpart; only llama-architecture models (RMSNorm + SwiGLU) export")
    if arch.add_qkv_bias and arch.add_bias_linear:
        return "addQkvBias together with addBiasLinear has no Hugging Face counterpart"
    if arch.qk_norm and arch.qkv_bias:
        return "qkNorm with q/k/v biases has no Hugging Face counterpart (Qwen3 has no q/k/v bias)"
    moe = arch.moe
    if moe is None:
        return None
    if moe.shared_expert_ffn_size is not None:
        if arch.qk_norm or not moe.shared_expert_gate or not arch.add_qkv_bias:
            return ("a shared expert exports as qwen2_moe only: with its sigmoid gate, q/k/v biases and no qkNorm")
    elif not arch.qk_norm and (moe.dense_layers or moe.sparse_step != 1 or not moe.norm_topk_prob):
        return ("a mixture of experts without qkNorm exports as mixtral only: every layer a mixture of experts, the "
                "top-k probabilities renormalised (normTopkProb)")
    if arch.add_qkv_bias and moe.shared_expert_ffn_size is None:
        return "a mixture of experts with q/k/v biases exports as qwen2_moe only (with a shared expert)"
    return None


def hf_config_for(arch: Architecture, base: dict[str, Any] | None = None, dtype: str = "float32") -> dict[str, Any]:
    """A config.json for `arch` (its class by `export_model_type`). `base`: the config the run started from; its other
    keys (token ids, ...) are kept."""
    model_type = export_model_type(arch)
    cfg = dict(base or {}) if (base or {}).get("model_type") == model_type else {
        k: v for k, v in (base or {}).items() if k in _PORTABLE_KEYS}
    for stale in ("rope_parameters", "rope_scaling", "rope_theta", "quantization_config", "_name_or_path",
                  "torch_dtype", "dtype", "transformers_version", "layer_types", "num_local_experts", "num_experts"):
        cfg.pop(stale, None)
    moe = arch.moe
    cfg.update({
        "architectures": [CAUSAL_LM_CLASS[model_type]],
        "model_type": model_type,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.ffn_hidden_size if model_type != "mixtral" else moe.ffn_hidden_size,
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
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        cfg["use_sliding_window"] = False
    if model_type in ("qwen2_moe",):
        cfg["qkv_bias"] = arch.add_qkv_bias
    if model_type in ("llama", "mistral", "qwen3", "qwen3_moe"):
        cfg["attention_bias"] = arch.add_bias_linear
    if model_type in ("llama", "mistral"):
        cfg["mlp_bias"] = arch.add_bias_linear
    if model_type in ("mistral", "mixtral"):
        cfg["sliding_window"] = None
    if moe is not None:
        cfg.update({"num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_coeff,
                    "output_router_logits": False})
        if model_type == "mixtral":
            cfg.update({"num_local_experts": moe.num_experts, "router_jitter_noise": 0.0})
        else:
            cfg.update({"num_experts": moe.num_experts, "moe_intermediate_size": moe.ffn_hidden_size,
                        "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": moe.sparse_step,
                        "mlp_only_layers": list(moe.dense_layers)})
        if model_type == "qwen2_moe":
            cfg["shared_expert_intermediate_size"] = moe.shared_expert_ffn_size
    cfg.setdefault("initializer_range", 0.02)
    cfg.setdefault("use_cache", True)
    return cfg


# Keys of a base config that another model type keeps (token ids, generation settings).
_PORTABLE_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
                  "max_position_embeddings")
