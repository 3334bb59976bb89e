"""`trainingrun score --model PATH --input FILE.jsonl [--output FILE]`: per-token log-probabilities by the Megatron
model (contract in design.md).

PATH is a Hugging Face model directory (config.json + safetensors) or a trainer checkpoint (a `step_<N>` directory
or a checkpoint root: its newest complete checkpoint). Each input line `{"tokens": [t0, t1, ...]}` gets one output
line `{"logprobs": [log p(t1 | t0), log p(t2 | t0 t1), ...]}` (len(tokens) − 1 numbers), in input order.

The model is built by the trainer's own builder (`trainingrun.trainer.model.build_model`, local layer spec, tensor
parallel size 1, one process) and run in fp32 unless `--precision` says otherwise. Lines are packed into sequences of
at most `--max-tokens` tokens (each line attends only to itself), so scoring many short lines costs few forward
passes. Input errors are reported as `FILE:LINE: tokens: …` and nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


class ScoreError(ValueError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="PATH", help="Hugging Face directory or checkpoint directory")
    parser.add_argument("--input", required=True, metavar="FILE.jsonl", help='lines {"tokens": [...]}')
    parser.add_argument("--output", default=None, metavar="FILE", help="where to write (default: standard output)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="compute precision (default fp32; the weights are cast)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="tokens per packed forward pass (default 4096)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: CUDA when available, else CPU")


def read_token_lines(path: str | Path, vocab_size: int, seq_length: int) -> list[list[int]]:
    errors: list[str] = []
    lines: list[list[int]] = []
    try:
        fh = open(path, encoding="utf-8")
    except OSError as exc:
        raise ScoreError(f"--input: cannot open {path}: {exc.strerror or exc}") from None
    with fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(raw)
            except ValueError as exc:
                errors.append(f"{where}: not valid JSON: {exc}")
                continue
            toks = obj.get("tokens") if isinstance(obj, dict) else None
            if not isinstance(toks, list) or not toks or not all(isinstance(t, int) and not isinstance(t, bool)
                                                                 for t in toks):
                errors.append(f"{where}: tokens: must be a non-empty list of token ids")
            elif min(toks) < 0 or max(toks) >= vocab_size:
                errors.append(f"{where}: tokens: ids must be in [0, {vocab_size}) (the model's vocabulary), got "
                              f"{min(toks)}..{max(toks)}")
            elif len(toks) > seq_length:
                errors.append(f"{where}: tokens: {len(toks)} tokens exceed the model's {seq_length} positions")
            else:
                lines.append(toks)
            if len(errors) >= 20:
                errors.append("stopped after 20 errors")
                break
    if errors:
        raise ScoreError("invalid score input:\n  " + "\n  ".join(errors))
    return lines


def _packs(lines: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Consecutive line indices per forward pass, at most max_tokens tokens each (a longer line goes alone)."""
    packs: list[list[int]] = []
    used = 0
    for i, toks in enumerate(lines):
        if packs and used + len(toks) <= max_tokens:
            packs[-1].append(i)
            used += len(toks)
        else:
            packs.append([i])
            used = len(toks)
    return packs


class Scorer:
    """A Megatron model ready to score token sequences (one process, TP 1)."""

    def __init__(self, model_path: str | Path, *, precision: str = "fp32", device: str = "auto", log=lambda m: None):
        import torch

        self.log = log
        path = Path(model_path)
        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if device == "cuda" and not torch.cuda.is_available():
            raise ScoreError("--device cuda: no CUDA device is visible")
        state = None
        if (path / "config.json").is_file():
            from trainingrun.api.models import ModelSpec

            arch = ModelSpec(hf=str(path.resolve())).resolved()
            source = f"Hugging Face directory {path}"
        else:
            from trainingrun.trainer.full_state import load_full_state

            full = load_full_state(path)
            arch, state = dict(full.arch), full.state
            arch["hf"] = None
            source = f"checkpoint {full.path} (step {full.progress.get('global_step')})"
        arch.update(precision=precision, transformer_impl="local")
        self.arch = arch

        from trainingrun.trainer.model import build_model, init_distributed, prepare_device, set_seed

        self.device = prepare_device(1 if use_cuda else 0)
        _single_process_env()
        init_distributed(self.device)
        set_seed(0)
        t0 = time.perf_counter()
        self.model = build_model(arch, self.device, parallel_output=False)
        if state is not None:
            from trainingrun.trainer.model import load_canonical_state

            load_canonical_state(self.model, state)
        self.model.eval()
        log(f"score: {source}: {sum(p.numel() for p in self.model.parameters()) / 1e6:.1f}M parameters, "
            f"{precision}, {self.device}, loaded in {time.perf_counter() - t0:.1f}s")

    def logprobs(self, lines: list[list[int]], max_tokens: int = 4096) -> list[list[float]]:
        import torch
        from megatron.core.packed_seq_params import PackedSeqParams

        out: list[list[float]] = [[] for _ in lines]
        for pack in _packs(lines, max_tokens):
            seqs = [lines[i] for i in pack]
            lens = [len(s) for s in seqs]
            ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=self.device)
            pos = torch.tensor([p for n in lens for p in range(n)], dtype=torch.long, device=self.device)
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=self.device)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                                     max_seqlen_kv=max(lens))
            with torch.no_grad():
                logits = self.model(input_ids=ids[None], position_ids=pos[None], attention_mask=None,
                                    packed_seq_params=params)[0]
                logp = torch.log_softmax(logits.float(), dim=-1)
            for j, i in enumerate(pack):
                a, b = int(cu[j]), int(cu[j + 1])
                picked = logp[a:b - 1].gather(-1, ids[a + 1:b, None]).squeeze(-1)
                out[i] = picked.double().cpu().tolist()
        return out

    def close(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state

        if dist.is_initialized():
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def _single_process_env() -> None:
    """torch.distributed of one process on a free 127.0.0.1 port (scoring is not part of a trainer group)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


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
    from trainingrun.modeling.convert import ConversionError

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.max_tokens < 1:
        log("score: error: --max-tokens: must be >= 1")
        return 1
    scorer: Any = None
    try:
        scorer = Scorer(args.model, precision=args.precision, device=args.device, log=log)
        lines = read_token_lines(args.input, int(scorer.arch["vocab_size"]), int(scorer.arch["seq_length"]))
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
