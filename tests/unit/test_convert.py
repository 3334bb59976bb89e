"""HF ↔ Megatron conversion tables, tensor-parallel split/gather and config.json mapping (no Megatron needed)."""

from __future__ import annotations

import re

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainingrun.api.spec.model import ModelSpec
from trainingrun.modeling import convert
from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.hf_config import HFConfigError, hf_architecture, hf_config_for


def arch_of(**kw) -> Architecture:
    base = dict(architecture="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=48, vocab_size=40, seq_length=64)
    base.update(kw)
    return ModelSpec(**base).resolved()


def random_hf_state(arch: Architecture, seed: int = 0) -> dict[str, torch.Tensor]:
    """An HF state dict with the shapes transformers gives `arch` (random values)."""
    g = torch.Generator().manual_seed(seed)
    h, n, kv, d, f, v = (getattr(arch, k) for k in ("hidden_size", "num_attention_heads", "num_query_groups",
                                                    "head_dim", "ffn_hidden_size", "vocab_size"))
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not arch.tie_embeddings:
        out["lm_head.weight"] = (v, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (n * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                    p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, n * d),
                    p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f)})
        if arch.add_bias_linear or arch.add_qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (n * d,), p + "self_attn.k_proj.bias": (kv * d,),
                        p + "self_attn.v_proj.bias": (kv * d,)})
        if arch.add_bias_linear:
            out.update({p + "self_attn.o_proj.bias": (h,), p + "mlp.gate_proj.bias": (f,),
                        p + "mlp.up_proj.bias": (f,), p + "mlp.down_proj.bias": (h,)})
    return {k: torch.randn(s, generator=g) for k, s in out.items()}


VARIANTS = {
    "gqa": {},
    "mha-tied": dict(num_query_groups=4, tie_embeddings=True),
    "mqa-qkv-bias": dict(num_query_groups=1, add_qkv_bias=True),
    "all-bias-headdim": dict(add_bias_linear=True, head_dim=12),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_hf_megatron_hf_round_trip_is_bit_exact(name):
    arch = arch_of(**VARIANTS[name])
    hf = random_hf_state(arch)
    meg = convert.hf_to_megatron(hf, arch)
    assert set(meg) == {k for k in convert.expected_shapes(arch) if k in meg}
    back = convert.megatron_to_hf(meg, arch)
    assert set(back) == set(hf)
    for k in hf:
        assert back[k].dtype == hf[k].dtype and torch.equal(back[k], hf[k]), k


def test_qkv_layout_is_per_group_queries_then_key_then_value():
    # 4 query heads, 2 groups, head size 1, hidden 1: rows are labelled by their source
    arch = arch_of(num_query_groups=2, hidden_size=8, num_attention_heads=4, head_dim=1)
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = convert.fuse_qkv(q, k, v, arch)
    # group 0 serves query heads 0, 1 (HF repeat_kv); group 1 serves 2, 3
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    assert [t.flatten().tolist() for t in convert.split_qkv(fused, arch)] == [[10, 11, 12, 13], [20, 21], [30, 31]]


def test_swiglu_fc1_is_gate_then_up_and_tp_shards_hold_their_halves():
    arch = arch_of()  # only the activation (swiglu) matters here
    gate = torch.arange(4.0)[:, None]
    up = 100 + torch.arange(4.0)[:, None]
    fc1 = convert.NAME_RULES[7].combine(gate, up, arch=arch)
    assert fc1.flatten().tolist() == [0, 1, 2, 3, 100, 101, 102, 103]
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    shards = [convert.split_tp(name, fc1, arch, r, 2) for r in range(2)]
    assert shards[0].flatten().tolist() == [0, 1, 100, 101]  # [its gate rows; its up rows]
    assert shards[1].flatten().tolist() == [2, 3, 102, 103]
    assert torch.equal(convert.gather_tp(name, shards, arch), fc1)


@settings(max_examples=25, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), tied=st.booleans(), bias=st.booleans(), seed=st.integers(0, 10**6))
def test_tp_split_then_gather_is_identity(tp, tied, bias, seed):
    arch = arch_of(num_attention_heads=8, num_query_groups=4, hidden_size=32, ffn_hidden_size=24, vocab_size=48,
                   tie_embeddings=tied, add_bias_linear=bias)
    meg = convert.hf_to_megatron(random_hf_state(arch, seed), arch)
    for name, full in meg.items():
        shards = [convert.split_tp(name, full, arch, r, tp) for r in range(tp)]
        dim, _ = convert.tp_layout(name, arch)
        if dim is not None and tp > 1:
            assert shards[0].shape[dim] * tp == full.shape[dim], name
        assert torch.equal(convert.gather_tp(name, shards, arch), full), name


