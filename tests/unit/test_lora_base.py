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


def test_hf_digest_cache_skips_the_read_until_a_weight_file_changes(tmp_path: Path, monkeypatch) -> None:
    import os
    import time
    from types import SimpleNamespace

    from trainingrun.modeling import lora_base

    hf, cache = tmp_path / "hf", tmp_path / "ckpt" / lora_base.DIGEST_CACHE  # the cache outside model.hf
    hf.mkdir()
    weights = hf / "model.safetensors"
    weights.write_bytes(b"abc" * 1000)
    reads: list[str] = []

    def counting_open(path, mode="r", *args, **kwargs):
        reads.append(Path(path).name)
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(lora_base, "open", counting_open, raising=False)
    first = hf_digest(hf, cache=cache)
    assert reads == ["model.safetensors"] and cache.is_file()
    assert first == hf_digest(hf) and reads.pop() == "model.safetensors"  # the digest of the uncached read
    assert sorted(p.name for p in hf.iterdir()) == ["model.safetensors"]  # nothing written into model.hf
    assert hf_digest(hf, cache=cache) == first and reads == ["model.safetensors"]  # from the cache: not read again

    # the same size, other bytes, with the modification time set back to the cached one: the change time moved
    # (after the kernel's timestamp tick, a few ms: a rewrite within the tick of the hash would not be seen)
    time.sleep(0.05)
    st = weights.stat()
    weights.write_bytes(b"abd" * 1000)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    changed = hf_digest(hf, cache=cache)
    assert len(reads) == 2 and changed != first
    was = {"source": "model.hf", "hf": str(hf), "digest": first}
    now = base_reference(SimpleNamespace(hf=str(hf)), 0, cache=cache)  # the trainer's call (only arch.hf is read)
    why = base_problem(was, now, "ckpt")
    assert now["digest"] == changed and why is not None and first in why and changed in why
    n = len(reads)
    assert hf_digest(hf, cache=cache) == changed and len(reads) == n  # cached again

    time.sleep(0.05)
    weights.write_bytes(b"abd" * 1001)  # another size
    assert hf_digest(hf, cache=cache) not in (first, changed) and len(reads) == n + 1
    (hf / "model-2.safetensors").write_bytes(b"x")  # a file added: both read once, then cached
    added = hf_digest(hf, cache=cache)
    assert hf_digest(hf, cache=cache) == added and len(reads) == n + 3

    cache.write_text("{not json")  # a damaged cache: read again, rewritten
    assert hf_digest(hf, cache=cache) == added and len(reads) == n + 5 and '"format": 1' in cache.read_text()
