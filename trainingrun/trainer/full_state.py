"""A checkpoint directory → the full (tensor-parallel-gathered) Megatron state dict and its `Architecture`, in one
process and without Megatron or torch.distributed: what `trainingrun export-hf` and `trainingrun score` read (a live
model's weights are gathered by `trainingrun.modeling.state.gather_live_state`).

`load_full_state(path)` accepts a checkpoint (`…/step_00000010`) or a checkpoint root (its newest complete
checkpoint is taken). A LoRA run's checkpoint (`spec.trainer.lora`) holds its adapters only: the base is rebuilt
from the reference meta.json records (model.hf or the seed) and checked against its digest (`modeling.lora_base`);
the adapters are merged into it (`modeling.lora.merge_full_state`): export-hf and score see the merged model. A checkpoint in the current format (`dist/`, Megatron distributed checkpointing) is verified
(`checkpoint.verify`: sizes and SHA-256 of every file) and its model tensors are read at full shape with torch's
distributed-checkpoint reader in this process (`checkpoint.model_tensors`: dist_checkpointing stores every tensor
under its global, TP-1 layout, so there is nothing to gather), then mapped to the canonical local-spec names. An
older checkpoint (per-TP-rank `model_tp{t}_pp0.pt`, weights_only) has its shards mapped to the canonical names (a
checkpoint written with the TransformerEngine spec converts alike) and joined with the tensor-parallel rules of
`trainingrun.modeling.convert` (column-parallel along dim 0, row-parallel along dim 1, SwiGLU gate/up halves gathered
separately; replicated tensors must agree).

The checkpoint format belongs to `trainer/checkpoint.py`; when it changes, this function changes with it and keeps
its signature.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainingrun.modeling import convert
from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.lora import ADAPTER, merge_full_state
from trainingrun.modeling.lora_base import base_state
from trainingrun.trainer import checkpoint as ckpt

_SHARD = re.compile(r"^model_tp(\d+)_pp(\d+)\.pt$")


@dataclass
class FullState:
    state: dict[str, torch.Tensor]  # canonical Megatron names, full (TP 1) shapes
    arch: Architecture  # the run's model (its record in the checkpoint)
    assets_dir: Path | None  # HF config + tokenizer files kept with the checkpoint (None if the run had none)
    path: Path  # the checkpoint directory read
    progress: dict[str, Any]


def resolve_checkpoint(path: str | Path) -> Path:
    """A complete checkpoint directory: `path` itself, or the newest complete one under it."""
    path = Path(path)
    if (path / ckpt.MARKER).is_file() and (path / "progress.json").is_file():
        return path
    if path.is_dir() and (path / "progress.json").is_file():
        raise ValueError(f"checkpoint {path}: not complete (no {ckpt.MARKER} marker); refusing to read it")
    latest = ckpt.latest_checkpoint(path)
    if latest is None:
        raise ValueError(f"checkpoint {path}: not a checkpoint directory and holds no complete step_<N> checkpoint")
    return latest


def load_full_state(path: str | Path, *, merge: bool = True, base: bool = True) -> FullState:
    """The checkpoint's full state (module docstring); `merge=False` keeps a LoRA run's adapters as they are, and
    `base=False` leaves the base out of an adapters-only checkpoint (`export-hf --adapter` needs none)."""
    path = resolve_checkpoint(path)
    progress = json.loads((path / "progress.json").read_text())
    if (path / ckpt.DIST_DIR).is_dir():
        try:
            meta = ckpt.read_meta(path)
            record = meta.get("model")
            state = convert.canonical_names(ckpt.model_tensors(path))  # verifies the checkpoint first
        except ckpt.CheckpointError as exc:
            raise ValueError(str(exc)) from None
        if not isinstance(record, dict):
            raise ValueError(f"checkpoint {path}: meta.json has no model spec; cannot tell its architecture")
        arch = _architecture(path, "meta.json", record)
        marker = f".{ADAPTER}."
        if base and state and all(marker in k for k in state):  # adapters only: the base from its reference
            ref = meta.get("base")
            if not isinstance(ref, dict):
                raise ValueError(f"checkpoint {path} holds LoRA adapters only and meta.json names no base")
            state = {**base_state(ref, arch, f"checkpoint {path}"), **state}
        if merge:  # a LoRA run's adapters (spec.trainer.lora) merged into the base
            state = merge_full_state(state, arch)
    else:
        record = progress.get("model")
        if not isinstance(record, dict):
            raise ValueError(f"checkpoint {path}: progress.json has no model spec (written by an older trainer); "
                             "cannot tell its architecture")
        arch = _architecture(path, "progress.json", record)
        state = _legacy_shards(path, arch)
    shapes = convert.expected_shapes(arch)
    for n, t in state.items():
        if n in shapes and tuple(t.shape) != shapes[n]:
            raise ValueError(f"checkpoint {path}: {n} gathers to shape {tuple(t.shape)}, the model spec says "
                             f"{shapes[n]}")
    assets = path / "hf"
    return FullState(state=state, arch=arch, assets_dir=assets if assets.is_dir() else None, path=path,
                     progress=progress)


def _architecture(path: Path, where: str, record: dict[str, Any]) -> Architecture:
    try:
        return Architecture.from_dict(record)
    except ValueError as exc:
        raise ValueError(f"checkpoint {path}: {where}: {exc}") from None


def _legacy_shards(path: Path, arch: Architecture) -> dict[str, torch.Tensor]:
    """The full state of a checkpoint written before the distributed format (per-TP-rank `model_tp<t>_pp0.pt`)."""
    shards: dict[int, Path] = {}
    for f in path.iterdir():
        m = _SHARD.match(f.name)
        if m:
            if int(m.group(2)) != 0:
                raise ValueError(f"checkpoint {path}: pipeline-parallel shard {f.name} is not supported")
            shards[int(m.group(1))] = f
    if not shards or sorted(shards) != list(range(len(shards))):
        raise ValueError(f"checkpoint {path}: model shards model_tp<t>_pp0.pt missing or not numbered 0..T-1 "
                         f"(found {sorted(f.name for f in shards.values())})")
    parts = [convert.canonical_names(torch.load(shards[t], map_location="cpu", weights_only=True))
             for t in range(len(shards))]
    names = list(parts[0])
    for t, p in enumerate(parts[1:], start=1):
        if set(p) != set(names):
            raise ValueError(f"checkpoint {path}: TP shard {t} holds other tensors than shard 0")
    return {n: convert.gather_tp(n, [p[n] for p in parts], arch) for n in names}
