"""`spec.trainer.lora` (issue 29 item 1): the API's bounds and defaults, and the checks that need the resolved model
(`modeling.lora_targets.check_lora`, run by `trainingrun validate` and by the trainer at start-up), each naming the
field and what is allowed."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml

from trainingrun.api.spec.trainer import LoRASpec, LoRATarget, TrainerSpec
from trainingrun.api.validate import validate_text
from trainingrun.modeling.architecture import resolve
from trainingrun.modeling.lora_targets import DEFAULT_TARGETS, TARGETS, LoRASettings, check_lora, parts

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = {"preset": "tiny-llama"}  # hidden 64, 4 heads of 16, 2 query groups (k/v: 32), ffn 192
MOE = {"architecture": "llama", "numLayers": 2, "hiddenSize": 32, "numAttentionHeads": 4, "vocabSize": 64,
       "seqLength": 64, "moe": {"numExperts": 4, "topK": 2, "ffnHiddenSize": 16}}


def run_with(model: dict, lora: dict, tmp_path: Path) -> list[str]:
    doc = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    doc["spec"]["model"] = model
    doc["spec"]["trainer"]["lora"] = lora
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return validate_text(path.read_text(), str(path))


def test_defaults_and_the_target_names_agree_with_the_plan():
    spec = TrainerSpec.model_validate({"maxTokensPerGPU": 64, "lora": {"rank": 8}})
    assert spec.lora is not None and spec.lora.resolved_alpha == 16.0 and spec.lora.dropout == 0.0
    assert tuple(spec.lora.targets) == DEFAULT_TARGETS
    assert LoRASpec(rank=4, alpha=4).resolved_alpha == 4.0
    assert typing.get_args(LoRATarget) == TARGETS
    assert TrainerSpec.model_validate({"maxTokensPerGPU": 64}).lora is None


@pytest.mark.parametrize("lora,field", [
    ({"rank": 0}, "rank"), ({"rank": 1025}, "rank"), ({"rank": 8, "dropout": 1.0}, "dropout"),
    ({"rank": 8, "dropout": -0.1}, "dropout"), ({"rank": 8, "alpha": 0}, "alpha"),
    ({"rank": 8, "targets": ["attention"]}, "targets"), ({"rank": 8, "targets": []}, "targets"),
    ({"rank": 8, "targets": ["mlp_in", "mlp_in"]}, "targets"),
])
def test_the_api_refuses_bad_values_naming_the_field(lora, field, tmp_path):
    lines = run_with(TINY_LLAMA, lora, tmp_path)
    assert lines and all(f"spec.trainer.lora.{field}" in line for line in lines), lines


def test_validate_admits_a_fitting_lora(tmp_path):
    assert run_with(TINY_LLAMA, {"rank": 32, "alpha": 16, "dropout": 0.1}, tmp_path) == []


@pytest.mark.parametrize("lora,message", [
    # the k/v projections of tiny-llama are 64 -> 32: rank 33 is above them
    ({"rank": 33}, "rank: 33 is above the smaller dimension of attention_qkv's k projection (64 -> 32); "
                   "allowed: 1 to 32"),
    ({"rank": 65, "targets": ["mlp_out"]}, "rank: 65 is above the smaller dimension of mlp_out's down projection "
                                           "(192 -> 64); allowed: 1 to 64"),
    ({"rank": 4, "targets": ["experts"]}, "targets: experts needs a mixture-of-experts model"),
])
def test_validate_checks_lora_against_the_model(lora, message, tmp_path):
    (line,) = run_with(TINY_LLAMA, lora, tmp_path)
    assert f"spec.trainer.lora.{message}" in line, line


def test_experts_on_a_mixture_of_experts_are_admitted_and_their_rank_checked(tmp_path):
    """Before the experts had adapters, `experts` on a mixture of experts was refused ("not built yet")."""
    assert run_with(MOE, {"rank": 4, "targets": ["attention_qkv", "experts"]}, tmp_path) == []
    assert run_with(MOE, {"rank": 4, "targets": ["attention_qkv"]}, tmp_path) == []
    # each expert's down projection is 16 -> 32 (its fused gate/up 32 -> 32): rank 17 is above it
    (line,) = run_with(MOE, {"rank": 17, "targets": ["experts"]}, tmp_path)
    assert "spec.trainer.lora.rank: 17 is above the smaller dimension of experts's down projection (16 -> 32); " \
           "allowed: 1 to 16" in line, line


def test_check_lora_names_an_unknown_target_and_parts_follow_the_architecture():
    arch = resolve(preset="tiny-llama")
    with pytest.raises(ValueError, match=r"^trainer\.lora\.targets: unknown target 'mlp'"):
        check_lora(LoRASettings(rank=4, alpha=8, targets=("mlp",)), arch)
    assert parts("attention_qkv", arch) == (("q", 64, 64), ("k", 64, 32), ("v", 64, 32))
    assert parts("mlp_in", arch) == (("gate", 64, 192), ("up", 64, 192))
    assert parts("mlp_out", arch) == (("down", 192, 64),)
    check_lora(LoRASettings(rank=32, alpha=8), arch)


def test_an_adapter_export_of_a_state_without_adapters_is_refused():
    import torch

    from trainingrun.modeling.lora import peft_adapter

    arch = resolve(preset="tiny-llama")
    with pytest.raises(ValueError, match="holds no LoRA adapters .its run had no spec.trainer.lora."):
        peft_adapter({"embedding.word_embeddings.weight": torch.zeros(256, 64)}, arch)


def _adapter_dir(tmp_path: Path, *, r: int = 4, alpha: float = 8.0, modules=None, shapes=None) -> Path:
    import json
    import struct

    arch = resolve(preset="tiny-llama")
    modules = modules or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    sizes = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64), "gate_proj": (64, 192),
             "up_proj": (64, 192), "down_proj": (192, 64)}
    header = {}
    for layer in range(arch.num_layers):
        for m in modules:
            group = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            n_in, n_out = sizes[m]
            pre = f"base_model.model.model.layers.{layer}.{group}.{m}"
            header[f"{pre}.lora_A.weight"] = {"dtype": "F32", "shape": [r, n_in], "data_offsets": [0, 0]}
            header[f"{pre}.lora_B.weight"] = {"dtype": "F32", "shape": [n_out, r], "data_offsets": [0, 0]}
    header.update(shapes or {})
    d = tmp_path / "adapter"
    d.mkdir(exist_ok=True)
    blob = json.dumps(header).encode()
    (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": alpha,
                                                        "target_modules": modules}))
    return d


@pytest.mark.parametrize("change,message", [
    ({}, None),
    ({"r": 8}, "rank 8, trainer.lora.rank 4"),
    ({"alpha": 16.0}, "lora_alpha 16.0, trainer.lora.alpha 8"),
    ({"modules": ["q_proj", "v_proj"]}, "target_modules ['q_proj', 'v_proj']"),
    ({"shapes": {"base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight":
                 {"dtype": "F32", "shape": [16, 4], "data_offsets": [0, 0]}}}, "misshapen"),
])
def test_validate_checks_model_adapter_against_lora_and_the_model(change, message, tmp_path):
    adapter = _adapter_dir(tmp_path, **change)
    doc = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    doc["spec"]["model"] = {**TINY_LLAMA, "adapter": str(adapter)}
    doc["spec"]["trainer"]["lora"] = {"rank": 4, "alpha": 8}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    lines = validate_text(path.read_text(), str(path))
    if message is None:
        assert lines == []
    else:
        (line,) = lines
        assert f"spec.model.adapter: {adapter} does not match: " in line and message in line, line


def test_the_memory_plan_counts_a_frozen_base_and_trained_adapters():
    """`trainingrun plan` under trainer.lora: weights grow by the adapters, gradients and optimizer states hold the
    adapters only (here llama-8b at TP 2, rank 16, default targets, bf16: 4 x 32 layers of adapters)."""
    from trainingrun.modeling.memory import TrainerSettings, lora_parameters, memory_plan

    arch = resolve(preset="llama-8b", precision="bf16")
    full = TrainerSettings(gpus_per_replica=8, tensor_parallel=2, data_parallel=4)
    lora = TrainerSettings(gpus_per_replica=8, tensor_parallel=2, data_parallel=4, lora_rank=16,
                           lora_targets=DEFAULT_TARGETS)
    terms = {name: {t.key: t.bytes for t in memory_plan(arch, s).roles[0].terms} for name, s in
             (("full", full), ("lora", lora))}
    n, largest = lora_parameters(arch, 16, DEFAULT_TARGETS, tp=2)
    # per layer: q 16*(4096 + 4096/2), k, v 16*(4096 + 1024/2), o 16*(4096/2 + 4096), gate, up 16*(4096 + 14336/2),
    # down 16*(14336/2 + 4096)
    per_layer = 16 * ((4096 + 2048) + 2 * (4096 + 512) + (2048 + 4096) + 2 * (4096 + 7168) + (7168 + 4096))
    assert n == 32 * per_layer and largest == 7168 * 16  # gate/up B: 14336/2 rows
    assert terms["lora"]["weights"] == terms["full"]["weights"] + n * 2
    assert terms["lora"]["gradients"] == n * 4 and terms["lora"]["optimizer"] == n * 12
    assert terms["full"]["optimizer"] > 100 * terms["lora"]["optimizer"]  # 48.2 GB vs 0.34 GB per GPU


def test_a_relative_model_adapter_is_resolved_against_the_launch_directory(tmp_path):
    from trainingrun.api import parse_trainingrun
    from trainingrun.local.main import resolve_input_paths

    doc = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    doc["spec"]["model"] = {**TINY_LLAMA, "adapter": "adapters/sft"}
    doc["spec"]["trainer"]["lora"] = {"rank": 4}
    run = resolve_input_paths(parse_trainingrun(doc), tmp_path)
    assert run.spec.model.adapter == str((tmp_path / "adapters/sft").resolve())


def _moe_arch():
    from trainingrun.api.spec.model import ModelSpec

    return ModelSpec.model_validate(MOE).resolved()


def test_expert_adapters_stack_into_peft_layout_and_back():
    """`to_peft` stacks a layer's per-expert adapters as PEFT's ParamWrapper keeps them on transformers' fused
    expert tensors (its `get_delta_weight`: A viewed [E, r, in], B viewed [out, r, E]); `_from_peft_expert` takes
    each expert back; the config names the target parameters in PEFT's nesting order."""
    import torch

    from trainingrun.modeling.lora import _from_peft_expert, peft_adapter

    arch = _moe_arch()
    state, r = {}, 3
    for layer in range(2):
        for e in range(4):
            pre = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}."
            state[pre + "linear_fc1.adapter.gate_up_A"] = torch.randn(r, 32)
            state[pre + "linear_fc1.adapter.gate_up_B"] = torch.randn(32, r)
            state[pre + "linear_fc2.adapter.down_A"] = torch.randn(r, 16)
            state[pre + "linear_fc2.adapter.down_B"] = torch.randn(32, r)
            for fc in ("linear_fc1", "linear_fc2"):
                state[pre + f"{fc}.adapter.scale_"] = torch.tensor([2.0])
    tensors, config = peft_adapter(state, arch)
    assert config["target_modules"] == [] and config["r"] == r and config["lora_alpha"] == 6.0
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    gate_up_b = tensors["base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"]
    down_a = tensors["base_model.model.model.layers.1.mlp.experts.lora_A.weight"]
    assert tuple(gate_up_b.shape) == (32, r * 4) and tuple(down_a.shape) == (4 * r, 16)
    # PEFT's delta of expert e: B.reshape(out, r, E)[:, :, e] @ A.reshape(E, r, in)[e]
    a = tensors["base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"]
    for e in range(4):
        pre = f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.adapter.gate_up_"
        delta = gate_up_b.reshape(32, r, 4)[:, :, e] @ a.reshape(4, r, 32)[e]
        assert torch.allclose(delta, state[pre + "B"] @ state[pre + "A"])
        for ab in "AB":
            assert torch.equal(_from_peft_expert(tensors, 1, "linear_fc1", e, ab, 4), state[pre + ab])
    with pytest.raises(ValueError, match="adapters of experts"):
        peft_adapter({k: v for k, v in state.items() if ".local_experts.3." not in k}, arch)


