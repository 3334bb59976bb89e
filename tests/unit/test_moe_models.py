"""Mixtures of experts and Qwen3 in the typed architecture and the spec: what config.json resolves to, and the
combinations that cannot run, refused by `trainingrun validate` (or at resolution) with the field named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from trainingrun.api.checks import validate_document
from trainingrun.api.spec.model import ModelSpec
from trainingrun.modeling.architecture import check_parallel
from trainingrun.modeling.hf_config import HFConfigError

QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 24,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
             "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "vocab_size": 64,
             "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False, "decoder_sparse_step": 2,
             "mlp_only_layers": [3], "router_aux_loss_coef": 0.001, "tie_word_embeddings": False}


def _hf(tmp_path: Path, cfg: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_a_qwen3_moe_config_resolves_to_its_experts_and_q_k_norms(tmp_path: Path):
    arch = ModelSpec(hf=_hf(tmp_path, QWEN3_MOE)).resolved()
    moe = arch.moe
    assert arch.hf_model_type == "qwen3_moe" and arch.qk_norm and not arch.add_qkv_bias
    assert (moe.num_experts, moe.top_k, moe.ffn_hidden_size, moe.norm_topk_prob) == (8, 2, 24, False)
    assert (moe.sparse_step, tuple(moe.dense_layers), moe.aux_loss_coeff) == (2, (3,), 0.001)
    assert arch.ffn_hidden_size == 48  # the dense layers' MLP
    assert type(arch).from_dict(arch.to_dict()) == arch


def test_mixtral_routes_over_its_local_experts(tmp_path: Path):
    cfg = {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "vocab_size": 64,
           "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}
    arch = ModelSpec(hf=_hf(tmp_path, cfg)).resolved()
    assert (arch.moe.num_experts, arch.moe.top_k, arch.moe.ffn_hidden_size, arch.moe.norm_topk_prob) == (4, 2, 48, True)
    assert not arch.qk_norm


@pytest.mark.parametrize("cfg,key", [
    ({**QWEN3_MOE, "model_type": "mixtral", "num_local_experts": 4, "sliding_window": 16}, "sliding_window"),
    ({**QWEN3_MOE, "num_experts_per_tok": 9}, "config.json: model.moe.topK: 9 exceeds numExperts 8"),
])
def test_what_a_model_cannot_run_is_refused_naming_the_key(tmp_path: Path, cfg: dict, key: str):
    with pytest.raises((HFConfigError, ValueError), match=key):
        ModelSpec(hf=_hf(tmp_path, cfg)).resolved()


def _doc(model: dict, **trainer) -> dict:
    return yaml.safe_load(f"""
apiVersion: trainingrun.dev/v1alpha1
kind: TrainingRun
metadata: {{name: moe}}
spec:
  model: {json.dumps(model)}
  trainer: {json.dumps({"replicas": 4, "maxTokensPerGPU": 256, **trainer})}
  rollout:
    source: {{type: synthetic, synthetic: {{task: reverse, minLength: 4, maxLength: 12, vocabSize: 16}}}}
    samplesPerRollout: 16
    groupSize: 4
    numRollouts: 2
""")


MOE_MODEL = {"architecture": "llama", "numLayers": 2, "hiddenSize": 32, "numAttentionHeads": 4, "vocabSize": 64,
             "seqLength": 64,
             "moe": {"numExperts": 6, "topK": 2, "ffnHiddenSize": 16}}


@pytest.mark.parametrize("model,trainer,field,message", [
    (MOE_MODEL, {"expertParallelSize": 4}, ("spec", "trainer", "expertParallelSize"), "does not divide the model's 6"),
    ({"preset": "tiny-llama"}, {"expertParallelSize": 2}, ("spec", "trainer", "expertParallelSize"),
     "needs a mixture-of-experts model"),
    (MOE_MODEL, {"tensorParallelSize": 2}, ("spec", "trainer", "tensorParallelSize"), "mixture-of-experts"),
    (MOE_MODEL, {"replicas": 3, "expertParallelSize": 2}, None, "expertParallelSize must divide the data-parallel"),
])
def test_validate_refuses_impossible_parallel_sizes_naming_the_field(model, trainer, field, message):
    problems = validate_document(_doc(model, **trainer))
    assert problems, "accepted"
    assert any(message in p.message for p in problems), problems
    if field is not None:
        assert any(tuple(p.parts) == field for p in problems), problems


def test_a_valid_expert_parallel_spec_passes():
    assert validate_document(_doc(MOE_MODEL, expertParallelSize=2)) == []
    check_parallel(ModelSpec.model_validate(MOE_MODEL).resolved(), 1, 3)
