"""LoRA's plan (no torch): which Megatron linear layers of an `Architecture` get adapters, the adapters' parts and
shapes, and the checks of `spec.trainer.lora` against the resolved model.

A target (`spec.trainer.lora.targets`) names Megatron linear layers of every transformer layer; each target has one
adapter *part* per Hugging Face projection the layer fuses, so the adapters are exactly PEFT's on the same model
(`q_proj`, `k_proj`, `v_proj` are three adapters of rank r on Megatron's fused `linear_qkv`, `gate_proj` and
`up_proj` two on `linear_fc1`):

  target          Megatron layer                 parallel   parts (HF projection: in -> out)
  attention_qkv   self_attention.linear_qkv      column     q: hidden -> heads*head_dim, k, v: hidden -> groups*head_dim
  attention_out   self_attention.linear_proj     row        o: heads*head_dim -> hidden
  mlp_in          mlp.linear_fc1 (dense layers)  column     gate, up: hidden -> ffn (SwiGLU); up: hidden -> ffn (GELU)
  mlp_out         mlp.linear_fc2 (dense layers)  row        down: ffn -> hidden
  experts         the experts' linear_fc1/fc2    —          refused: not built yet (`check_lora`)

A part's A is r x in, its B out x r; the layer's output gains (alpha / r) · B · A · dropout(x) (`modeling.lora`).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainingrun.modeling.architecture import Architecture

TARGETS: tuple[str, ...] = ("attention_qkv", "attention_out", "mlp_in", "mlp_out", "experts")
DEFAULT_TARGETS: tuple[str, ...] = ("attention_qkv", "attention_out", "mlp_in", "mlp_out")
MAX_RANK = 1024

# target -> (Megatron layer name inside a transformer layer, "column" | "row")
LAYERS: dict[str, tuple[str, str]] = {
    "attention_qkv": ("self_attention.linear_qkv", "column"),
    "attention_out": ("self_attention.linear_proj", "row"),
    "mlp_in": ("mlp.linear_fc1", "column"),
    "mlp_out": ("mlp.linear_fc2", "row"),
}


@dataclass(frozen=True)
class LoRASettings:
    """`spec.trainer.lora` as plain values: rank r, alpha (the output is scaled by alpha / r), input dropout and the
    targets."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def parts(target: str, arch: Architecture) -> tuple[tuple[str, int, int], ...]:
    """The adapter parts of `target` on `arch`: (HF projection name, in features, out features), whole-model sizes,
    in the order the Megatron layer fuses them."""
    hidden, hd = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * hd, arch.num_query_groups * hd
    if target == "attention_qkv":
        return (("q", hidden, q), ("k", hidden, kv), ("v", hidden, kv))
    if target == "attention_out":
        return (("o", q, hidden),)
    if target == "mlp_in":
        return (("gate", hidden, arch.ffn_hidden_size), ("up", hidden, arch.ffn_hidden_size)) if arch.gated else \
            (("up", hidden, arch.ffn_hidden_size),)
    if target == "mlp_out":
        return (("down", arch.ffn_hidden_size, hidden),)
    raise ValueError(f"trainer.lora.targets: {target!r} has no dense adapter; allowed: {', '.join(LAYERS)}")


def check_lora(lora: LoRASettings, arch: Architecture) -> None:
    """ValueError naming the field when `lora` does not fit `arch`: an unknown target, `experts` on a dense model
    (and, on a mixture of experts, not built yet), a rank above the smaller dimension of a targeted layer's part."""
    for target in lora.targets:
        if target not in TARGETS:
            raise ValueError(f"trainer.lora.targets: unknown target {target!r}; allowed: {', '.join(TARGETS)}")
    if "experts" in lora.targets:
        if arch.moe is None:
            raise ValueError("trainer.lora.targets: experts needs a mixture-of-experts model, and this model is dense "
                             "(no experts); allowed: attention_qkv, attention_out, mlp_in, mlp_out")
        raise ValueError("trainer.lora.targets: experts (an adapter per expert) is not built yet; allowed: "
                         "attention_qkv, attention_out, mlp_in, mlp_out")
    if not 1 <= lora.rank <= MAX_RANK:
        raise ValueError(f"trainer.lora.rank: {lora.rank}; allowed: 1 to {MAX_RANK}")
    for target in lora.targets:
        for name, n_in, n_out in parts(target, arch):
            if lora.rank > min(n_in, n_out):
                raise ValueError(f"trainer.lora.rank: {lora.rank} is above the smaller dimension of {target}'s "
                                 f"{name} projection ({n_in} -> {n_out}); allowed: 1 to {min(n_in, n_out)} for "
                                 f"this model and these targets")