def test_tp_layout_names_column_and_row_parallel_weights():
    arch = arch_of()
    assert convert.tp_layout("decoder.layers.3.self_attention.linear_qkv.weight", arch) == (0, False)
    assert convert.tp_layout("decoder.layers.3.self_attention.linear_proj.weight", arch) == (1, False)
    assert convert.tp_layout("decoder.layers.3.self_attention.linear_proj.bias", arch) == (None, False)
    assert convert.tp_layout("decoder.layers.3.mlp.linear_fc1.weight", arch) == (0, True)
    assert convert.tp_layout("decoder.layers.3.mlp.linear_fc1.weight", arch_of(architecture="gpt")) == (0, False)
    assert convert.tp_layout("decoder.layers.3.mlp.linear_fc2.weight", arch) == (1, False)
    assert convert.tp_layout("embedding.word_embeddings.weight", arch) == (0, False)
    assert convert.tp_layout("decoder.final_layernorm.weight", arch) == (None, False)


def test_gather_refuses_replicated_tensors_that_differ():
    arch = arch_of()
    with pytest.raises(convert.ConversionError, match="differs between TP rank 0 and 1"):
        convert.gather_tp("decoder.final_layernorm.weight", [torch.zeros(3), torch.ones(3)], arch)


def test_check_tp_names_the_indivisible_size():
    with pytest.raises(ValueError, match="numQueryGroups: 2 is not divisible by trainer.tensorParallelSize 4"):
        convert.check_tp(arch_of(num_attention_heads=4, num_query_groups=2), 4)
    with pytest.raises(ValueError, match="vocabSize: 41"):
        convert.check_tp(arch_of(vocab_size=41), 2)
    convert.check_tp(arch_of(), 2)


def test_conversion_names_missing_unexpected_and_misshapen_tensors():
    arch = arch_of()
    hf = random_hf_state(arch)
    broken = dict(hf)
    del broken["model.layers.1.mlp.up_proj.weight"]
    broken["model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
    with pytest.raises(convert.ConversionError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\], "
                                                     r"unexpected \['model.layers.9.mlp.up_proj.weight'\]"):
        convert.hf_to_megatron(broken, arch)
    wrong = dict(hf, **{"model.layers.0.mlp.down_proj.weight": torch.zeros(5, 5)})
    with pytest.raises(convert.ConversionError, match=r"decoder.layers.0.mlp.linear_fc2.weight .*shape \(5, 5\)"):
        convert.hf_to_megatron(wrong, arch)
    # a tied model ignores a stored lm_head (some checkpoints keep one); rotary buffers are ignored
    tied = arch_of(tie_embeddings=True)
    state = random_hf_state(tied)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    assert "output_layer.weight" not in convert.hf_to_megatron(state, tied)


def test_te_names_map_to_canonical_and_back():
    te = {"decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": torch.ones(2),
          "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": torch.zeros(2),
          "decoder.layers.0.mlp.linear_fc1._extra_state": None,
          "decoder.layers.0.mlp.linear_fc1.weight": torch.ones(4, 2)}
    canon = convert.canonical_names(te)
    assert set(canon) == {"decoder.layers.0.input_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
                          "decoder.layers.0.mlp.linear_fc1.weight"}
    back = convert.model_names(canon, te.keys())
    assert set(back) == set(te) - {"decoder.layers.0.mlp.linear_fc1._extra_state"}


# ------------------------------------------------------------------------------------------------- config.json
LLAMA_V4 = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
            "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True, "vocab_size": 49152,
            "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}


def test_llama_config_v4_and_v5_forms_read_alike():
    v4 = hf_architecture(LLAMA_V4)
    v5_cfg = {k: v for k, v in LLAMA_V4.items() if k != "rope_theta"}
    v5_cfg["rope_parameters"] = {"rope_theta": 100000.0, "rope_type": "default"}
    assert hf_architecture(v5_cfg) == v4
    assert (v4.num_query_groups, v4.head_dim, v4.tie_embeddings, v4.rope_base) == (3, 64, True, 1e5)


def test_llama3_rope_scaling_and_qwen2_bias():
    cfg = dict(LLAMA_V4, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    assert hf_architecture(cfg).rope_scaling_factor == 32.0
    qwen = hf_architecture(dict(LLAMA_V4, model_type="qwen2"))
    assert (qwen.add_qkv_bias, qwen.add_bias_linear) == (True, False)


@pytest.mark.parametrize("change,field", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 2.0}}, "rope_scaling.high_freq_factor"),
    ({"num_key_value_heads": 4}, "num_key_value_heads"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
])
def test_unsupported_configs_are_refused_naming_the_key(change, field):
    with pytest.raises(HFConfigError, match=rf"config.json: {field}:"):
        hf_architecture(dict(LLAMA_V4, **change))


@pytest.mark.parametrize("name", VARIANTS)
def test_written_config_reads_back_as_the_same_architecture(name):
    arch = arch_of(**VARIANTS[name])
    back = hf_architecture(json.loads(json.dumps(hf_config_for(arch))))
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim", "ffn_hidden_size",
                "vocab_size", "norm_epsilon", "rope_base", "tie_embeddings", "add_bias_linear", "add_qkv_bias",
                "rope_scaling_factor"):
        assert getattr(back, key) == getattr(arch, key), key


