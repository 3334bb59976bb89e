"""The base model a LoRA run's adapters belong to: its reference and digest, and the base itself rebuilt from them.

A LoRA run's checkpoint (`spec.trainer.lora`) holds the adapters and their optimizer state only; the frozen base is
not written again with every checkpoint. Instead meta.json records where the base comes from and a digest of it
(`base_reference`):

  {"source": "model.hf", "hf": "/abs/dir", "digest": "sha256:…"}   SHA-256 over the directory's *.safetensors files
                                                                     (sorted by name: name, size, contents)
  {"source": "seed", "seed": 7, "digest": "sha256:…"}               SHA-256 over the seeded initialisation's whole
                                                                     tensors (`modeling.initialise.full_tensor`,
                                                                     float32, canonical names sorted: name, shape,
                                                                     bytes): the same at every parallel layout

Resuming against another base is refused (`base_problem`, naming spec.model.hf or spec.seed/spec.model and both
digests): adapters trained on one base mean nothing on another. `base_state` rebuilds the full canonical base in one
process for `trainingrun export-hf` and `trainingrun score` (`trainer.full_state`), checking its digest first.

Cost: the digest reads every weight file once (rank 0, at the first save and at resume; ~1 GB/s) or draws the seeded
model once on the CPU (`modeling.initialise`, ~100 M numbers a second). The trainer keeps a model.hf digest in a
small JSON cache beside its checkpoints (`hf_digest(..., cache=)`; never inside model.hf, which may be read-only):

  {"format": 1, "dirs": {"/abs/model.hf": {"files": [[name, size, mtime_ns, ctime_ns, inode], ...],
                                           "digest": "sha256:…"}}}

so a restart re-reads the weights only when a weight file was added, removed, resized or written since (its
modification or status-change time moved). An unreadable cache is ignored and rewritten; one that cannot be written
(a read-only volume) only costs the read.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.convert import expected_shapes
from trainingrun.modeling.hf_io import load_megatron_state
from trainingrun.modeling.initialise import full_tensor

_CHUNK = 1 << 22
DIGEST_CACHE = ".base-digest.json"  # the trainer's model.hf digest cache, in the checkpoint root
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def weight_files(hf_dir: str | Path) -> list[Path]:
    """The *.safetensors files of an HF directory, sorted by name (FileNotFoundError when there are none)."""
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model.hf: no *.safetensors weights in {hf_dir}")
    return files


def hf_digest(hf_dir: str | Path, *, cache: Path | None = None) -> str:
    """SHA-256 over an HF directory's weight files (name, size, contents of each, sorted by name); with `cache` (a
    JSON file outside the directory) taken from it while no weight file changed (module docstring)."""
    files = weight_files(hf_dir)
    key, stats = str(Path(hf_dir).resolve()), [_stat(f) for f in files]
    known = _read_cache(cache).get(key) if cache is not None else None
    if isinstance(known, dict) and known.get("files") == stats and isinstance(known.get("digest"), str):
        return known["digest"]
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    digest = f"sha256:{h.hexdigest()}"
    if cache is not None and [_stat(f) for f in files] == stats:  # not written to while it was read
        _write_cache(cache, key, {"files": stats, "digest": digest})
    return digest


def _stat(f: Path) -> list:
    st = f.stat()
    return [f.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _read_cache(cache: Path) -> dict[str, Any]:
    try:
        doc = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    dirs = doc.get("dirs") if isinstance(doc, dict) and doc.get("format") == 1 else None
    return dirs if isinstance(dirs, dict) else {}


def _write_cache(cache: Path, key: str, entry: dict[str, Any]) -> None:
    """Add `entry` under `key` (atomically: a temporary file renamed over the cache); a failure only loses the cache."""
    dirs = {**_read_cache(cache), key: entry}
    tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"format": 1, "dirs": dirs}, indent=1))
        os.replace(tmp, cache)
    except OSError:
        tmp.unlink(missing_ok=True)


def _seeded(arch: Architecture, seed: int, dtype: torch.dtype | None) -> tuple[str, dict[str, torch.Tensor]]:
    """(digest, the whole tensors in `dtype` — none kept when `dtype` is None) of the seeded initialisation."""
    h = hashlib.sha256()
    out = {}
    for name, shape in sorted(expected_shapes(arch).items()):
        t = full_tensor(name, arch, seed=seed)
        h.update(f"{name}\0{list(shape)}\0".encode())
        h.update(t.contiguous().numpy().tobytes())
        if dtype is not None:
            out[name] = t.to(dtype)
    return f"sha256:{h.hexdigest()}", out


def base_reference(arch: Architecture, seed: int, *, cache: Path | None = None) -> dict[str, Any]:
    """Where the base of a run with `arch` and `seed` comes from, and its digest (module docstring; `cache`: the
    model.hf digest cache)."""
    if arch.hf:
        return {"source": "model.hf", "hf": str(arch.hf), "digest": hf_digest(arch.hf, cache=cache)}
    return {"source": "seed", "seed": int(seed), "digest": _seeded(arch, seed, None)[0]}


def describe(ref: dict[str, Any]) -> str:
    if ref.get("source") == "model.hf":
        return f"model.hf {ref.get('hf')} ({ref.get('digest')})"
    return f"the seeded initialisation of seed {ref.get('seed')} ({ref.get('digest')})"


def base_problem(was: dict[str, Any] | None, now: dict[str, Any], where: str) -> str | None:
    """Why adapters trained on base `was` (a checkpoint's record; None: written before bases were recorded) cannot
    resume on base `now`, naming the field; None when the digests agree."""
    if was is None or was.get("digest") == now.get("digest"):
        return None
    field = "spec.model.hf" if "model.hf" in (was.get("source"), now.get("source")) else "spec.seed / spec.model"
    return (f"{field}: checkpoint {where} holds LoRA adapters trained on {describe(was)}, and this run's base is "
            f"{describe(now)}: adapters fit only the base they were trained on; allowed: the checkpoint's base "
            f"(digest {was.get('digest')}), or another trainer.checkpoint.path to start afresh")


def base_state(ref: dict[str, Any], arch: Architecture, where: str) -> dict[str, torch.Tensor]:
    """The full canonical base (TP 1, whole model, in `arch.precision`) a checkpoint's record `ref` names, checked
    against its digest; ValueError naming the checkpoint `where`, the source and both digests when it differs."""
    dtype = DTYPES[arch.precision]
    source = ref.get("source")
    if source == "model.hf":
        hf = ref.get("hf")
        if not hf or not Path(hf).is_dir():
            raise ValueError(f"checkpoint {where} holds LoRA adapters only; its base model.hf {hf} is not a directory "
                             "here (mount it at that path)")
        digest = hf_digest(hf)
        state = None
    elif source == "seed":
        digest, state = _seeded(arch, int(ref.get("seed", 0)), dtype)
    else:
        raise ValueError(f"checkpoint {where}: meta.json base record {ref} names no known source")
    if digest != ref.get("digest"):
        raise ValueError(f"checkpoint {where} holds LoRA adapters trained on {describe(ref)}; that base now has digest "
                         f"{digest}: it changed since (the adapters fit only the base they were trained on)")
    if state is None:
        state = load_megatron_state(ref["hf"], arch.replace(hf=ref["hf"]), dtype=dtype)
    return state
