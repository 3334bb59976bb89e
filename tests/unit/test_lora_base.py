"""The base a LoRA checkpoint names (`modeling.lora_base`): the digest of a seeded base or of an HF directory's weight
files, the refusal of another base naming the field and both digests, and the base rebuilt from the record."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainingrun.modeling.architecture import resolve
from trainingrun.modeling.lora_base import base_problem, base_reference, base_state, hf_digest


def _arch():
    return resolve(preset="tiny-llama", vocab_size=32, seq_length=32)


def test_seeded_digest_names_the_seed_and_changes_with_it() -> None:
    a, again, other = base_reference(_arch(), 7), base_reference(_arch(), 7), base_reference(_arch(), 8)
    assert a == again and a["source"] == "seed" and a["seed"] == 7 and a["digest"].startswith("sha256:")
    assert other["digest"] != a["digest"]
    assert base_problem(a, again, "ckpt/step_00000002") is None
    assert base_problem(None, a, "ckpt/step_00000002") is None  # a checkpoint from before bases were recorded
    why = base_problem(a, other, "ckpt/step_00000002")
    assert why is not None and why.startswith("spec.seed / spec.model:")
    assert a["digest"] in why and other["digest"] in why and "ckpt/step_00000002" in why


def test_seeded_base_state_is_the_seeded_initialisation_and_refuses_a_changed_digest() -> None:
    from trainingrun.modeling.initialise import full_tensor

    arch = _arch()
    ref = base_reference(arch, 3)
    state = base_state(ref, arch, "ckpt")
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    assert torch.equal(state[name], full_tensor(name, arch, seed=3))
    with pytest.raises(ValueError, match="changed since"):
        base_state({**ref, "digest": "sha256:0"}, arch, "ckpt")


def test_hf_digest_covers_the_weight_files(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    (tmp_path / "config.json").write_text("{}")
    first = hf_digest(tmp_path)
    (tmp_path / "config.json").write_text('{"x": 1}')  # not a weight file
    assert hf_digest(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"abd")
    changed = hf_digest(tmp_path)
    assert changed != first
    was = {"source": "model.hf", "hf": str(tmp_path), "digest": first}
    why = base_problem(was, {**was, "digest": changed}, "ckpt")
    assert why is not None and why.startswith("spec.model.hf:") and first in why and changed in why
    with pytest.raises(FileNotFoundError, match="model.hf"):
        hf_digest(tmp_path / "nowhere")
