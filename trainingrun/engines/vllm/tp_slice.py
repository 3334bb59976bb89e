"""Which part of each Hugging Face tensor a tensor-parallel vLLM worker needs (the `broadcast` sync to an engine of
TP t > 1, issue 28 item 6): the trainers send worker r of every engine only its slice r, so an engine receives about
one copy of the model in all instead of t.

The table (`rule`), by the tensor's HF name (the buckets carry HF names, `modeling.convert.iter_megatron_to_hf`):
  column-parallel  q_proj, k_proj, v_proj, gate_proj, up_proj weights (also each expert's and the shared expert's;
                   Mixtral's experts' w1, w3): dim 0 cut in t equal parts — vLLM's Column/QKV/MergedColumn loaders
                   and FusedMoE's w13 narrow the same rows. k_proj / v_proj only when the engine's KV heads divide
                   by t (fewer KV heads than t: vLLM replicates them, the tensor goes whole).
  row-parallel     o_proj, down_proj weights (experts' down_proj, Mixtral's w2): dim 1 cut in t equal parts.
  vocabulary       embed_tokens, lm_head weights: VocabParallelEmbedding's partition — the vocabulary V padded to a
                   multiple of the engine's padding P (vLLM's DEFAULT_VOCAB_PADDING_SIZE, 64, as reported by the
                   worker), cut in t equal parts of p = pad(V)/t rows; rank r takes rows
                   [min(r·p, V), min((r+1)·p, V)) (`VocabParallelEmbedding._get_indices`, its org_vocab range).
  whole            everything else: norms, biases, routers, any name the table does not know, a dimension not
                   divisible by t, experts when the engine runs expert parallel, every tensor when the engine did not
                   say its layout. A tensor sent whole is always correct (vLLM's loader narrows it as before); the
                   table only saves bytes.
A rule is `(dim, bounds)`: slice r is `tensor.narrow(dim, bounds[r], bounds[r+1] - bounds[r])`. The worker
(`worker_ext.expand_slices`) puts its slice into a zero tensor of the full shape, one tensor at a time, and hands that
to vLLM's own loader, which narrows out exactly that slice: merged QKV / gate-up layouts and vocabulary padding stay
vLLM's business.

`EngineTP` is what worker 0 of the engine reports in its request (`worker_ext.engine_tp`): the TP size, KV heads,
vocabulary padding and expert parallelism. `slice_bucket` cuts one flat bucket into its t slices (sender side).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from trainingrun.engines.vllm.worker_ext import numel, slice_shape

COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
ROW = frozenset({"o_proj", "down_proj"})
EXPERT_COLUMN = frozenset({"w1", "w3"})  # Mixtral's block_sparse_moe.experts.N.w1 / w3 (gate / up)
EXPERT_ROW = frozenset({"w2"})
VOCAB = frozenset({"embed_tokens", "lm_head"})
KV = frozenset({"k_proj", "v_proj"})


@dataclass(frozen=True)
class EngineTP:
    """An engine's tensor-parallel layout as its worker 0 reports it (a None field: not known, those tensors go
    whole)."""

    size: int = 1
    kv_heads: int | None = None
    vocab_pad: int | None = None
    expert_parallel: bool = False

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> EngineTP:
        if not d:
            return cls()
        size = int(d.get("size") or 1)
        if size < 1:
            raise ValueError(f"engine tp: size {size} is not a positive integer")
        kv, pad = d.get("kv_heads"), d.get("vocab_pad")
        return cls(size=size, kv_heads=None if kv is None else int(kv), vocab_pad=None if pad is None else int(pad),
                   expert_parallel=bool(d.get("expert_parallel", False)))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


Rule = tuple[int, list[int]]


def _even(n: int, t: int) -> list[int] | None:
    return [r * n // t for r in range(t + 1)] if n % t == 0 else None


def rule(name: str, shape: list[int] | tuple[int, ...], tp: EngineTP) -> Rule | None:
    """How worker r of an engine of layout `tp` gets HF tensor `name` of `shape`: (dim, bounds) or None (whole)."""
    t = tp.size
    if t <= 1 or len(shape) != 2 or not name.endswith(".weight"):
        return None
    parts = name.split(".")
    kind = parts[-2]
    expert = "experts" in parts
    if expert and tp.expert_parallel:  # each rank holds whole experts: vLLM skips the others
        return None
    if kind in VOCAB and not expert:
        v, pad = int(shape[0]), tp.vocab_pad
        if not pad or pad < 1:
            return None
        padded = -(-v // pad) * pad
        if padded % t:
            return None
        per = padded // t
        return 0, [min(r * per, v) for r in range(t + 1)]
    if kind in COLUMN or (expert and kind in EXPERT_COLUMN):
        dim = 0
        if kind in KV and not expert and (tp.kv_heads is None or tp.kv_heads % t):
            return None  # fewer KV heads than ranks (or not said): vLLM replicates them
    elif kind in ROW or (expert and kind in EXPERT_ROW):
        dim = 1
    else:
        return None
    bounds = _even(int(shape[dim]), t)
    return None if bounds is None else (dim, bounds)


def rules(tensors: list, tp: EngineTP) -> list[list | None]:
    """The rule of each manifest tensor entry [name, dtype, shape, bucket] (JSON-ready: [dim, bounds] or None)."""
    out = []
    for name, _dtype, shape, _bucket in tensors:
        r = rule(name, shape, tp)
        out.append(None if r is None else [r[0], r[1]])
    return out


def unit_sizes(tensors: list, slices: list, buckets: int, t: int) -> list[list[int]]:
    """Elements of slice r of bucket b, [b][r] (the tensors in manifest order, each bucket's in its order)."""
    sizes = [[0] * t for _ in range(buckets)]
    for (_name, _dtype, shape, b), r in zip(tensors, slices):
        for rank in range(t):
            sizes[int(b)][rank] += numel(slice_shape(shape, r, rank))
    return sizes


def slice_bucket(flat, tensors: list, slices: list, t: int) -> list:
    """The t flat slices of one bucket (`flat`, its tensors' entries [name, dtype, shape, bucket] in order and their
    rules): slice r holds slice r of each tensor, in order (a tensor sent whole is in every slice). Copies."""
    import torch  # deferred: torch

    pieces: list[list] = [[] for _ in range(t)]
    offset = 0
    for (_name, _dtype, shape, _b), r in zip(tensors, slices):
        n = numel(shape)
        tensor = flat[offset:offset + n].view(torch.Size([int(d) for d in shape]))
        offset += n
        for rank in range(t):
            if r is None:
                pieces[rank].append(tensor.reshape(-1))
            else:
                dim, bounds = int(r[0]), r[1]
                part = tensor.narrow(dim, int(bounds[rank]), int(bounds[rank + 1]) - int(bounds[rank]))
                pieces[rank].append(part.reshape(-1))
    if offset != flat.numel():
        raise ValueError(f"bucket of {flat.numel()} elements, its tensors use {offset}")
    return [torch.cat(p) if p else flat[:0].clone() for p in pieces]


def unit_buffers(buckets: list, tensors: list, slices: list, t: int) -> Iterator:
    """The t slices of each bucket of `buckets` in order (None t times for a bucket held by another owner: None in
    `buckets`), each bucket cut when it is reached: a bucket's slices at a time, never a second copy of the model."""
    by_bucket: dict[int, list] = collections.defaultdict(list)
    for entry, r in zip(tensors, slices):
        by_bucket[int(entry[3])].append((entry, r))
    for b, flat in enumerate(buckets):
        if flat is None:
            yield from [None] * t
            continue
        held = by_bucket[b]
        yield from slice_bucket(flat, [e for e, _ in held], [r for _, r in held], t)
