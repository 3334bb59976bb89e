"""`trainingrun export-hf` of a checkpoint whose architecture has no Hugging Face counterpart (the `tiny` preset: a
LayerNorm + GeLU GPT) says why, before any conversion, and writes nothing (before: the conversion's "Megatron weights
do not match the architecture: unexpected [...layernorm.bias]" after the checkpoint was read)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainingrun.modeling.architecture import resolve
from trainingrun.modeling.hf_config import HFConfigError
from trainingrun.trainer import export_hf as export_module
from trainingrun.trainer.full_state import FullState


def test_an_architecture_without_an_hf_counterpart_is_refused_naming_why(tmp_path: Path, monkeypatch) -> None:
    arch = resolve(preset="tiny")
    full = FullState(state={}, arch=arch, assets_dir=None, path=tmp_path / "step_00000002", progress={})
    monkeypatch.setattr(export_module, "load_full_state", lambda checkpoint: full)
    out = tmp_path / "hf"
    with pytest.raises(HFConfigError, match=r"no Hugging Face counterpart.*nothing was written"):
        export_module.export_hf(tmp_path, out)
    assert not out.exists()
