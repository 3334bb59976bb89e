"""`trainingrun score --model PATH --input FILE.jsonl [--output FILE]`: per-token log-probabilities by the Megatron
model (contract in design.md).

PATH is a Hugging Face model directory (config.json + safetensors) or a trainer checkpoint (a `step_<N>` directory
or a checkpoint root: its newest complete checkpoint, read by `trainer/full_state.py`). Each input line
`{"tokens": [t0, t1, ...]}` gets one output line `{"logprobs": [log p(t1 | t0), log p(t2 | t0 t1), ...]}`
(len(tokens) − 1 numbers), in input order. The model (`modeling.score.Scorer`: the trainer's own builder, local
layer spec, tensor parallel size 1, one process) runs in fp32 unless `--precision` says otherwise. Input errors are
reported as `FILE:LINE: tokens: …` and nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.convert import ConversionError
from trainingrun.modeling.hf_config import read_hf_architecture
from trainingrun.modeling.score import Scorer, ScoreError, read_token_lines
from trainingrun.trainer.full_state import load_full_state


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="PATH", help="Hugging Face directory or checkpoint directory")
    parser.add_argument("--input", required=True, metavar="FILE.jsonl", help='lines {"tokens": [...]}')
    parser.add_argument("--output", default=None, metavar="FILE", help="where to write (default: standard output)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="compute precision (default fp32; the weights are cast)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="tokens per packed forward pass (default 4096)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: CUDA when available, else CPU")


def model_of(path: str | Path, precision: str) -> tuple[Architecture, dict[str, torch.Tensor] | None, str]:
    """(architecture, canonical weights or None when `arch.hf` holds them, what was read) of `--model PATH`, set up
    for scoring: the local layer spec in `precision`, with the attention this device offers (flash or sdpa: a
    checkpoint trained with te or flash elsewhere scores here too)."""
    path = Path(path)
    local = dict(precision=precision, transformer_impl="local", attention_backend="auto")
    if (path / "config.json").is_file():
        arch = read_hf_architecture(path.resolve())
        return arch.replace(**local), None, f"Hugging Face directory {path}"
    full = load_full_state(path)
    arch = full.arch.replace(hf=None, **local)
    return arch, full.state, f"checkpoint {full.path} (step {full.progress.get('global_step')})"


def _write(lines: list[list[float]], output: str | None) -> None:
    text = "".join(json.dumps({"logprobs": lp}) + "\n" for lp in lines)
    if output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    out = Path(output)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(out)


def run(args: argparse.Namespace) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.max_tokens < 1:
        log("score: error: --max-tokens: must be >= 1")
        return 1
    scorer: Scorer | None = None
    try:
        arch, state, source = model_of(args.model, args.precision)
        scorer = Scorer(arch, state=state, device=args.device, source=source, log=log)
        lines = read_token_lines(args.input, arch.vocab_size, arch.seq_length)
        t0 = time.perf_counter()
        result = scorer.logprobs(lines, args.max_tokens)
        n = sum(len(x) for x in lines)
        log(f"score: {len(lines)} lines, {n} tokens in {time.perf_counter() - t0:.1f}s")
        _write(result, args.output)
    except (ScoreError, ConversionError, ValueError, OSError) as exc:
        log(f"score: error: {exc}")
        return 1
    finally:
        if scorer is not None:
            scorer.close()
    return 0
