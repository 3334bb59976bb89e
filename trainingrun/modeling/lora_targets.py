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

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

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

    @classmethod
    def from_spec(cls, lora) -> LoRASettings:
        """Of `spec.trainer.lora` (api.spec.trainer.LoRASpec: rank, resolved_alpha, dropout, targets)."""
        return cls(rank=lora.rank, alpha=lora.resolved_alpha, dropout=lora.dropout, targets=tuple(lora.targets))


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


# ---------------------------------------------------------------------------------------------- PEFT adapters in
# target -> the Hugging Face modules (PEFT's target_modules) its parts adapt
HF_TARGETS: dict[str, tuple[str, ...]] = {"attention_qkv": ("q_proj", "k_proj", "v_proj"), "attention_out": ("o_proj",),
                                          "mlp_in": ("gate_proj", "up_proj"), "mlp_out": ("down_proj",)}
_PEFT_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def read_adapter(path: str | Path) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """A PEFT adapter directory's adapter_config.json and the shapes of adapter_model.safetensors' tensors (from the
    file's header, no torch). ValueError naming `model.adapter` when either is missing or unreadable."""
    path = Path(path)
    try:
        config = json.loads((path / "adapter_config.json").read_text())
        with open(path / "adapter_model.safetensors", "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    except (OSError, ValueError, struct.error) as exc:
        raise ValueError(f"model.adapter: {path} is not a readable PEFT adapter directory (adapter_config.json, "
                         f"adapter_model.safetensors): {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"model.adapter: {path}/adapter_config.json is not a JSON object")
    return config, {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def check_adapter(path: str | Path, lora: LoRASettings, arch: Architecture) -> dict[str, tuple[int, ...]]:
    """ValueError naming `model.adapter` when the PEFT adapter at `path` is not `lora` on `arch`: another type, rank,
    alpha or targets, or tensors of other names or shapes (another base architecture). Its tensors' shapes."""
    config, shapes = read_adapter(path)
    want_modules = sorted(m for t in lora.targets for m in HF_TARGETS.get(t, ()))
    got = config.get("target_modules")
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r}, not 'LORA'")
    if config.get("r") != lora.rank:
        problems.append(f"rank {config.get('r')}, trainer.lora.rank {lora.rank}")
    if not isinstance(config.get("lora_alpha"), (int, float)) or float(config["lora_alpha"]) != float(lora.alpha):
        problems.append(f"lora_alpha {config.get('lora_alpha')}, trainer.lora.alpha {lora.alpha:g}")
    if config.get("use_rslora") or config.get("use_dora"):
        problems.append("rsLoRA/DoRA scaling, which trainer.lora does not compute")
    if not arch.gated and any(t.startswith("mlp") for t in lora.targets):
        problems.append("a GELU (gpt) model's MLP has no PEFT module names")
    if not isinstance(got, list) or sorted(got) != want_modules:
        problems.append(f"target_modules {got}, trainer.lora.targets {list(lora.targets)} (= {want_modules})")
    if not problems:
        expected = {}
        for target in lora.targets:
            for (name, n_in, n_out), module in zip(parts(target, arch), HF_TARGETS[target]):
                group = "self_attn" if target.startswith("attention") else "mlp"
                for layer in range(arch.num_layers):
                    pre = f"base_model.model.model.layers.{layer}.{group}.{module}"
                    expected[f"{pre}.lora_A.weight"] = (lora.rank, n_in)
                    expected[f"{pre}.lora_B.weight"] = (n_out, lora.rank)
        missing = sorted(set(expected) - set(shapes))
        extra = sorted(set(shapes) - set(expected))
        wrong = sorted(k for k in set(expected) & set(shapes) if shapes[k] != expected[k])
        if missing or extra or wrong:
            problems.append(f"its tensors do not fit this model (another base architecture?): missing {missing[:3]}, "
                            f"unexpected {extra[:3]}, misshapen " +
                            str([f"{k} {shapes[k]} (model: {expected[k]})" for k in wrong[:3]]))
    if problems:
        raise ValueError(f"model.adapter: {path} does not match: {'; '.join(problems)}")
    return shapes
