"""Reading and writing Hugging Face model directories: safetensors weights (one file or an indexed set of shards),
config.json, and the tokenizer files that travel with them. Nothing here downloads anything.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from trainingrun.modeling import convert, pipeline
from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.hf_config import hf_config_for, read_config

# Files of an HF directory that are not weights and belong to the model (tokenizer, chat template, generation).
ASSET_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
               "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
               "added_tokens.json")
SHARD_BYTES = 4 * 1024**3


class HFWeights:
    """Lazy access to the tensors of an HF directory's safetensors files (`with HFWeights(dir) as w: w.get(name)`)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise FileNotFoundError(f"model.hf: no *.safetensors weights in {self.dir} (a .bin or .gguf directory "
                                    "needs converting first: see docs/trainer.md, 'Real models')")
        self.files = files
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        from safetensors import safe_open  # deferred: safetensors

        for f in files:
            h = self._stack.enter_context(safe_open(str(self.dir / f), framework="pt"))
            self._handles[f] = h
            for key in h.keys():
                self._where[key] = f
        if weight_map is not None:
            missing = sorted(k for k in weight_map if k not in self._where)
            if missing:
                raise FileNotFoundError(f"model.hf: {index} names tensors no shard holds: {missing[:5]}")

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        return self._handles[self._where[name]].get_tensor(name)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> HFWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_megatron_state(hf_dir: str | Path, arch: Architecture, *, tp_rank: int = 0, tp_size: int = 1,
                        pp_rank: int = 0, pp_size: int = 1, ep_rank: int = 0, ep_size: int = 1,
                        dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The canonical Megatron state dict of an HF directory, as TP rank `tp_rank` of `tp_size` of pipeline stage
    `pp_rank` of `pp_size` and expert-parallel rank `ep_rank` of `ep_size` hold it (the stage's layers under its own
    numbers: `modeling.pipeline.to_stage`; the experts of this EP rank numbered from 0, `convert.split_ep`).

    Reads and converts one Megatron tensor at a time, so peak memory is the shard plus one full tensor; the experts
    of other EP ranks are not read."""
    per = arch.moe.num_experts // ep_size if arch.moe is not None else 0

    def mine(name: str) -> bool:
        e = convert.ep_layout(name)
        return e is None or ep_rank * per <= e < (ep_rank + 1) * per

    out = {}
    with HFWeights(hf_dir) as w:
        for name, full in convert.iter_hf_to_megatron(w.get, w.names(), arch, only=mine):
            for stage_name, value in pipeline.to_stage({name: full}, arch, pp_rank, pp_size).items():
                shard = convert.split_tp(name, value, arch, tp_rank, tp_size)
                out[stage_name] = shard.to(dtype) if dtype is not None else shard.clone()
    return convert.split_ep(out, arch, ep_rank, ep_size)


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    out: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if out[-1] and size + nbytes > limit:
            out.append({})
            size = 0
        out[-1][name] = t
        size += nbytes
    return out


def write_hf_dir(out_dir: str | Path, state: dict[str, torch.Tensor], arch: Architecture, *,
                 assets_dir: str | Path | None = None, dtype: torch.dtype | None = None,
                 shard_bytes: int = SHARD_BYTES) -> Path:
    """Write an HF directory from a full canonical Megatron state dict: config.json, model.safetensors (or shards +
    index), and the tokenizer/generation files found in `assets_dir` (the directory the run started from, or the
    copy a checkpoint keeps). Written into a temporary sibling and renamed, so `out_dir` is whole or absent."""
    hf_state = convert.megatron_to_hf(state, arch)
    if dtype is not None:  # shards of `shard_bytes` as written
        hf_state = {k: v.to(dtype) for k, v in hf_state.items()}
    return write_hf_shards(out_dir, _shards(hf_state, shard_bytes), arch, assets_dir=assets_dir, dtype=dtype)


def write_hf_shards(out_dir: str | Path, shards: Iterable[dict[str, torch.Tensor]], arch: Architecture, *,
                    assets_dir: str | Path | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write an HF directory from HF tensors that come in shards (a dict per safetensors file, e.g. the streamed
    sync's buckets converted by `convert.iter_megatron_to_hf`): each shard is cast to `dtype`, written and dropped
    before the next is taken, so no more than one shard is held here; one shard is `model.safetensors`, several are
    `model-0000i-of-0000n.safetensors` with their index. config.json and the assets as `write_hf_dir`; written into
    a temporary sibling and renamed, so `out_dir` is whole or absent (also when the shards' iterator raises)."""
    out = Path(out_dir)
    config = _config(arch, assets_dir, dtype)  # a model that cannot be exported is refused before any shard is taken
    tmp = staging_dir(out, f"tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        files = write_part_files(tmp, shards, dtype=dtype)
        return finish_hf_dir(tmp, out, files, arch, assets_dir=assets_dir, config=config)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def staging_dir(out_dir: Path, tag: str) -> Path:
    """The hidden sibling an HF directory is written in before it is renamed into place."""
    return out_dir.parent / f".{out_dir.name}.{tag}"


def _config(arch: Architecture, assets_dir: str | Path | None, dtype: torch.dtype | None) -> dict | None:
    """config.json's content for `dtype` (None: decided by the tensors written, see `finish_hf_dir`)."""
    if dtype is None:
        return None
    base = read_config(assets_dir) if assets_dir is not None and (Path(assets_dir) / "config.json").is_file() else None
    return hf_config_for(arch, base=base, dtype=str(dtype).removeprefix("torch."))


def write_part_files(directory: Path, shards: Iterable[dict[str, torch.Tensor]], *, prefix: str = "part",
                     dtype: torch.dtype | None = None) -> list[dict[str, Any]]:
    """Write each shard (cast to `dtype`) as `<prefix>-0000i.safetensors` in `directory`, holding one at a time;
    [{"file", "tensors", "bytes", "dtype"}] in order (the parts `finish_hf_dir` names; several writers — the trainer
    ranks of a sharded sync — each write their own with a prefix of their own)."""
    from safetensors.torch import save_file  # deferred: safetensors

    files: list[dict[str, Any]] = []
    for shard in shards:
        if dtype is not None:
            shard = {k: v.to(dtype) for k, v in shard.items()}
        # safetensors refuses tensors sharing memory and non-contiguous ones
        shard = {k: v.detach().cpu().contiguous().clone() for k, v in shard.items()}
        if not shard:
            continue
        name = f"{prefix}-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        files.append({"file": name, "tensors": list(shard), "dtype": sorted({str(v.dtype) for v in shard.values()}),
                      "bytes": sum(v.numel() * v.element_size() for v in shard.values())})
        del shard
    return files


