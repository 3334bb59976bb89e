"""Checkpoints: model, optimizer, LR scheduler and progress, written atomically; resume from the newest complete one.

Layout under `spec.trainer.checkpoint.path` (relative paths resolve against the process's working directory):
  step_00000010/           a complete checkpoint (global step 10)
    model_tp0_pp0.pt        model state of that model-parallel shard (written by its data-parallel rank 0)
    optim_tp0_pp0.pt        optimizer state of that shard
    state.pt                scheduler state + RNG states (rank 0)
    progress.json           {global_step, rollout, step_in_rollout, samples_consumed, ..., model: resolved spec}
    hf/                     config.json + tokenizer files of the HF directory the run started from (if any)
    COMPLETE                marker, written last
  .tmp-step_00000010-a1/   being written (attempt 1); never loaded, removed by the next save

Protocol: rank 0 creates the temporary directory; the shards are written; barrier; rank 0 writes progress.json and
COMPLETE (each fsynced), renames the directory to its final name and fsyncs the parent; barrier. A directory without
COMPLETE, or with a name that is not `step_<digits>`, is never loaded — so a crash at any point leaves either the old
newest checkpoint or the new one. Loading uses `torch.load(weights_only=True)` only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

MARKER = "COMPLETE"
_NAME = re.compile(r"^step_(\d{8,})$")


@dataclass
class Progress:
    """Where training stands: the next rollout/step to train and the totals so far."""

    global_step: int = 0  # optimizer steps completed
    rollout: int = 0  # rollout holding the next step
    step_in_rollout: int = 0  # index of the next step within that rollout
    samples_consumed: int = 0
    tokens_consumed: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Progress:
        return cls(**{k: int(d[k]) for k in ("global_step", "rollout", "step_in_rollout", "samples_consumed")},
                   tokens_consumed=int(d.get("tokens_consumed", 0)))


def _fsync_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _NAME.match(d.name)
        if m and d.is_dir() and (d / MARKER).is_file() and (d / "progress.json").is_file():
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    ckpts = complete_checkpoints(root)
    return ckpts[-1] if ckpts else None


def _model_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    # TransformerEngine keeps `_extra_state` blobs (BytesIO) that weights_only loading refuses; they hold FP8 metadata
    # we do not use, so they are not saved.
    return {k: v.detach().cpu() for k, v in module.state_dict().items() if not k.endswith("_extra_state")}


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu(v) for v in obj)
    return obj


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(
    root: str | Path,
    progress: Progress,
    *,
    module: torch.nn.Module,
    optimizer,
    scheduler,
    keep: int,
    attempt: int = 0,
    shard: str = "tp0_pp0",
    writes_shard: bool = True,
    is_rank0: bool = True,
    barrier=lambda: None,
    extra: dict[str, Any] | None = None,
    hf_assets: str | Path | None = None,
) -> Path:
    """Collective save of a checkpoint at `progress` (every rank calls it; see the module doc for the protocol)."""
    root = Path(root)
    name = f"step_{progress.global_step:08d}"
    tmp = root / f".tmp-{name}-a{attempt}"
    final = root / name
    if is_rank0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    if writes_shard:
        torch.save(_model_state(module), tmp / f"model_{shard}.pt")
        torch.save(_to_cpu(optimizer.state_dict()), tmp / f"optim_{shard}.pt")
    barrier()
    if is_rank0:
        torch.save({"scheduler": scheduler.state_dict(), "rng": rng_state()}, tmp / "state.pt")
        if hf_assets is not None:  # what export-hf needs besides the weights: HF config and tokenizer
            from trainingrun.modeling.hf_io import copy_assets

            copy_assets(hf_assets, tmp / "hf")
        _fsync_file(tmp / "progress.json", json.dumps({**progress.to_dict(), **(extra or {})}, indent=1).encode())
        _fsync_file(tmp / MARKER, b"ok\n")
        _fsync_dir(tmp)
        trash = None
        if final.exists():  # the same step saved by an earlier attempt: swap it out
            trash = root / f".old-{name}-a{attempt}"
            final.rename(trash)
        tmp.rename(final)
        _fsync_dir(root)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        prune(root, keep)
    barrier()
    return final


def prune(root: str | Path, keep: int) -> None:
    """Keep the `keep` newest complete checkpoints; remove older ones and leftovers of interrupted saves."""
    root = Path(root)
    complete = complete_checkpoints(root)
    for d in complete[: max(len(complete) - keep, 0)]:
        shutil.rmtree(d, ignore_errors=True)
    newest = complete[-1].name if complete else None
    for d in root.iterdir():
        if d.name.startswith((".tmp-", ".old-")) and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
        elif _NAME.match(d.name) and d.is_dir() and not (d / MARKER).is_file() and d.name != newest:
            shutil.rmtree(d, ignore_errors=True)


def load(path: str | Path, *, module: torch.nn.Module, optimizer, scheduler, shard: str = "tp0_pp0") -> Progress:
    """Restore module, optimizer, scheduler and RNG from a complete checkpoint; return its progress."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise ValueError(f"checkpoint {path}: not complete (no {MARKER} marker); refusing to load it")
    model_state = torch.load(path / f"model_{shard}.pt", map_location="cpu", weights_only=True)
    missing, unexpected = module.load_state_dict(model_state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path}: model does not match (missing {missing[:5]}, unexpected {unexpected[:5]})")
    optimizer.load_state_dict(torch.load(path / f"optim_{shard}.pt", map_location="cpu", weights_only=True))
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return Progress.from_dict(json.loads((path / "progress.json").read_text()))
