"""modeling/pipeline.py: which layers each pipeline stage holds, and the names between a stage and the whole model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainingrun.api.spec.model import ModelSpec
from trainingrun.modeling import pipeline
from trainingrun.modeling.architecture import Architecture


def arch_of(**kw) -> Architecture:
    base = dict(architecture="llama", num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=48, vocab_size=40, seq_length=64)
    base.update(kw)
    return ModelSpec(**base).resolved()


def whole_names(arch: Architecture) -> list[str]:
    names = [pipeline.EMBEDDING, "decoder.final_layernorm.weight"]
    names += [f"decoder.layers.{i}.{part}" for i in range(arch.num_layers)
              for part in ("self_attention.linear_qkv.weight", "mlp.linear_fc2.weight")]
    if not arch.tie_embeddings:
        names.append(pipeline.OUTPUT_LAYER)
    return names


def test_check_pp_names_the_field_and_what_is_allowed():
    with pytest.raises(ValueError, match=r"model\.numLayers: 3 layers are not divisible by "
                                         r"trainer\.pipelineParallelSize 2; allowed: a pipelineParallelSize that "
                                         r"divides"):
        pipeline.check_pp(arch_of(num_layers=3), 2)
    pipeline.check_pp(arch_of(num_layers=3), 1)
    pipeline.check_pp(arch_of(num_layers=6), 3)


@given(layers_per_stage=st.integers(1, 4), pp=st.integers(1, 4), tied=st.booleans())
def test_stages_partition_the_whole_model_and_join_back(layers_per_stage, pp, tied):
    arch = arch_of(num_layers=layers_per_stage * pp, tie_embeddings=tied)
    whole = {name: name for name in whole_names(arch)}  # values carry their whole-model name
    ranges = [pipeline.stage_layers(arch, p, pp) for p in range(pp)]
    assert [i for r in ranges for i in r] == list(range(arch.num_layers))  # contiguous, in order, each layer once
    joined: dict[str, str] = {}
    for p in range(pp):
        stage = pipeline.to_stage(whole, arch, p, pp)
        layer_ids = {int(n.split(".")[2]) for n in stage if n.startswith("decoder.layers.")}
        assert layer_ids == set(range(layers_per_stage))  # every stage's model numbers its own layers from 0
        assert (pipeline.EMBEDDING in stage) == (p == 0)
        assert ("decoder.final_layernorm.weight" in stage) == (p == pp - 1)
        assert (pipeline.OUTPUT_LAYER in stage) == (p == pp - 1 and (not tied or pp > 1))
        if tied and pp > 1 and p == pp - 1:  # the last stage's copy of the tied embedding is the embedding
            assert stage[pipeline.OUTPUT_LAYER] == pipeline.EMBEDDING
        part = pipeline.to_whole(stage, arch, p, pp)
        assert not set(part) & set(joined)  # no tensor twice (the tied copy is dropped)
        joined.update(part)
    assert joined == whole