def finish_hf_dir(tmp: Path, out: Path, files: list[dict[str, Any]], arch: Architecture, *,
                  assets_dir: str | Path | None = None, config: dict | None = None) -> Path:
    """Name the part files written in `tmp` (`write_part_files`, in the order given) as an HF directory's weights —
    one is `model.safetensors`; several `model-0000i-of-0000n.safetensors` with their index (each part's "final"
    name is set) —, add config.json
    (`config`, else from the parts' dtype) and the assets of `assets_dir`, and rename `tmp` to `out`."""
    if not files:
        raise ValueError(f"{out}: no weights to write")
    if len(files) == 1:
        files[0]["final"] = "model.safetensors"
        (tmp / files[0]["file"]).rename(tmp / "model.safetensors")
    else:
        weight_map = {}
        for i, part in enumerate(files, start=1):
            part["final"] = final = f"model-{i:05d}-of-{len(files):05d}.safetensors"
            (tmp / part["file"]).rename(tmp / final)
            weight_map.update(dict.fromkeys(part["tensors"], final))
        total = sum(int(part["bytes"]) for part in files)
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    if config is None:
        dtypes = {d for part in files for d in part["dtype"]}
        config = _config(arch, assets_dir, getattr(torch, dtypes.pop().removeprefix("torch."))
                         if len(dtypes) == 1 else torch.float32)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if assets_dir is not None:
        for name in ASSET_FILES:
            src = Path(assets_dir) / name
            if src.is_file():
                shutil.copyfile(src, tmp / name)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def copy_assets(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copy config.json and the tokenizer/generation files of an HF directory (no weights); returns their names."""
    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in ("config.json", *ASSET_FILES):
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def iter_assets(src_dir: str | Path) -> Iterator[Path]:
    for name in ("config.json", *ASSET_FILES):
        p = Path(src_dir) / name
        if p.is_file():
            yield p
