"""modeling/initialise.py: a seeded model is the same whatever the tensor-, pipeline- and expert-parallel layout.

Each layout's ranks are stand-ins holding exactly the parameters a Megatron rank holds (names and shard shapes from
the conversion and pipeline rules); initialised, joined back to the whole model (pipeline.to_whole, the experts'
global numbers, convert.gather_tp) they must equal the one-rank model bit for bit. The trainer's real models are
checked by whole runs in tests/integration/test_layout_init.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from trainingrun.api.spec.model import ModelSpec
from trainingrun.modeling import initialise as init
from trainingrun.modeling import pipeline
from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.convert import ep_global_name, expected_shapes, gather_tp, split_ep, split_tp

SEED = 1234


def arch_of(**kw) -> Architecture:
    base = dict(architecture="llama", num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=48, vocab_size=40, seq_length=64)
    base.update(kw)
    return ModelSpec(**base).resolved()


ARCHS = {
    "llama-tied": arch_of(tie_embeddings=True),  # gated fc1 ([gate; up] per TP rank), grouped-query attention
    "gpt-bias": arch_of(architecture="gpt", num_query_groups=None, add_bias_linear=True),  # LayerNorm, biases
    "moe": arch_of(qk_norm=True, moe=dict(num_experts=4, top_k=2, ffn_hidden_size=16, shared_expert_ffn_size=24,
                                          shared_expert_gate=True, dense_layers=[0])),
}


class Rank:
    """What `initialise` reads of a model: its named parameters (here this rank's, as Megatron names them)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.params = {name: torch.nn.Parameter(torch.full(shape, float("nan"))) for name, shape in shapes.items()}

    def named_parameters(self):
        return iter(self.params.items())


def whole_shapes(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """Every tensor the whole model holds (expected_shapes lists the optional ones too)."""
    shapes = expected_shapes(arch)
    keep = {name for name in shapes if not name.endswith(".bias") or arch.add_bias_linear}
    keep -= {name for name in shapes if "layernorm" in name and "self_attention" in name and not arch.qk_norm}
    if arch.tie_embeddings:
        keep.discard(pipeline.OUTPUT_LAYER)
    for i in range(arch.num_layers):
        if arch.moe is not None and arch.moe.is_moe_layer(i):
            keep -= {name for name in shapes if name.startswith(f"decoder.layers.{i}.mlp.linear_fc")}
    return {name: shapes[name] for name in keep}


def layout_model(arch: Architecture, tp: int, pp: int, ep: int) -> dict[str, torch.Tensor]:
    """Initialise every rank of the layout and join their parameters back into the whole model's."""
    whole = whole_shapes(arch)
    shards: dict[str, list[torch.Tensor | None]] = {}
    for p, e, t in itertools.product(range(pp), range(ep), range(tp)):
        stage = split_ep(pipeline.to_stage(whole, arch, p, pp), arch, e, ep)
        rank = Rank({name: tuple(split_tp(name, torch.empty(shape, device="meta"), arch, t, tp).shape)
                     for name, shape in stage.items()})
        init.initialise(rank, arch, seed=SEED, tp=(t, tp), pp=(p, pp), ep=(e, ep))
        if arch.tie_embeddings and pp > 1 and p == pp - 1:  # the last stage's copy of the embedding is drawn equal
            embedding = split_tp(pipeline.EMBEDDING, init.full_tensor(pipeline.EMBEDDING, arch, seed=SEED), arch, t,
                                 tp)
            assert torch.equal(rank.params[pipeline.OUTPUT_LAYER].data, embedding)
        joined = pipeline.to_whole({n: v.data for n, v in rank.params.items()}, arch, p, pp)
        for name, value in joined.items():
            shards.setdefault(ep_global_name(name, arch, e, ep), [None] * tp)[t] = value
    assert sorted(shards) == sorted(whole)
    return {name: gather_tp(name, parts, arch) for name, parts in shards.items()}


LAYOUTS = {"llama-tied": [(2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 4, 1), (2, 4, 1)],
           "gpt-bias": [(2, 1, 1), (1, 2, 1), (2, 2, 1)],
           "moe": [(1, 1, 2), (1, 2, 2), (1, 4, 4), (1, 2, 1)]}


@pytest.mark.parametrize(("arch", "tp", "pp", "ep"), [(a, *lay) for a, lays in LAYOUTS.items() for lay in lays])
def test_every_layout_is_the_one_rank_model(arch, tp, pp, ep):
    a = ARCHS[arch]
    ref = layout_model(a, 1, 1, 1)
    got = layout_model(a, tp, pp, ep)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    assert all(torch.equal(ref[n], init.full_tensor(n, a, seed=SEED)) for n in ref)  # the whole model's draws


def test_values_are_megatrons_and_depend_on_the_seed_and_name():
    a = ARCHS["gpt-bias"]
    model = layout_model(a, 1, 1, 1)
    assert torch.equal(model["decoder.layers.0.input_layernorm.weight"], torch.ones(a.hidden_size))
    assert torch.equal(model["decoder.layers.0.self_attention.linear_qkv.bias"], torch.zeros_like(
        model["decoder.layers.0.self_attention.linear_qkv.bias"]))
    emb = model[pipeline.EMBEDDING]
    assert abs(float(emb.std()) - 0.02) < 0.002 and abs(float(emb.mean())) < 0.002
    proj = torch.cat([model[f"decoder.layers.{i}.mlp.linear_fc2.weight"].flatten() for i in range(a.num_layers)])
    assert abs(float(proj.std()) - 0.02 / (2 * a.num_layers) ** 0.5) < 0.0005  # Megatron's output_layer_init_method
    # each tensor its own generator: no two layers alike; another seed, another model
    assert not torch.equal(model["decoder.layers.0.mlp.linear_fc1.weight"], model["decoder.layers.1.mlp.linear_fc1.weight"])
    assert not torch.equal(init.full_tensor(pipeline.EMBEDDING, a, seed=SEED + 1), emb)


def test_a_parameter_without_a_rule_or_of_another_shape_is_refused_before_anything_changes():
    a = ARCHS["llama-tied"]
    shapes = {name: shape for name, shape in whole_shapes(a).items()}
    rank = Rank({**shapes, "decoder.layers.0.self_attention.linear_qkv.adapter.weight": (2, 32)})
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.self_attention\.linear_qkv\.adapter\.weight: the "
                                         r"model's parameter is not a tensor of the architecture"):
        init.initialise(rank, a, seed=SEED)
    assert all(torch.isnan(p).all() for p in rank.params.values())  # nothing was set
    with pytest.raises(ValueError, match=r"linear_qkv\.adapter\.weight: no seeded initialisation rule"):
        init.init_kind("decoder.layers.0.self_attention.linear_qkv.adapter.weight")
    rank = Rank({**shapes, pipeline.EMBEDDING: (a.vocab_size // 2, a.hidden_size)})  # a TP 2 shard at TP 1
    with pytest.raises(ValueError, match=r"embedding\.word_embeddings\.weight: this rank's shard of "
                                         r"embedding\.word_embeddings\.weight has shape \(40, 32\), the model's "
                                         r"parameter \(20, 32\)"):
        init.initialise(rank, a, seed=SEED)
    assert all(torch.isnan(p).all() for p in rank.params.values())
