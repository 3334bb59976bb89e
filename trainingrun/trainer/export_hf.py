"""`trainingrun export-hf CHECKPOINT_DIR --out DIR`: a trainer checkpoint as a Hugging Face model directory.

Reads the checkpoint's model shards in one process (`trainingrun.trainer.full_state.load_full_state`: tensor-parallel
shards gathered, the run's `Architecture` from its record), converts the names and shapes
(`trainingrun.modeling.convert`, the export table) and writes config.json, model.safetensors (sharded above 4 GiB, with
an index) and the tokenizer files the checkpoint keeps from the directory the run started from (`hf/` inside the
checkpoint; `--tokenizer DIR` supplies them otherwise). `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and
vLLM load the result. Nothing is half-written: the directory is assembled beside `--out` and renamed into place.
Of a LoRA run's checkpoint (`spec.trainer.lora`) the merged model (base + adapters) is written, or with `--adapter`
the adapters alone as a PEFT adapter directory (`export_adapter`), which `peft.PeftModel.from_pretrained` loads onto
the base.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from trainingrun.modeling.convert import ConversionError
from trainingrun.modeling.hf_config import HFConfigError, exportable
from trainingrun.modeling.hf_io import write_hf_dir
from trainingrun.modeling.lora import peft_adapter
from trainingrun.trainer.full_state import load_full_state

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                        help="a checkpoint (…/step_00000010) or a checkpoint root (its newest complete checkpoint)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the Hugging Face directory to write (replaced)")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                        help="weight dtype in the export (default auto: as the checkpoint stores them)")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA checkpoint (spec.trainer.lora): write its adapters as a PEFT adapter directory "
                        "(adapter_config.json, adapter_model.safetensors) instead of the merged model")
    parser.add_argument("--tokenizer", metavar="HF_DIR", default=None,
                        help="take config/tokenizer files from this HF directory (default: those kept in the "
                        "checkpoint; a run initialised from model.hf keeps them)")


def export_hf(checkpoint: str | Path, out: str | Path, *, dtype: str = "auto", tokenizer: str | Path | None = None,
              log=lambda msg: None) -> Path:
    t0 = time.perf_counter()
    full = load_full_state(checkpoint)
    why = exportable(full.arch)  # before any conversion: the reason, not the tensors the conversion would not place
    if why:
        raise HFConfigError(f"checkpoint {full.path}: {why}; nothing was written")
    log(f"export-hf: read {full.path} ({len(full.state)} tensors, step {full.progress.get('global_step')}) in "
        f"{time.perf_counter() - t0:.1f}s")
    assets = Path(tokenizer) if tokenizer is not None else full.assets_dir
    if assets is None:
        log("export-hf: warning: the checkpoint keeps no tokenizer (the run did not start from model.hf) and "
            "--tokenizer was not given: the export has weights and config.json only")
    torch_dtype = None if dtype == "auto" else getattr(torch, DTYPES[dtype])
    t1 = time.perf_counter()
    path = write_hf_dir(out, full.state, full.arch, assets_dir=assets, dtype=torch_dtype)
    size = sum(f.stat().st_size for f in path.iterdir())
    log(f"export-hf: wrote {path} ({size / 1e6:.1f} MB: {', '.join(sorted(f.name for f in path.iterdir()))}) in "
        f"{time.perf_counter() - t1:.1f}s")
    return path


def export_adapter(checkpoint: str | Path, out: str | Path, *, log=lambda msg: None) -> Path:
    """A LoRA checkpoint's adapters as a PEFT adapter directory at `out` (replaced; assembled beside it and renamed
    into place), which `peft.PeftModel.from_pretrained(base, out)` loads onto the base model."""
    from safetensors.torch import save_file  # deferred: safetensors

    full = load_full_state(checkpoint, merge=False, base=False)
    try:
        tensors, config = peft_adapter(full.state, full.arch, base=str(full.arch.hf) if full.arch.hf else None)
    except ValueError as exc:
        raise ValueError(f"export-hf --adapter: checkpoint {full.path} {exc}") from None
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"export-hf: wrote the PEFT adapter {out} (rank {config['r']}, alpha {config['lora_alpha']:g}, "
        f"{', '.join(config['target_modules'])}; {len(tensors)} tensors)")
    return out


def run(args: argparse.Namespace) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        if args.adapter:
            export_adapter(args.checkpoint, args.out, log=log)
        else:
            export_hf(args.checkpoint, args.out, dtype=args.dtype, tokenizer=args.tokenizer, log=log)
    except (HFConfigError, ConversionError, ValueError, OSError) as exc:
        log(f"export-hf: error: {exc}")
        return 1
    return 0
