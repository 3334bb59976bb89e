"""Megatron ↔ Hugging Face weights: one table of names (`NAME_RULES`: each row a Megatron tensor, its HF tensors and the
pair of inverse reshuffles, import and export), and the tensor-parallel layout.

Names. Megatron names here are *canonical*: those of `GPTModel` with the local layer spec. The TransformerEngine
spec fuses the pre-attention and pre-MLP norms into the following linear layer (`linear_qkv.layer_norm_weight`,
`linear_fc1.layer_norm_weight`) and adds `_extra_state` blobs; `canonical_names` / `model_names` map between the two,
so checkpoints written with either spec convert alike.

Shapes (h hidden, n query heads, g key/value groups, d head size, f MLP size; Megatron rows first):
  linear_qkv.weight [g·(n/g + 2)·d, h]   per group: its n/g query heads, then its key head, then its value head —
                                         `fuse_qkv` / `split_qkv` interleave HF's q_proj [n·d, h], k_proj and v_proj
                                         [g·d, h] (a key/value head j serves query heads j·n/g … (j+1)·n/g − 1, as
                                         HF's repeat_kv); biases alike without the h axis
  linear_fc1.weight [2f, h]              SwiGLU: gate_proj rows, then up_proj rows (`cat` / `chunk`) — also each
                                         expert's and the shared expert's (Mixtral's w1 = gate, w3 = up, w2 = down)
  everything else                        copied as is (no transpose: both store Linear weights [out, in])

Mixtures of experts (`Architecture.moe`): a layer's MLP is `mlp.router.weight` [E, h] (HF `mlp.gate` /
Mixtral's `block_sparse_moe.gate`), the experts `mlp.experts.local_experts.<e>.linear_fc{1,2}` and, for Qwen2-MoE,
`mlp.shared_experts.linear_fc{1,2}` with `mlp.shared_experts.gate_weight` [1, h] (HF `mlp.shared_expert_gate`).
Canonical names number the experts globally (0 … E−1); a live model numbers its own `local_experts` from 0, so under
expert parallelism (`ep_layout`, `split_ep`, `ep_global_name`) rank r of R holds experts r·E/R … (r+1)·E/R − 1 under
local indices — a rename, never a slice. Qwen3's per-head norms are `self_attention.{q,k}_layernorm.weight` [d]
(HF `self_attn.{q,k}_norm`).

Tensor parallelism (`TP_RULES`): column-parallel weights (embedding, output layer, linear_qkv, linear_fc1 and their
biases) are split along dim 0, row-parallel weights (linear_proj, linear_fc2) along dim 1, everything else is
replicated. Two exceptions make a plain split wrong: the SwiGLU linear_fc1 holds [gate; up], and each rank holds
[its gate rows; its up rows] (`gated=True` splits each half); linear_qkv is split contiguously, which hands each rank
whole query groups because g is divisible by the TP size (checked by `check_tp`).

Every conversion is a pure reshuffle of the same numbers (no arithmetic), so HF → Megatron → HF is bit-exact.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from trainingrun.modeling.architecture import Architecture, check_parallel, spec_field


class ConversionError(ValueError):
    """The weights do not match the architecture (missing, unexpected or misshapen tensors); names them."""


# ------------------------------------------------------------------------------------------------ shape transforms
def _groups(arch: Architecture) -> tuple[int, int, int]:
    return arch.num_attention_heads, arch.num_query_groups, arch.head_dim


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: Architecture) -> torch.Tensor:
    n, g, d = _groups(arch)
    rest = q.shape[1:]
    q = q.reshape(g, (n // g) * d, *rest)
    k = k.reshape(g, d, *rest)
    v = v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(g * (n // g + 2) * d, *rest).contiguous()


def split_qkv(qkv: torch.Tensor, arch: Architecture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, g, d = _groups(arch)
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (n // g + 2) * d, *rest)
    q, k, v = torch.split(grouped, [(n // g) * d, d, d], dim=1)
    return (q.reshape(n * d, *rest).contiguous(), k.reshape(g * d, *rest).contiguous(),
            v.reshape(g * d, *rest).contiguous())


def _cat(*parts: torch.Tensor, arch: Architecture) -> torch.Tensor:  # noqa: ARG001 - same signature as fuse_qkv
    return torch.cat(parts, dim=0).contiguous()


def _chunk2(t: torch.Tensor, arch: Architecture) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ARG001
    a, b = torch.chunk(t, 2, dim=0)
    return a.contiguous(), b.contiguous()


def _same(t: torch.Tensor, arch: Architecture) -> torch.Tensor:  # noqa: ARG001
    return t


def _same1(t: torch.Tensor, arch: Architecture) -> tuple[torch.Tensor]:  # noqa: ARG001
    return (t,)


# --------------------------------------------------------------------------------------------------- the name table
@dataclass(frozen=True)
class Reshuffle:
    """How the HF tensors of a rule become its Megatron tensor (`combine(*hf, arch=)`, import) and back
    (`split(megatron, arch=)` → the HF tensors in order, export): the one pair of inverse functions of the rule."""

    combine: Callable[..., torch.Tensor]
    split: Callable[..., tuple[torch.Tensor, ...]]


COPY = Reshuffle(_same, _same1)  # one tensor, as it is
QKV = Reshuffle(fuse_qkv, split_qkv)  # q, k, v interleaved per query group
GATE_UP = Reshuffle(_cat, _chunk2)  # SwiGLU: gate rows, then up rows


# `when`: which architectures (and which of their layers) have the tensor — "always", "untied" (separate output
# layer), "bias" (addBiasLinear), "qkv_bias" (addBiasLinear or addQkvBias), "qk_norm" (Qwen3), "mlp" / "mlp_bias"
# (a dense MLP layer), "moe" (a mixture-of-experts layer; one tensor per expert where the name has {e}), "shared"
# (a mixture-of-experts layer with a shared expert). HF names of a mixture of experts name its block {moe} and the
# expert projections {gate} {up} {down} (`_EXPERT_NAMES`: Qwen's mlp.gate_proj/up_proj/down_proj, Mixtral's
# block_sparse_moe.w1/w3/w2).
@dataclass(frozen=True)
class NameRule:
    """One Megatron tensor and the HF tensors it is made of, both ways: import is `combine(*hf tensors)`, export is
    `split(megatron tensor)` → the HF tensors `hf`, in order."""

    megatron: str
    hf: tuple[str, ...]
    how: Reshuffle = COPY
    when: str = "always"

    @property
    def combine(self) -> Callable[..., torch.Tensor]:
        return self.how.combine

    @property
    def split(self) -> Callable[..., tuple[torch.Tensor, ...]]:
        return self.how.split


L, HL = "decoder.layers.{i}.", "model.layers.{i}."
EXPERT, HEXPERT = L + "mlp.experts.local_experts.{e}.", HL + "{moe}.experts.{e}."
SHARED, HSHARED = L + "mlp.shared_experts.", HL + "mlp.shared_expert."

# Megatron ↔ HF names, once: import (`import_plan`) and export (`export_plan`) both read this table.
NAME_RULES: tuple[NameRule, ...] = (
    NameRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
    NameRule(L + "input_layernorm.weight", (HL + "input_layernorm.weight",)),
    NameRule(L + "self_attention.linear_qkv.weight",
             (HL + "self_attn.q_proj.weight", HL + "self_attn.k_proj.weight", HL + "self_attn.v_proj.weight"), QKV),
    NameRule(L + "self_attention.linear_qkv.bias",
             (HL + "self_attn.q_proj.bias", HL + "self_attn.k_proj.bias", HL + "self_attn.v_proj.bias"), QKV,
             "qkv_bias"),
    NameRule(L + "self_attention.linear_proj.weight", (HL + "self_attn.o_proj.weight",)),
    NameRule(L + "self_attention.linear_proj.bias", (HL + "self_attn.o_proj.bias",), COPY, "bias"),
    NameRule(L + "pre_mlp_layernorm.weight", (HL + "post_attention_layernorm.weight",)),
    NameRule(L + "mlp.linear_fc1.weight", (HL + "mlp.gate_proj.weight", HL + "mlp.up_proj.weight"), GATE_UP, "mlp"),
    NameRule(L + "mlp.linear_fc1.bias", (HL + "mlp.gate_proj.bias", HL + "mlp.up_proj.bias"), GATE_UP, "mlp_bias"),
    NameRule(L + "mlp.linear_fc2.weight", (HL + "mlp.down_proj.weight",), COPY, "mlp"),
    NameRule(L + "mlp.linear_fc2.bias", (HL + "mlp.down_proj.bias",), COPY, "mlp_bias"),
    NameRule(L + "self_attention.q_layernorm.weight", (HL + "self_attn.q_norm.weight",), COPY, "qk_norm"),
    NameRule(L + "self_attention.k_layernorm.weight", (HL + "self_attn.k_norm.weight",), COPY, "qk_norm"),
    NameRule(L + "mlp.router.weight", (HL + "{moe}.gate.weight",), COPY, "moe"),
    NameRule(EXPERT + "linear_fc1.weight", (HEXPERT + "{gate}.weight", HEXPERT + "{up}.weight"), GATE_UP, "moe"),
    NameRule(EXPERT + "linear_fc2.weight", (HEXPERT + "{down}.weight",), COPY, "moe"),
    NameRule(SHARED + "linear_fc1.weight", (HSHARED + "gate_proj.weight", HSHARED + "up_proj.weight"), GATE_UP,
             "shared"),
    NameRule(SHARED + "linear_fc2.weight", (HSHARED + "down_proj.weight",), COPY, "shared"),
    NameRule(SHARED + "gate_weight", (HL + "mlp.shared_expert_gate.weight",), COPY, "shared"),
    NameRule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    NameRule("output_layer.weight", ("lm_head.weight",), COPY, "untied"),
)

# The HF names of a mixture-of-experts block: Mixtral's (a mixture without a query/key norm or shared expert, as
# `hf_config.export_model_type` decides) or the Qwen-MoE models'.
_EXPERT_NAMES = {
    "mixtral": {"moe": "block_sparse_moe", "gate": "w1", "up": "w3", "down": "w2"},
    "qwen": {"moe": "mlp", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
}

# HF keys that carry no weights of ours and may be present in a checkpoint: skipped on import.
IGNORED_HF = (re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"), re.compile(r"^model\.rotary_emb\."))


def _expert_names(arch: Architecture) -> dict[str, str]:
    mixtral = arch.moe is not None and not arch.qk_norm and arch.moe.shared_expert_ffn_size is None
    return _EXPERT_NAMES["mixtral" if mixtral else "qwen"]


def _applies(when: str, arch: Architecture, layer: int | None = None) -> bool:
    moe_layer = layer is not None and arch.moe is not None and arch.moe.is_moe_layer(layer)
    if when == "always":
        return True
    if when == "untied":
        return not arch.tie_embeddings
    if when == "bias":
        return arch.add_bias_linear
    if when == "qkv_bias":
        return arch.qkv_bias
    if when == "qk_norm":
        return arch.qk_norm
    if when == "mlp":
        return not moe_layer
    if when == "mlp_bias":
        return not moe_layer and arch.add_bias_linear
    if when == "moe":
        return moe_layer
    if when == "shared":
        return moe_layer and arch.moe.shared_expert_ffn_size is not None
    raise AssertionError(when)


def _expand(megatron: str, hf: tuple[str, ...], when: str, arch: Architecture):
    """(Megatron name, HF names) of one rule for every layer (and expert) of `arch` it applies to."""
    names = _expert_names(arch)
    layers = range(arch.num_layers) if "{i}" in megatron else (None,)
    for i in layers:
        if not _applies(when, arch, i):
            continue
        experts = range(arch.moe.num_experts) if "{e}" in megatron else (None,)
        for e in experts:
            yield megatron.format(i=i, e=e), tuple(h.format(i=i, e=e, **names) for h in hf)


def import_plan(arch: Architecture) -> list[tuple[str, tuple[str, ...], Callable[..., torch.Tensor]]]:
    """(Megatron name, HF source names, combine) for every Megatron tensor of `arch`."""
    return [(m, h, rule.combine) for rule in NAME_RULES for m, h in _expand(rule.megatron, rule.hf, rule.when, arch)]


def export_plan(arch: Architecture) -> list[tuple[str, tuple[str, ...], Callable[..., tuple[torch.Tensor, ...]]]]:
    """(Megatron name, HF target names, split) for every Megatron tensor of `arch`."""
    return [(m, h, rule.split) for rule in NAME_RULES for m, h in _expand(rule.megatron, rule.hf, rule.when, arch)]


def present_names(arch: Architecture) -> set[str]:
    """The canonical tensors a model of `arch` has: those of the HF name table (`import_plan`: biases, q/k norms,
    the output layer, experts only where the architecture has them) and a LayerNorm model's norm biases (which no
    HF family of the table carries). `expected_shapes` covers every tensor an architecture may have."""
    return {m for m, _, _ in import_plan(arch)} | {n for n in expected_shapes(arch) if n.endswith("layernorm.bias")}


def expected_shapes(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """Full (TP 1, every expert) Megatron shape of every canonical tensor of `arch`."""
    n, g, d = _groups(arch)
    h, f, v = arch.hidden_size, arch.ffn_hidden_size, arch.vocab_size
    fc1 = 2 * f if arch.gated else f
    qkv = (n + 2 * g) * d
    shapes = {
        "embedding.word_embeddings.weight": (v, h), "decoder.final_layernorm.weight": (h,),
        "output_layer.weight": (v, h),
    }
    moe = arch.moe
    for i in range(arch.num_layers):
        p = f"decoder.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "self_attention.linear_qkv.weight": (qkv, h),
            p + "self_attention.linear_qkv.bias": (qkv,), p + "self_attention.linear_proj.weight": (h, n * d),
            p + "self_attention.linear_proj.bias": (h,), p + "pre_mlp_layernorm.weight": (h,),
            p + "self_attention.q_layernorm.weight": (d,), p + "self_attention.k_layernorm.weight": (d,),
        })
        if moe is not None and moe.is_moe_layer(i):
            fm = moe.ffn_hidden_size
            shapes[p + "mlp.router.weight"] = (moe.num_experts, h)
            for e in range(moe.num_experts):
                shapes[p + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * fm, h)
                shapes[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, fm)
            if moe.shared_expert_ffn_size is not None:
                fs = moe.shared_expert_ffn_size
                shapes.update({p + "mlp.shared_experts.linear_fc1.weight": (2 * fs, h),
                               p + "mlp.shared_experts.linear_fc2.weight": (h, fs),
                               p + "mlp.shared_experts.gate_weight": (1, h)})
        else:
            shapes.update({
                p + "mlp.linear_fc1.weight": (fc1, h), p + "mlp.linear_fc1.bias": (fc1,),
                p + "mlp.linear_fc2.weight": (h, f), p + "mlp.linear_fc2.bias": (h,),
            })
        if arch.normalization == "LayerNorm":
            shapes[p + "input_layernorm.bias"] = (h,)
            shapes[p + "pre_mlp_layernorm.bias"] = (h,)
    if arch.normalization == "LayerNorm":
        shapes["decoder.final_layernorm.bias"] = (h,)
    return shapes


def check_hf_names(hf_names: Iterable[str], arch: Architecture) -> None:
    """ConversionError naming the HF tensors `arch` needs but are absent, and those present that it has no use for."""
    present = set(hf_names)
    wanted = {h for _, hs, _ in import_plan(arch) for h in hs}
    missing = sorted(wanted - present)
    unexpected = sorted(n for n in present - wanted if not any(p.search(n) for p in IGNORED_HF)
                        and not (n == "lm_head.weight" and arch.tie_embeddings))
    if missing or unexpected:
        raise ConversionError(f"Hugging Face weights do not match the architecture: missing {missing[:8]}"
                              f"{' …' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                              f"{' …' if len(unexpected) > 8 else ''}")


def iter_hf_to_megatron(get_hf: Callable[[str], torch.Tensor], hf_names: Iterable[str], arch: Architecture,
                        only: Callable[[str], bool] | None = None):
    """(Megatron name, full tensor) for every canonical tensor of `arch` (those `only` accepts, if given), built one
    at a time from HF tensors; `get_hf(name)` loads one HF tensor (lazily: a safetensors file is read a tensor at a
    time)."""
    check_hf_names(hf_names, arch)
    shapes = expected_shapes(arch)
    for name, sources, combine in import_plan(arch):
        if only is not None and not only(name):
            continue
        tensor = combine(*(get_hf(s) for s in sources), arch=arch)
        if tuple(tensor.shape) != shapes[name]:
            raise ConversionError(f"{name} (from {', '.join(sources)}): shape {tuple(tensor.shape)}, the "
                                  f"architecture needs {shapes[name]}")
        yield name, tensor


def hf_to_megatron(hf_state: dict[str, torch.Tensor], arch: Architecture) -> dict[str, torch.Tensor]:
    """Full (TP 1) canonical Megatron state dict from an HF state dict."""
    return dict(iter_hf_to_megatron(hf_state.__getitem__, hf_state.keys(), arch))


def megatron_to_hf(state: dict[str, torch.Tensor], arch: Architecture, *, whole: bool = True
                   ) -> dict[str, torch.Tensor]:
    """HF state dict from a full (TP-gathered) canonical Megatron state dict; `whole=False`: from a part of one (a
    bucket of the streamed sync: each tensor converts on its own), missing tensors allowed, unknown ones refused."""
    state = canonical_names(state)
    plan = export_plan(arch)
    wanted = {m for m, _, _ in plan}
    missing = sorted(wanted - set(state)) if whole else []
    unexpected = sorted(set(state) - wanted)
    if missing or unexpected:
        raise ConversionError(f"Megatron weights do not match the architecture: missing {missing[:8]}, unexpected "
                              f"{unexpected[:8]}")
    shapes = expected_shapes(arch)
    out = {}
    for name, targets, split in plan:
        if name not in state:
            continue
        tensor = state[name]
        if tuple(tensor.shape) != shapes[name]:
            raise ConversionError(f"{name}: shape {tuple(tensor.shape)}, the architecture needs {shapes[name]}")
        for target, part in zip(targets, split(tensor, arch=arch), strict=True):
            out[target] = part
    return out


def iter_megatron_to_hf(buckets: Iterable[dict[str, torch.Tensor]], arch: Architecture, *, complete: bool = True
                        ) -> Iterator[dict[str, torch.Tensor]]:
    """Each bucket of a full canonical Megatron state (the streamed gather's, `modeling.stream`) as HF tensors, in
    turn; ConversionError when they held a tensor twice and (`complete`) once the buckets end, when they missed a
    tensor of `arch` (not `complete`: one owner's part of a sharded stream; the receiver checks the whole)."""
    seen: set[str] = set()
    for bucket in buckets:
        names = set(canonical_names(bucket))
        if twice := sorted(names & seen):
            raise ConversionError(f"Megatron weights: tensors sent twice {twice[:8]}")
        seen |= names
        yield megatron_to_hf(bucket, arch, whole=False)
    if complete and (missing := sorted({m for m, _, _ in export_plan(arch)} - seen)):
        raise ConversionError(f"Megatron weights do not match the architecture: missing {missing[:8]}")


# -------------------------------------------------------------------------------------------- TE ↔ canonical names
_TE_TO_CANON = (
    (re.compile(r"\.self_attention\.linear_qkv\.layer_norm_(weight|bias)$"), r".input_layernorm.\1"),
    (re.compile(r"\.mlp\.linear_fc1\.layer_norm_(weight|bias)$"), r".pre_mlp_layernorm.\1"),
)


def canonical_name(key: str) -> str:
    """The local-spec name of a parameter of either spec (TE's fused norm names renamed)."""
    for pattern, repl in _TE_TO_CANON:
        key = pattern.sub(repl, key)
    return key


def canonical_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Local-spec names for a state dict of either spec; `_extra_state` entries (TE's FP8 metadata) dropped."""
    return {canonical_name(key): value for key, value in state.items() if not key.endswith("_extra_state")}


def model_names(state: dict[str, torch.Tensor], model_keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """Rename a canonical state dict to the names a model actually uses (TE spec: fused norm names)."""
    keys = set(model_keys)
    out = {}
    for key, value in state.items():
        if key not in keys:
            m = re.match(r"^(.*)\.(input_layernorm|pre_mlp_layernorm)\.(weight|bias)$", key)
            if m:
                fused = "self_attention.linear_qkv" if m.group(2) == "input_layernorm" else "mlp.linear_fc1"
                te_key = f"{m.group(1)}.{fused}.layer_norm_{m.group(3)}"
                if te_key in keys:
                    key = te_key
        out[key] = value
    return out


# ----------------------------------------------------------------------------------------------- tensor parallelism
TP_RULES: tuple[tuple[re.Pattern[str], int], ...] = (
    (re.compile(r"^embedding\.word_embeddings\.weight$"), 0),
    (re.compile(r"^output_layer\.weight$"), 0),
    (re.compile(r"\.self_attention\.linear_qkv\.(weight|bias)$"), 0),
    (re.compile(r"\.self_attention\.linear_proj\.weight$"), 1),
    (re.compile(r"\.mlp\.linear_fc1\.(weight|bias)$"), 0),
    (re.compile(r"\.mlp\.linear_fc2\.weight$"), 1),
)


def tp_layout(name: str, arch: Architecture) -> tuple[int | None, bool]:
    """(partition dim or None when replicated, gated) of a canonical Megatron tensor."""
    for pattern, dim in TP_RULES:
        if pattern.search(name):
            return dim, (".mlp.linear_fc1." in name and arch.gated)
    return None, False


def check_tp(arch: Architecture, tp: int, ep: int = 1) -> None:
    """ValueError naming the size that tensor-parallel size `tp` does not divide, or the parallelism the architecture
    cannot run with (`architecture.check_parallel`: expert parallelism)."""
    check_parallel(arch, tp, ep)
    if tp == 1:
        return
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size"):
        if getattr(arch, name) % tp:
            raise ValueError(f"{spec_field(name)}: {getattr(arch, name)} is not divisible by "
                             f"trainer.tensorParallelSize {tp}; allowed: a tensorParallelSize that divides it")


def split_tp(name: str, full: torch.Tensor, arch: Architecture, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s shard of a full canonical tensor."""
    dim, gated = tp_layout(name, arch)
    if dim is None or size == 1:
        return full
    if gated:
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, size, dim=0)[rank], torch.chunk(up, size, dim=0)[rank]], dim=0).contiguous()
    if full.shape[dim] % size:
        raise ValueError(f"{name}: dim {dim} of size {full.shape[dim]} does not split over {size} ranks")
    return torch.chunk(full, size, dim=dim)[rank].contiguous()


def gather_tp(name: str, shards: list[torch.Tensor], arch: Architecture) -> torch.Tensor:
    """The full canonical tensor from its TP shards (rank order); replicated tensors must agree exactly."""
    dim, gated = tp_layout(name, arch)
    if len(shards) == 1:
        return shards[0]
    if dim is None:
        for r, s in enumerate(shards[1:], start=1):
            if not torch.equal(s, shards[0]):
                raise ConversionError(f"{name}: replicated tensor differs between TP rank 0 and {r}")
        return shards[0]
    if gated:
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)], 0)
    return torch.cat(shards, dim=dim)


# ----------------------------------------------------------------------------------------------- expert parallelism
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def ep_layout(name: str) -> int | None:
    """The expert index in an expert tensor's name (`….mlp.experts.local_experts.<e>.…`), None for other tensors."""
    m = _EXPERT.match(name)
    return int(m.group(2)) if m else None


def _renumber(name: str, index: int) -> str:
    m = _EXPERT.match(name)
    return f"{m.group(1)}{index}{m.group(3)}"


def split_ep(state: dict[str, torch.Tensor], arch: Architecture, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Expert-parallel rank `rank` of `size`'s part of a canonical state (global expert numbers): its experts,
    renumbered from 0 as the live model numbers them, and every other tensor."""
    if size == 1:
        return state
    per = arch.moe.num_experts // size
    out = {}
    for name, t in state.items():
        e = ep_layout(name)
        if e is None:
            out[name] = t
        elif rank * per <= e < (rank + 1) * per:
            out[_renumber(name, e - rank * per)] = t
    return out


def ep_global_name(name: str, arch: Architecture, rank: int, size: int) -> str:
    """The canonical (global expert number) name of a live model's tensor on expert-parallel rank `rank`."""
    e = ep_layout(name)
    if e is None or size == 1:
        return name
    return _renumber(name, rank * (arch.moe.num_experts // size) + e)
