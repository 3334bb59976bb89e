"""`rollout.engine.type: megatron`: generation in the rollout process with the run's own Megatron model code.

The engine builds the trainers' model (`trainer.model.build_model`, the same spec) in this process — one rank, tensor
and pipeline size 1, gloo on a private in-memory store — and generates with a KV-cache loop over Megatron's
`StaticInferenceContext`: one prefill of the prompts' common prefix length, then one token per forward. Rows whose
prompt is longer than the current position are fed their own prompt token (teacher forcing), so prompts of
different lengths share one batch without padding, as Megatron's static engine does. Sampling (temperature, top-p,
stop tokens, max new tokens) is done here with a `torch.Generator` seeded per call, so the same seed, prompts and
weights give the same tokens. Why this loop and not Megatron's `StaticInferenceEngine`: docs/rl.md ("Engines",
figures from benchmarks/rl_loop.py).

Weights: `load_weights(version)` reads the version's tensors through the store (`Store.read_weights`, written by the
trainers' `StoreWeightPublisher`) and loads them with one `load_state_dict(strict=True)` after every tensor was
decoded and checked: a failed read leaves the previous version in place (never half-applied).

The CPU shim (`trainer/cpu_compat.py`) is process-global; this module is used in the rollout process (or a
subprocess in tests), never in the pytest process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from trainingrun.contract.engine import Completion, Sampling

# weights travel as numpy arrays; bf16 has no numpy dtype and travels as its raw 16 bits
_TORCH_OF_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def state_dict_arrays(module: torch.nn.Module) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(arrays, dtypes) of a module's state dict: numpy views (bf16 as uint16 bits), and each tensor's torch dtype
    name. TransformerEngine `_extra_state` blobs are not weights and are skipped."""
    arrays, dtypes = {}, {}
    for name, t in module.state_dict().items():
        if name.endswith("_extra_state") or not isinstance(t, torch.Tensor):
            continue
        t = t.detach().cpu().contiguous()
        dtypes[name] = str(t.dtype).removeprefix("torch.")
        arrays[name] = (t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy())
    return arrays, dtypes


def arrays_state_dict(arrays: dict[str, np.ndarray], dtypes: dict[str, str]) -> dict[str, torch.Tensor]:
    """Inverse of `state_dict_arrays`: tensors that share the arrays' memory (often a read-only memory map of the
    stored version), for one `load_state_dict`, which copies them into the parameters and never writes to them."""
    import warnings

    out = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, arr in arrays.items():
            kind = dtypes.get(name, str(arr.dtype))
            if kind == "bfloat16":
                out[name] = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
            else:
                out[name] = torch.from_numpy(arr)
    return out