def test_check_adapter_knows_the_experts_peft_tensors(tmp_path):
    import json
    import struct

    from trainingrun.modeling.lora_targets import check_adapter, peft_shapes

    arch = _moe_arch()
    lora = LoRASettings(rank=4, alpha=8.0, targets=("attention_qkv", "experts"))
    shapes = peft_shapes(lora, arch)
    assert shapes["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"] == (16, 32)
    assert shapes["base_model.model.model.layers.0.mlp.experts.lora_B.weight"] == (32, 16)
    assert not any("gate_proj" in k for k in peft_shapes(LoRASettings(rank=4, alpha=8.0), arch))  # no dense MLP

    def write(config: dict, names: dict) -> Path:
        header = {k: {"dtype": "F32", "shape": list(v), "data_offsets": [0, 0]} for k, v in names.items()}
        blob = json.dumps(header).encode()
        d = tmp_path / "adapter"
        d.mkdir(exist_ok=True)
        (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
        (d / "adapter_config.json").write_text(json.dumps(config))
        return d

    good = {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": ["k_proj", "q_proj", "v_proj"],
            "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    assert check_adapter(write(good, shapes), lora, arch) == shapes
    # default targets on a mixture of experts without dense layers: the attention's modules only (before, the check
    # wanted gate_proj/up_proj/down_proj too and refused the adapter export-hf --adapter wrote of such a run)
    attention = {k: v for k, v in peft_shapes(LoRASettings(rank=4, alpha=8.0), arch).items()}
    assert check_adapter(write({**good, "target_modules": ["k_proj", "o_proj", "q_proj", "v_proj"],
                                "target_parameters": None}, attention), LoRASettings(rank=4, alpha=8.0), arch)
    with pytest.raises(ValueError, match=r"model\.adapter: .* target_parameters None"):
        check_adapter(write({**good, "target_parameters": None}, shapes), lora, arch)
    with pytest.raises(ValueError, match="misshapen"):
        wrong = dict(shapes, **{"base_model.model.model.layers.1.mlp.experts.lora_A.weight": (8, 16)})
        check_adapter(write(good, wrong), lora, arch)


def test_the_memory_plan_counts_expert_adapters_per_local_expert():
    from trainingrun.modeling.memory import TrainerSettings, expert_lora_parameters, memory_plan

    arch = _moe_arch()  # 2 MoE layers, 4 experts, hidden 32, moe ffn 16
    per_expert = 4 * (32 + 2 * 16) + 4 * (16 + 32)
    assert expert_lora_parameters(arch, 4, ("experts",), ep=1) == (2 * 4 * per_expert, 2 * 16 * 4)
    assert expert_lora_parameters(arch, 4, ("experts",), ep=2)[0] == 2 * 2 * per_expert
    assert expert_lora_parameters(arch, 4, DEFAULT_TARGETS, ep=2) == (0, 0)
    plain = TrainerSettings(data_parallel=2, expert_parallel=2, lora_rank=4, lora_targets=("attention_qkv",))
    both = TrainerSettings(data_parallel=2, expert_parallel=2, lora_rank=4, lora_targets=("attention_qkv", "experts"))
    terms = {name: {t.key: t.bytes for t in memory_plan(arch, s).roles[0].terms} for name, s in
             (("plain", plain), ("both", both))}
    assert terms["both"]["gradients"] - terms["plain"]["gradients"] == 2 * 2 * per_expert * 4
    assert terms["both"]["weights"] - terms["plain"]["weights"] == 2 * 2 * per_expert * 4  # fp32
