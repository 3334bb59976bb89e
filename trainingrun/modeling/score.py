"""Per-token log-probabilities by the Megatron model: what `trainingrun score` computes (the command, which also
reads a checkpoint's weights, is `trainingrun/trainer/score_cli.py`; the contract is in design.md).

`Scorer(arch, state=...)` builds the model with the one builder (`modeling.model.build_model`, tensor parallel size 1,
one process): Hugging Face weights when `arch.hf` is set, else the canonical `state` given. Lines are packed into
sequences of at most `max_tokens` tokens (each line attends only to itself), so scoring many short lines costs few
forward passes; line i gets log p(t1 | t0), log p(t2 | t0 t1), ... (len − 1 numbers). `read_token_lines` reads the
input lines `{"tokens": [t0, t1, ...]}`, reporting errors as `FILE:LINE: tokens: …`.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import torch

from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.model import (build_model, end_distributed, init_distributed, load_canonical_state,
                                        prepare_device, set_seed)


class ScoreError(ValueError):
    pass


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
    """A Megatron model of `arch` ready to score token sequences (one process, TP 1): the Hugging Face weights of
    `arch.hf`, or the canonical (full) `state`. `source` names where they came from (for the log line)."""

    def __init__(self, arch: Architecture, *, state: dict[str, torch.Tensor] | None = None, device: str = "auto",
                 source: str = "", log=lambda m: None):
        self.log = log
        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if device == "cuda" and not torch.cuda.is_available():
            raise ScoreError("--device cuda: no CUDA device is visible")
        self.arch = arch
        self.device = prepare_device(1 if use_cuda else 0)
        _single_process_env()
        init_distributed(self.device)
        set_seed(0)
        t0 = time.perf_counter()
        self.model = build_model(arch, self.device, parallel_output=False)
        if state is not None:
            load_canonical_state(self.model, state)
        self.model.eval()
        log(f"score: {source}: {sum(p.numel() for p in self.model.parameters()) / 1e6:.1f}M parameters, "
            f"{arch.precision}, {self.device}, loaded in {time.perf_counter() - t0:.1f}s")

    def logprobs(self, lines: list[list[int]], max_tokens: int = 4096) -> list[list[float]]:
        from megatron.core.packed_seq_params import PackedSeqParams  # deferred: megatron after prepare_device

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
        end_distributed()


def _single_process_env() -> None:
    """torch.distributed of one process on a free 127.0.0.1 port (scoring is not part of a trainer group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
