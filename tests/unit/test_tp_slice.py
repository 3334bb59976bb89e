"""The slicing table of the broadcast sync to tensor-parallel engines (`engines.vllm.tp_slice`) against a brute-force
reference of what vLLM's weight loaders take on each TP rank (written here from vLLM 0.32's loaders, independently of
the table): for every rank, the worker's rebuilt scratch tensor (its slice at its place, zeros elsewhere,
`worker_ext.expand_slices`) must give vLLM's loader exactly what the whole tensor gives it."""

from __future__ import annotations

import pytest
import torch

from trainingrun.engines.vllm.tp_slice import EngineTP, rule, rules, slice_bucket, unit_sizes
from trainingrun.engines.vllm.worker_ext import expand_slices, split_slices


def vllm_takes(name: str, full: torch.Tensor, rank: int, t: int, *, kv_heads: int, pad: int = 64,
               ep: bool = False) -> torch.Tensor:
    """What vLLM's loader of rank `rank` of t keeps of HF tensor `name` (brute force, from vLLM's loaders)."""
    kind = name.split(".")[-2]
    expert = ".experts." in name
    if name.endswith(".weight") and kind in ("embed_tokens", "lm_head"):
        v = full.shape[0]
        padded = (v + pad - 1) // pad * pad  # pad_vocab_size
        per = padded // t  # vocab_range_from_global_vocab_size
        start, end = min(rank * per, v), min((rank + 1) * per, v)  # _get_indices: padding removed
        return full[start:end]
    if expert and ep:
        return full  # the rank's own experts are loaded whole
    if kind in ("q_proj", "gate_proj", "up_proj") or (expert and kind in ("w1", "w3")):
        n = full.shape[0] // t
        return full[rank * n:(rank + 1) * n]
    if kind in ("k_proj", "v_proj"):
        if kv_heads >= t:
            n = full.shape[0] // t
            return full[rank * n:(rank + 1) * n]
        head = full.shape[0] // kv_heads  # replicated: rank r holds KV head r // (t / kv_heads)
        h = rank // (t // kv_heads)
        return full[h * head:(h + 1) * head]
    if kind in ("o_proj", "down_proj") or (expert and kind == "w2"):
        n = full.shape[1] // t
        return full[:, rank * n:(rank + 1) * n]
    return full  # replicated: norms, routers, biases here