def test_gpt_architecture_does_not_export():
    with pytest.raises(HFConfigError, match="no Hugging Face counterpart"):
        hf_config_for(ModelSpec(preset="tiny").resolved())


def test_export_keeps_the_base_configs_token_ids():
    arch = hf_architecture(LLAMA_V4)
    arch = arch.replace(seq_length=2048)
    cfg = hf_config_for(arch, base=dict(LLAMA_V4, quantization_config={"x": 1}))
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert "quantization_config" not in cfg
    assert cfg["max_position_embeddings"] == 8192  # not shrunk by a shorter training seqLength


# ------------------------------------------------------------------------------------------------- model spec
def test_presets_and_architecture_defaults():
    tiny = ModelSpec(preset="tiny").resolved()
    assert (tiny.family, tiny.normalization, tiny.activation, tiny.ffn_hidden_size) == \
        ("gpt", "LayerNorm", "gelu", 256)
    assert tiny.num_query_groups == tiny.num_attention_heads
    llama = ModelSpec(preset="llama-1b").resolved()
    assert (llama.normalization, llama.activation, llama.num_query_groups, llama.tie_embeddings,
            llama.rope_base) == ("RMSNorm", "swiglu", 8, True, 500000.0)
    explicit = ModelSpec(architecture="llama", num_layers=2, hidden_size=96, num_attention_heads=4, vocab_size=50,
                         seq_length=32).resolved()
    assert explicit.ffn_hidden_size == 256  # 8/3 · 96 = 256, a multiple of 64
    assert ModelSpec(preset="tiny-llama", tie_embeddings=True).resolved().tie_embeddings is True


def test_hf_spec_reads_config_and_bounds_seq_length(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_V4))
    arch = ModelSpec(hf=str(tmp_path), seq_length=1024, precision="bf16").resolved()
    assert (arch.seq_length, arch.hidden_size, arch.precision, arch.hf) == (1024, 576, "bf16",
                                                                                         str(tmp_path))
    with pytest.raises(ValueError, match="seqLength: 9000 exceeds the model's max_position_embeddings 8192"):
        ModelSpec(hf=str(tmp_path), seq_length=9000).resolved()
    with pytest.raises(ValueError, match="cannot read"):
        ModelSpec(hf=str(tmp_path / "absent")).resolved()
    # where the directory is not mounted (the operator), the spec is checked without reading it
    assert ModelSpec(hf=str(tmp_path / "absent")).resolved(read_hf=False) is None


def test_hf_excludes_architecture_fields():
    with pytest.raises(ValueError, match="remove preset, hiddenSize"):
        ModelSpec(hf="/m", preset="tiny", hidden_size=64)


def test_streamed_conversion_gives_the_whole_conversion_and_names_a_missing_or_repeated_tensor():
    """`iter_megatron_to_hf` (the streamed sync, issue 28): buckets of a Megatron state convert one at a time to
    exactly the whole state's HF tensors; a tensor no bucket held, or two buckets held, is named."""
    arch = arch_of()
    meg = convert.hf_to_megatron(random_hf_state(arch), arch)
    names = sorted(meg)
    buckets = [{n: meg[n] for n in names[i:i + 3]} for i in range(0, len(names), 3)]
    out: dict = {}
    for hf in convert.iter_megatron_to_hf(iter(buckets), arch):
        assert not set(hf) & set(out)
        out.update(hf)
    whole = convert.megatron_to_hf(meg, arch)
    assert sorted(out) == sorted(whole) and all(torch.equal(out[k], whole[k]) for k in whole)
    with pytest.raises(convert.ConversionError, match=r"missing \['%s'\]" % re.escape(names[-1])):
        list(convert.iter_megatron_to_hf(iter([*buckets[:-1], {n: meg[n] for n in names[-3:-1]}]), arch))
    with pytest.raises(convert.ConversionError, match=r"sent twice \['%s'\]" % re.escape(names[0])):
        list(convert.iter_megatron_to_hf(iter([*buckets, {names[0]: meg[names[0]]}]), arch))


def test_shards_written_one_by_one_make_a_loadable_directory_or_none(tmp_path):
    """`hf_io.write_hf_shards` (the disk sync's streamed writer): each shard is a file of its own, the index names
    them, and the tensors read back equal; a stream that fails part-way leaves neither the directory nor its
    temporary sibling (nothing half-written)."""
    from trainingrun.modeling.hf_io import HFWeights, write_hf_shards

    arch = arch_of()
    hf = random_hf_state(arch)
    names = sorted(hf)
    shards = [{n: hf[n] for n in names[i:i + 4]} for i in range(0, len(names), 4)]
    out = write_hf_shards(tmp_path / "v1", iter(shards), arch, dtype=torch.bfloat16)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(shards) == len(list(out.glob("*.safetensors")))
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in hf.values())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with HFWeights(out) as w:
        assert sorted(w.names()) == names
        assert all(torch.equal(w.get(n), hf[n].to(torch.bfloat16)) for n in names)

    def failing():
        yield shards[0]
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_hf_shards(tmp_path / "v2", failing(), arch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]

