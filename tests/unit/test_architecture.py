"""The typed architecture (`trainingrun.modeling.architecture.Architecture`): presets and explicit fields resolve to
what the tables say, a Hugging Face config resolves to what its keys say, the plain record round-trips, bad
combinations are refused naming the field, and none of it needs torch."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainingrun.api.spec.model import ModelSpec
from trainingrun.modeling.architecture import (
    FAMILY_DEFAULTS,
    MODEL_PRESETS,
    Architecture,
    PresetName,
    resolve,
)

ROOT = Path(__file__).resolve().parents[2]
# The keys of the plain record (checkpoints' meta.json, the rollout's fingerprint), as they were before the type.
RECORD_KEYS = {"architecture", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim",
               "kv_channels", "ffn_hidden_size", "vocab_size", "seq_length", "normalization", "norm_epsilon",
               "activation", "rope_base", "rope_scaling_factor", "tie_embeddings", "add_bias_linear", "add_qkv_bias",
               "precision", "transformer_impl", "hf"}


def expected_record(fields: dict, precision: str = "fp32", impl: str = "auto") -> dict:
    """What a spec's architecture fields resolve to, written out from the rules in docs/trainer.md: the family's
    defaults under the given fields, MLP 4·h (gpt) or 8/3·h up to a multiple of 64 (llama), groups = heads, head
    size = hidden / heads."""
    family = fields.get("architecture", "gpt")
    out = {**FAMILY_DEFAULTS[family], **fields, "architecture": family}
    h, n = out["hidden_size"], out["num_attention_heads"]
    out.setdefault("ffn_hidden_size", 4 * h if family == "gpt" else 64 * math.ceil((8 * h // 3) / 64))
    out.setdefault("num_query_groups", n)
    out.setdefault("head_dim", h // n)
    out.update(kv_channels=out["head_dim"], rope_scaling_factor=None, precision=precision, transformer_impl=impl,
               hf=None)
    return out


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
def test_every_preset_resolves_to_its_table_row(preset: str):
    arch = ModelSpec(preset=preset).resolved()
    assert isinstance(arch, Architecture)
    record = arch.to_dict()
    assert set(record) == RECORD_KEYS  # the record's keys are unchanged (fingerprints and checkpoints)
    assert record == expected_record(dict(MODEL_PRESETS[preset]))
    assert resolve(preset) == arch  # the API's resolution is modeling's


def test_explicit_fields_override_the_preset_and_the_family_sets_the_rest():
    arch = ModelSpec(preset="tiny", architecture="llama", hidden_size=96, num_query_groups=2,
                     precision="bf16").resolved()
    fields = {**MODEL_PRESETS["tiny"], "architecture": "llama", "hidden_size": 96, "num_query_groups": 2}
    assert arch.to_dict() == expected_record(fields, precision="bf16")
    assert (arch.normalization, arch.activation, arch.gated) == ("RMSNorm", "swiglu", True)


def test_the_api_enum_of_presets_is_the_table():
    assert set(get_args(PresetName)) == set(MODEL_PRESETS)
    schema = ModelSpec.model_json_schema(by_alias=True)["properties"]["preset"]
    enum = next(s["enum"] for s in schema["anyOf"] if "enum" in s)
    assert set(enum) == set(MODEL_PRESETS)


def test_an_hf_config_resolves_to_what_its_keys_say(tmp_path: Path):
    cfg = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
           "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
           "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "tie_word_embeddings": True, "vocab_size": 300}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = ModelSpec(hf=str(tmp_path), seq_length=128, precision="bf16", transformer_impl="local").resolved()
    assert arch == Architecture(
        family="llama", num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"], num_query_groups=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"], ffn_hidden_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        seq_length=128, normalization="RMSNorm", norm_epsilon=cfg["rms_norm_eps"], activation="swiglu",
        rope_base=cfg["rope_theta"], tie_embeddings=True, add_bias_linear=False, add_qkv_bias=True,  # qwen2: q/k/v
        precision="bf16", transformer_impl="local", hf=str(tmp_path), hf_model_type="qwen2")
    assert arch.to_dict()["hf_model_type"] == "qwen2" and set(arch.to_dict()) == RECORD_KEYS | {"hf_model_type"}
    assert ModelSpec(hf=str(tmp_path)).resolved().seq_length == cfg["max_position_embeddings"]


@pytest.mark.parametrize("fields,message", [
    ({"preset": "tiny", "num_attention_heads": 5}, "model.hiddenSize: 64 is not divisible by numAttentionHeads 5"),
    ({"preset": "tiny-llama", "num_query_groups": 3}, "model.numQueryGroups: 3 does not divide numAttentionHeads 4"),
    ({"preset": "tiny", "num_attention_heads": 6, "head_dim": 8, "num_query_groups": 4}, "model.numQueryGroups: 4"),
])
def test_bad_combinations_are_refused_naming_the_field(fields: dict, message: str):
    with pytest.raises(ValueError, match=message):
        resolve(**fields)


def test_a_spec_valid_field_by_field_is_refused_at_resolution():
    spec = ModelSpec(preset="tiny", num_attention_heads=5)  # the schema's rules see no hiddenSize to check
    with pytest.raises(ValueError, match="model.hiddenSize: 64 is not divisible by numAttentionHeads 5"):
        spec.resolved()
    with pytest.raises(ValueError, match="model.hiddenSize"):  # the operator's check, without reading model.hf
        spec.resolved(read_hf=False)


@pytest.mark.parametrize("change,field", [
    (dict(normalization="BatchNorm"), "model.normalization: 'BatchNorm' is not supported; allowed: LayerNorm, RMSNorm"),
    (dict(family="bert"), "model.architecture: 'bert' is not supported"),
    (dict(precision="fp8"), "model.precision: 'fp8' is not supported"),
    (dict(transformer_impl="te"), "model.transformerImpl: 'te' is not supported"),
    (dict(num_layers=0), "model.numLayers: must be a positive integer"),
    (dict(vocab_size=True), "model.vocabSize: must be a positive integer"),
    (dict(norm_epsilon=0.0), "model.normEpsilon: must be a positive number"),
    (dict(rope_scaling_factor=float("inf")), "model.ropeScalingFactor: must be a positive number"),
    (dict(tie_embeddings=1), "model.tieEmbeddings: must be true or false"),
])
def test_invalid_values_are_refused_on_construction(change: dict, field: str):
    base = resolve("tiny")
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(base, **change)
    with pytest.raises(ValueError, match=field):
        base.replace(**change)


def test_resolve_refuses_what_it_cannot_resolve():
    with pytest.raises(ValueError, match=r"model: set model.hf, model.preset, .*missing model.vocabSize, "
                                         r"model.seqLength"):
        resolve(num_layers=2, hidden_size=64, num_attention_heads=4)
    with pytest.raises(ValueError, match="model.preset: 'huge' is not a preset; allowed: tiny"):
        resolve("huge")
    with pytest.raises(ValueError, match="model: dropout is not an architecture field"):
        resolve("tiny", dropout=0.1)


def test_the_value_is_frozen_and_resolved_values_compare_equal():
    arch = resolve("tiny-llama")
    with pytest.raises(dataclasses.FrozenInstanceError):
        arch.num_layers = 3  # type: ignore[misc]
    assert resolve("tiny-llama") == arch and hash(resolve("tiny-llama")) == hash(arch)
    assert arch.replace(num_layers=3).num_layers == 3 and arch.num_layers == 2


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
def test_the_record_round_trips(preset: str):
    arch = resolve(preset, precision="bf16")
    assert Architecture.from_dict(json.loads(json.dumps(arch.to_dict()))) == arch


def test_a_bad_record_is_refused_naming_the_key():
    record = resolve("tiny").to_dict()
    with pytest.raises(ValueError, match="unknown architecture field.*num_experts"):
        Architecture.from_dict({**record, "num_experts": 8})
    with pytest.raises(ValueError, match="architecture field.*vocab_size missing"):
        Architecture.from_dict({k: v for k, v in record.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="kv_channels 8 differs from head_dim 16"):
        Architecture.from_dict({**record, "kv_channels": 8})
    with pytest.raises(ValueError, match="model: must be an object"):
        Architecture.from_dict([1, 2])  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(family=st.sampled_from(["gpt", "llama"]), heads=st.integers(1, 16), per_head=st.integers(1, 32),
       groups_div=st.integers(1, 16), layers=st.integers(1, 48), vocab=st.integers(2, 10**6),
       seq=st.integers(8, 10**6), tie=st.booleans(), precision=st.sampled_from(["fp32", "bf16", "fp16"]))
def test_explicit_sizes_resolve_by_the_rules_and_round_trip(family, heads, per_head, groups_div, layers, vocab, seq,
                                                            tie, precision):
    groups = math.gcd(heads, groups_div)  # a divisor of heads
    fields = dict(architecture=family, num_layers=layers, hidden_size=heads * per_head, num_attention_heads=heads,
                  num_query_groups=groups, vocab_size=vocab, seq_length=seq, tie_embeddings=tie)
    arch = resolve(precision=precision, **fields)
    assert arch.to_dict() == expected_record(fields, precision=precision)
    assert arch.head_dim * arch.num_attention_heads == arch.hidden_size
    assert Architecture.from_dict(arch.to_dict()) == arch


def test_the_architecture_and_the_api_import_without_torch():
    code = ("import sys; from trainingrun.api.spec.model import ModelSpec; "
            "from trainingrun.modeling import architecture, hf_config; "
            "a = ModelSpec(preset='tiny-llama').resolved(); print(a.family, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.stdout.split() == ["llama", "False"], proc.stderr