def model_tensors(vocab: int, hidden: int = 16, heads: int = 4, kv: int = 2, inter: int = 24,
                  experts: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    d = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    p = "model.layers.0."
    shapes.update({p + "self_attn.q_proj.weight": (heads * d, hidden), p + "self_attn.k_proj.weight": (kv * d, hidden),
                   p + "self_attn.v_proj.weight": (kv * d, hidden), p + "self_attn.o_proj.weight": (hidden, heads * d),
                   p + "self_attn.q_proj.bias": (heads * d,), p + "self_attn.q_norm.weight": (d,),
                   p + "input_layernorm.weight": (hidden,)})
    if experts:
        shapes[p + "mlp.gate.weight"] = (experts, hidden)
        for e in range(experts):
            shapes.update({f"{p}mlp.experts.{e}.gate_proj.weight": (inter, hidden),
                           f"{p}mlp.experts.{e}.up_proj.weight": (inter, hidden),
                           f"{p}mlp.experts.{e}.down_proj.weight": (hidden, inter),
                           f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight": (inter, hidden),
                           f"model.layers.1.block_sparse_moe.experts.{e}.w3.weight": (inter, hidden),
                           f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight": (hidden, inter)})
    else:
        shapes.update({p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter)})
    return [(n, torch.randn(s, generator=g)) for n, s in shapes.items()]


CASES = [  # (t, vocab, kv heads, experts, expert parallel)
    (2, 512, 2, 0, False), (2, 100, 2, 0, False), (4, 65, 4, 0, False), (4, 1000, 2, 0, False),
    (2, 96, 1, 0, False), (2, 130, 2, 3, False), (2, 130, 2, 3, True), (3, 192, 3, 0, False)]


@pytest.mark.parametrize("t,vocab,kv,experts,ep", CASES)
def test_each_ranks_slice_gives_vllms_loader_what_the_whole_tensor_gives_it(t, vocab, kv, experts, ep):
    heads = 2 * kv if kv > 2 else 4
    named = model_tensors(vocab, kv=kv, heads=heads, hidden=4 * heads, inter=12 * t, experts=experts)
    tp = EngineTP(size=t, kv_heads=kv, vocab_pad=64, expert_parallel=ep)
    tensors = [[n, "float32", list(x.shape), 0] for n, x in named]
    slices = rules(tensors, tp)
    flat = torch.cat([x.reshape(-1) for _, x in named])
    parts = slice_bucket(flat, tensors, slices, t)
    assert [p.numel() for p in parts] == unit_sizes(tensors, slices, 1, t)[0]
    manifest = {"tensors": tensors, "slices": slices, "tp": tp.to_json()}
    sliced_kinds = set()
    for rank in range(t):
        buffers = [parts[r] if r == rank else None for r in range(t)]
        got = split_slices(manifest, buffers, rank)
        loadable = list(expand_slices({**manifest, "slice_rank": rank}, got))
        assert [n for n, _ in loadable] == [n for n, _ in named]
        for (name, full), (_, scratch), r in zip(named, loadable, slices):
            assert scratch.shape == full.shape, name
            want = vllm_takes(name, full, rank, t, kv_heads=kv, ep=ep)
            assert torch.equal(vllm_takes(name, scratch, rank, t, kv_heads=kv, ep=ep), want), (name, rank, r)
            if r is not None:
                sliced_kinds.add(name.split(".")[-2])
    whole = flat.numel()
    # an engine receives about one copy: the slices of all ranks add up to the model plus (t - 1) × what goes whole
    replicated = sum(x.numel() for (n, x), r in zip(named, slices) if r is None)
    assert sum(p.numel() for p in parts) == whole + (t - 1) * replicated
    assert {"q_proj", "o_proj"} <= sliced_kinds
    assert ("embed_tokens" in sliced_kinds) == ((vocab + 63) // 64 * 64 % t == 0)
    assert ("k_proj" in sliced_kinds) == (kv % t == 0)


def test_the_table_sends_whole_what_it_does_not_know_or_cannot_cut():
    tp = EngineTP(size=2, kv_heads=2, vocab_pad=64)
    assert rule("model.layers.0.self_attn.q_proj.weight", [8, 8], tp) == (0, [0, 4, 8])
    assert rule("model.layers.0.mlp.down_proj.weight", [8, 6], tp) == (1, [0, 3, 6])
    assert rule("model.layers.0.self_attn.q_proj.weight", [9, 8], tp) is None  # not divisible
    assert rule("model.layers.0.self_attn.q_proj.bias", [8], tp) is None  # biases whole
    assert rule("model.layers.0.mlp.gate.weight", [4, 8], tp) is None  # the router: replicated
    assert rule("model.layers.0.some_new_proj.weight", [8, 8], tp) is None  # unknown
    assert rule("model.layers.0.mlp.w1.weight", [8, 8], tp) is None  # w1 outside experts: unknown
    assert rule("model.layers.0.self_attn.k_proj.weight", [8, 8], EngineTP(size=2)) is None  # KV heads not said
    assert rule("model.embed_tokens.weight", [100, 8], EngineTP(size=2, kv_heads=2)) is None  # padding not said
    assert rule("model.layers.0.self_attn.q_proj.weight", [8, 8], EngineTP(size=1)) is None
    assert EngineTP.from_json(None) == EngineTP()
    assert EngineTP.from_json(tp.to_json() | {"rank": 1}) == tp  # a worker's rank is not part of the layout