def sample_next(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], its log-probability [B] under softmax(logits / temperature)) for logits [B, V].

    Top-p keeps the smallest set of most likely tokens whose probability reaches top_p (the sampled token is drawn
    from them, renormalised); the returned log-probability is of the untruncated tempered distribution (the contract
    in `rollout/engine.py`). Temperature 0 is greedy."""
    logits = logits.float()
    if sampling.temperature <= 0:
        token = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
    probs = logp.exp()
    if sampling.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < sampling.top_p  # always keeps the most likely token
        sorted_p = torch.where(keep, sorted_p, 0.0)
        choice = torch.multinomial(sorted_p, 1, generator=generator).squeeze(-1)
        token = order.gather(-1, choice[:, None]).squeeze(-1)
    else:
        token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


class MegatronEngine:
    """In-process Megatron generation (see the module docstring)."""

    name = "megatron"

    def __init__(self, sizes: dict[str, Any], *, fetch: Callable[[int], tuple[dict[str, np.ndarray], dict]],
                 max_batch: int = 256, seed: int = 0):
        from trainingrun.trainer.model import build_model, prepare_device, set_seed

        self.device = prepare_device(0)  # the rollout generates on the CPU, or the first visible GPU
        _init_single_process()
        set_seed(seed)
        self.model = build_model(sizes, self.device, load_weights=False)  # weights: version 0 from the trainers
        self.model.eval()
        self.sizes = sizes
        self.seq_length = int(sizes["seq_length"])
        self.max_batch = max_batch
        self.fetch = fetch
        self._version = -1  # no weights loaded yet
        self.stats = {"generated_tokens": 0, "generate_seconds": 0.0, "load_seconds": 0.0, "loaded_bytes": 0}

    @property
    def weight_version(self) -> int:
        return self._version

    def load_weights(self, version: int) -> None:
        t0 = time.perf_counter()
        arrays, meta = self.fetch(version)
        state = arrays_state_dict(arrays, meta.get("dtypes", {}))
        current = {k for k in self.model.state_dict() if not k.endswith("_extra_state")}
        if set(state) != current:
            missing, unexpected = sorted(current - set(state))[:5], sorted(set(state) - current)[:5]
            raise ValueError(f"weight version {version} does not match the model (missing {missing}, unexpected "
                             f"{unexpected})")
        self.model.load_state_dict(state, strict=False)  # strict on the weight names above; _extra_state aside
        self._version = version
        self.stats["load_seconds"] += time.perf_counter() - t0
        self.stats["loaded_bytes"] += sum(a.nbytes for a in arrays.values())

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        t0 = time.perf_counter()
        rows = [list(map(int, p)) for p in prompts for _ in range(n)]
        out: list[Completion] = []
        gen = torch.Generator(device="cpu").manual_seed(int(sampling.seed))
        for start in range(0, len(rows), self.max_batch):
            out.extend(self._generate_batch(rows[start : start + self.max_batch], sampling, gen))
        self.stats["generated_tokens"] += sum(len(c.tokens) for c in out)
        self.stats["generate_seconds"] += time.perf_counter() - t0
        return [out[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate_batch(self, rows: list[list[int]], sampling: Sampling, gen: torch.Generator) -> list[Completion]:
        from megatron.core.inference.contexts import StaticInferenceContext

        lengths = [len(r) for r in rows]
        if min(lengths) < 1:
            raise ValueError("prompts: every prompt needs at least one token")
        total = min(max(lengths) + sampling.max_new_tokens, self.seq_length)
        if max(lengths) >= total:
            raise ValueError(f"prompts: a prompt of {max(lengths)} tokens leaves no room to generate within "
                             f"model seqLength {self.seq_length}")
        b = len(rows)
        tokens = torch.zeros(b, total, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = torch.tensor(r)
        plen = torch.tensor(lengths)
        logps = torch.zeros(b, total)
        done = torch.zeros(b, dtype=torch.bool)
        end = torch.full((b,), total, dtype=torch.long)  # first position after each row's completion
        reason = ["length"] * b
        stop = torch.tensor(sorted(sampling.stop_token_ids), dtype=torch.long)
        ctx = StaticInferenceContext(b, total)
        pos = torch.arange(total).unsqueeze(0).expand(b, -1)
        prev = 0
        for cur in range(min(lengths), total):
            logits = self.model(tokens[:, prev:cur], pos[:, prev:cur], None, inference_context=ctx,
                                runtime_gather_output=True)
            ctx.sequence_len_offset += cur - prev
            if prev == 0:
                ctx.enable_decode_mode()
            prev = cur
            token, logp = sample_next(logits[:, -1, :], sampling, gen)
            generating = (cur >= plen) & ~done
            tokens[:, cur] = torch.where(generating, token, tokens[:, cur])
            logps[:, cur] = torch.where(generating, logp, 0.0)
            new_tokens = cur + 1 - plen
            hit_stop = generating & torch.isin(token, stop) if len(stop) else torch.zeros_like(done)
            hit_len = generating & (new_tokens >= sampling.max_new_tokens)
            for i in torch.nonzero(hit_stop | hit_len).flatten().tolist():
                reason[i] = "stop" if bool(hit_stop[i]) else "length"
            finished = hit_stop | hit_len
            end = torch.where(finished, cur + 1, end)
            done |= finished
            if bool(done.all()):
                break
        out = []
        for i in range(b):
            a, e = lengths[i], int(end[i])
            out.append(Completion(tokens=tokens[i, a:e].numpy().astype(np.int32),
                                  logprobs=logps[i, a:e].numpy().astype(np.float32), finish_reason=reason[i]))
        return out

    def close(self) -> None:
        pass


def _init_single_process() -> None:
    """torch.distributed (gloo, world 1, an in-memory store: no port) and Megatron's parallel state, once."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
