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
  experts         mlp.experts.local_experts.<e>  column,    per expert e: gate_up: hidden -> 2*moe_ffn (one adapter
                  .linear_fc1 / .linear_fc2      row        on the fused gate and up, as PEFT's on HF's `gate_up_proj`);
                                                            down: moe_ffn -> hidden (refused on a dense model)

A part's A is r x in, its B out x r; the layer's output gains (alpha / r) · B · A · dropout(x) (`modeling.lora`).
The experts' adapters are those of PEFT's `target_parameters` on transformers' fused 3-D expert tensors
(`mlp.experts.gate_up_proj` [E, 2*moe_ffn, hidden], `mlp.experts.down_proj` [E, hidden, moe_ffn]; Qwen3-MoE,
Qwen2-MoE and Mixtral alike): PEFT keeps one A [E·r, in] (expert e: rows e·r … e·r+r−1) and one B [out, r·E] (expert e:
columns e, e+E, …) per tensor, which `modeling.lora.to_peft` / `from_peft` stack and split. The shared expert of a
Qwen2-MoE layer gets no adapter.
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
    if target == "experts" and arch.moe is not None:
        return expert_parts("linear_fc1", arch) + expert_parts("linear_fc2", arch)
    raise ValueError(f"trainer.lora.targets: {target!r} has no dense adapter; allowed: {', '.join(LAYERS)}")


EXPERT_LAYERS = ("linear_fc1", "linear_fc2")  # the layers of each expert (`mlp.experts.local_experts.<e>.<layer>`)
EXPERT_PREFIX = "mlp.experts.local_experts."
# the expert layer -> PEFT's target parameter (transformers' fused expert tensor, under model.layers.<i>)
HF_EXPERT_PARAMS = {"linear_fc1": "mlp.experts.gate_up_proj", "linear_fc2": "mlp.experts.down_proj"}


def expert_parts(layer: str, arch: Architecture) -> tuple[tuple[str, int, int], ...]:
    """The adapter part of one expert's `layer` (linear_fc1 or linear_fc2): (name, in, out), whole sizes; one part
    each (PEFT adapts the fused gate/up tensor with one A·B pair)."""
    hidden, ffn = arch.hidden_size, arch.moe.ffn_hidden_size
    if layer == "linear_fc1":
        return (("gate_up", hidden, 2 * ffn),) if arch.gated else (("up", hidden, ffn),)
    return (("down", ffn, hidden),)


def check_lora(lora: LoRASettings, arch: Architecture) -> None:
    """ValueError naming the field when `lora` does not fit `arch`: an unknown target, `experts` on a dense model,
    a rank above the smaller dimension of a targeted layer's part."""
    for target in lora.targets:
        if target not in TARGETS:
            raise ValueError(f"trainer.lora.targets: unknown target {target!r}; allowed: {', '.join(TARGETS)}")
    if "experts" in lora.targets and arch.moe is None:
        raise ValueError("trainer.lora.targets: experts needs a mixture-of-experts model, and this model is dense "
                         "(no experts); allowed: attention_qkv, attention_out, mlp_in, mlp_out")
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


def peft_expert_key(layer: int, expert_layer: str, ab: str) -> str:
    """PEFT's tensor name of the experts' adapter of `expert_layer` (linear_fc1 | linear_fc2) in `layer`: PEFT wraps
    transformers' experts module once per target parameter in the module's parameter order, so gate_up_proj (the
    first) is the inner one (`base_layer`)."""
    inner = ".base_layer" if expert_layer == EXPERT_LAYERS[0] else ""
    return f"base_model.model.model.layers.{layer}.mlp.experts{inner}.lora_{ab}.weight"


def peft_shapes(lora: LoRASettings, arch: Architecture) -> dict[str, tuple[int, ...]]:
    """Every tensor of the PEFT adapter of `lora` on `arch`: name -> shape (dense MLP targets on dense layers only,
    the experts' stacked over the experts: A [E·r, in], B [out, r·E])."""
    expected: dict[str, tuple[int, ...]] = {}
    r = lora.rank
    for target in lora.targets:
        for layer in range(arch.num_layers):
            moe_layer = arch.moe is not None and arch.moe.is_moe_layer(layer)
            if target == "experts":
                if moe_layer:
                    n = arch.moe.num_experts
                    for fc in EXPERT_LAYERS:
                        ((_, n_in, n_out),) = expert_parts(fc, arch)
                        expected[peft_expert_key(layer, fc, "A")] = (n * r, n_in)
                        expected[peft_expert_key(layer, fc, "B")] = (n_out, r * n)
                continue
            if target.startswith("mlp") and moe_layer:
                continue
            group = "self_attn" if target.startswith("attention") else "mlp"
            for (name, n_in, n_out), module in zip(parts(target, arch), HF_TARGETS[target]):
                pre = f"base_model.model.model.layers.{layer}.{group}.{module}"
                expected[f"{pre}.lora_A.weight"] = (r, n_in)
                expected[f"{pre}.lora_B.weight"] = (n_out, r)
    return expected


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
    expected = peft_shapes(lora, arch)
    # the modules some layer has (a mixture of experts without dense layers has no gate/up/down projection)
    want_modules = sorted({k.split(".")[-3] for k in expected if ".experts." not in k})
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
    want_params = [HF_EXPERT_PARAMS[layer] for layer in EXPERT_LAYERS] if "experts" in lora.targets else []
    if (config.get("target_parameters") or []) != want_params:
        problems.append(f"target_parameters {config.get('target_parameters')}, trainer.lora.targets "
                        f"{list(lora.targets)} (= {want_params})")
    if not problems:
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
