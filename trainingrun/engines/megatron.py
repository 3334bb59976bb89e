"""`rollout.engine.type: megatron`: generation in the rollout process with the run's own Megatron model code.

The engine builds the trainers' model (`modeling.model.build_model`, the same `Architecture`) in this process — one
rank, tensor and pipeline size 1, gloo on a private in-memory store — and generates with a KV-cache loop over Megatron's
`StaticInferenceContext`: one prefill of the prompts' common prefix length, then one token per forward. Rows whose
prompt is longer than the current position are fed their own prompt token (teacher forcing), so prompts of different
lengths share one batch without padding, as Megatron's static engine does. Sampling (temperature, top-p, stop tokens,
max new tokens) is done here with a `torch.Generator` seeded per call, so the same seed, prompts and weights give the
same tokens. Why this loop and not Megatron's `StaticInferenceEngine`: docs/rl.md ("Engines", figures from
benchmarks/rl_loop.py).

Multi-turn episodes (`rollout/episodes.py`) call `generate` once per turn with each episode's whole context: the
engine keeps the last call's KV cache (when the call fit in one batch of `max_batch` rows) and continues it. Each new
context is matched with the cached row that shares its longest prefix (the episode's previous turn: the KV of its
prompt and earlier turns is valid), the cached rows are gathered into a new cache, and the forward starts at the
shortest shared prefix instead of position 0 (rows that share more are fed their own tokens up to where they differ,
as prompts of different lengths are). The sampling draws are the same as without the cache (one per position from
the shortest context on), so the tokens are those a fresh prefill gives, and the log-probabilities agree to float
rounding (`tests/integration/test_episodes_megatron.py`). Loading weights drops the cache (its KV is of the old
weights); `stats["reused_tokens"]` counts the positions not recomputed.

Weights: `load_weights(version)` reads the version's tensors through the store (`Store.read_weights`, which assembles
the parts the trainers' `StoreWeightPublisher` wrote, `store_sync.py`: each tensor- or expert-parallel owner its own
buckets of the streamed canonical state; the engine is one rank and needs the whole), and loads them with `modeling.model.load_canonical_state` after every tensor was decoded and
checked against the model's names and shapes: a failed read leaves the previous version in place (never
half-applied). The trainers may run at any tensor-parallel size; the engine is one rank. A LoRA run
(`trainer.lora`): the engine's model gets the trainers' adapters (`modeling.lora.apply_lora`) and applies them in its
forward, unmerged, as the trainers do; the first version brings the frozen base and the adapters, every later one the
adapters alone (`store_sync.py`). An engine with no base that gets an adapters-only version (the rollout restarted
alone, issue 22: the store holds no base after the first version) rebuilds the base from the record every LoRA
version names (`lora_base.base_state`: model.hf read again — its digest, then its weights — or the seeded model
drawn, on the CPU, once per rollout process), loads it and then the adapters; a base whose digest is not the
record's is refused (ConfigError naming spec.model.hf or spec.seed / spec.model and both digests: the rollout exits
78, no restart helps).

Device and attention: the first visible GPU, else the CPU (`engine_device`); the attention backend is the
trainers' rule for this device (`modeling.model.attention_choice` with `generation=True`: te in TE's layer spec, else
the local spec, whose padded KV-cache batches run torch SDPA whichever of flash and sdpa is named).

Routing (mixtures of experts, `record_routing`, set by `trainer.moe.routingReplay`): every forward records which
experts each fed token went to (`modeling.moe.RoutingHooks`), and each `Completion` carries them for its prompt and
completion tokens (`routed_experts`), so the trainer can route those tokens the same way.

The CPU shim (`modeling/cpu_compat.py`) is process-global; this module is used in the rollout process (or a
subprocess in tests), never in the pytest process.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from trainingrun.contract.engine import ABORTED, Completion, GroupRequest, OnGroup, Sampling, empty_cut
from trainingrun.contract.errors import ConfigError
from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.lora_base import base_state, describe
from trainingrun.modeling.lora_targets import LoRASettings
from trainingrun.modeling.model import (ModelOptions, attention_choice, build_model, load_canonical_state,
                                       prepare_device, set_seed)
from trainingrun.modeling.moe import RoutingHooks
from trainingrun.modeling.state import arrays_state_dict


def engine_device() -> torch.device:
    """Where the engine generates: the first visible GPU (CUDA), else the CPU (with the CPU shim)."""
    return prepare_device(1)


def sample_next(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], its log-probability [B] under the distribution it was drawn from) for logits [B, V].

    That distribution is softmax(logits / temperature); with top_p < 1 it keeps the smallest set of most likely tokens
    whose probability reaches top_p, renormalised (the sampled token is drawn from them, and its log-probability is
    log p − log Σ_kept p: what vLLM's `processed_logprobs` report — the `Engine` contract, `contract/engine.py`).
    Temperature 0 is greedy, with the log-probability at temperature 1."""
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
        kept = torch.log(sorted_p.sum(-1))
        return token, logp.gather(-1, token[:, None]).squeeze(-1) - kept
    token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


class MegatronEngine:
    """In-process Megatron generation (see the module docstring)."""

    name = "megatron"

    def __init__(self, arch: Architecture, *, fetch: Callable[[int], tuple[dict[str, np.ndarray], dict]],
                 max_batch: int = 256, seed: int = 0, reuse_cache: bool = True, record_routing: bool = False,
                 lora: LoRASettings | None = None):
        self.device = engine_device()
        _init_single_process()
        set_seed(seed)
        try:
            self.attention = attention_choice(arch, self.device, generation=True)
        except ValueError as exc:
            raise ConfigError(f"rollout.engine.type megatron: {exc}") from None
        print(f"megatron engine on {self.device}: attention {self.attention.backend} ({self.attention.reason})",
              file=sys.stderr, flush=True)
        # weights: version 0 from the trainers
        self.model = build_model(arch, self.device, load_weights=False, options=ModelOptions(attention=self.attention))
        if lora is not None:  # the trainers' adapters on the frozen base (their values come with the weights)
            from trainingrun.modeling.lora import apply_lora  # deferred: megatron after prepare_device

            apply_lora(self.model, arch, lora, seed=seed)
        self.lora = lora
        self.model.eval()
        self.routing = RoutingHooks.install(self.model, arch) if record_routing else None
        self.arch = arch
        self.seq_length = arch.seq_length
        self.max_batch = max_batch
        self.fetch = fetch
        self._version = -1  # no weights loaded yet
        # routing replay needs every token's experts from this call: a continued cache would leave its prefix unrecorded
        self.reuse_cache = reuse_cache and not record_routing
        self._cache = None  # (StaticInferenceContext, per row: the tokens whose KV it holds) of the last call
        self.stats = {"generated_tokens": 0, "generate_seconds": 0.0, "load_seconds": 0.0, "loaded_bytes": 0,
                      "reused_tokens": 0}

    @property
    def weight_version(self) -> int:
        return self._version

    def load_weights(self, version: int) -> None:
        t0 = time.perf_counter()
        arrays, meta = self.fetch(version)
        state = arrays_state_dict(arrays, meta.get("dtypes", {}))
        mode = meta.get("lora")
        if self.lora is not None and mode == "adapters" and self._version < 0:  # no base here: a restarted rollout
            state, mode = {**self._rebuilt_base(meta.get("base"), version), **state}, "base+adapters"
        try:  # names and shapes are checked before anything is copied
            if self.lora is None:
                load_canonical_state(self.model, state)
            else:
                self._load_lora(state, mode)
        except ValueError as exc:
            raise ValueError(f"weight version {version} does not match the model: {exc}") from None
        self._cache = None  # its keys and values were computed with the old weights
        self._version = version
        self.stats["load_seconds"] += time.perf_counter() - t0
        self.stats["loaded_bytes"] += sum(a.nbytes for a in arrays.values())

    def _rebuilt_base(self, ref: object, version: int) -> dict[str, torch.Tensor]:
        """The frozen base for an engine that has none and got an adapters-only version (a rollout restarted alone):
        rebuilt from the base record the version names (`lora_base.base_state`: model.hf read, or the seeded model
        drawn; its digest checked first). ValueError when the version names none; ConfigError naming the spec field
        and both digests when the base here is not the one the adapters were trained on."""
        if not isinstance(ref, dict):
            raise ValueError(f"trainer.lora: weight version {version} holds the adapters only and names no base to "
                             "rebuild, and the engine has none loaded (published by a trainer without the base record)")
        t0 = time.perf_counter()
        try:
            state = base_state(ref, self.arch, f"weight version {version}")
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigError(str(exc)) from None
        print(f"megatron engine: no base loaded and weight version {version} holds the adapters only (a rollout "
              f"restarted alone): rebuilt the base from {describe(ref)} in {time.perf_counter() - t0:.2f}s",
              file=sys.stderr, flush=True)
        return state

    def _load_lora(self, state: dict[str, torch.Tensor], mode: str | None) -> None:
        """A LoRA run's version (`store_sync.py`): the base and the adapters ("base+adapters") or the adapters alone
        ("adapters", onto the base loaded before); ValueError before anything is copied when it does not fit."""
        own = {k: v for k, v in self.model.state_dict().items() if not k.endswith(("_extra_state", ".scale_"))}
        if mode == "base+adapters":
            need = set(own)
        elif mode == "adapters" and self._version >= 0:
            need = {k for k in own if ".adapter." in k}
        else:
            raise ValueError(f"trainer.lora: the engine needs the base and adapters first, got {mode or 'a full model'}"
                             " (a trainer without trainer.lora)")
        missing, unexpected = sorted(need - set(state)), sorted(set(state) - need)
        bad = [k for k in need & set(state) if tuple(state[k].shape) != tuple(own[k].shape)]
        if missing or unexpected or bad:
            raise ValueError(f"missing {missing[:6]}, unexpected {unexpected[:6]}, misshapen {bad[:6]}")
        with torch.no_grad():
            for key, value in state.items():
                own[key].copy_(value.to(device=own[key].device, dtype=own[key].dtype))

    def drop_cache(self) -> None:
        """Forget the keys and values kept for continuing the last call (the rollout's evaluation calls it, so that
        no training call continues from an evaluation's cache: contract/engine.py)."""
        self._cache = None

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        t0 = time.perf_counter()
        rows = [list(map(int, p)) for p in prompts for _ in range(n)]
        out: list[Completion] = []
        gen = torch.Generator(device=self.device).manual_seed(int(sampling.seed))
        single = len(rows) <= self.max_batch
        if not single:
            self._cache = None
        for start in range(0, len(rows), self.max_batch):
            batch = rows[start : start + self.max_batch]
            out.extend(self._generate_batch(batch, [sampling.max_new_tokens] * len(batch), sampling, gen, keep=single))
        self.stats["generated_tokens"] += sum(len(c.tokens) for c in out)
        self.stats["generate_seconds"] += time.perf_counter() - t0
        return [out[i * n : (i + 1) * n] for i in range(len(prompts))]

    @torch.no_grad()
    def generate_groups(self, requests: Sequence[GroupRequest], sampling: Sampling, *,
                        on_group: OnGroup | None = None) -> list[list[Completion]]:
        """Grouped generation (contract/engine.py): rows of `max_batch` sequences; after every token the groups that
        finished go to `on_group`, and once it says "enough" every unfinished sequence is cut where it is (finish
        ABORTED). Cut samples (prefixes) continue after prompt + their tokens; every token carries its version."""
        t0 = time.perf_counter()
        version = self._version
        results: list[list[Completion | None]] = [[None] * r.n for r in requests]
        rows: list[tuple[int, int, list[int], int, Completion]] = []  # (request, sample, tokens, budget, prefix)
        for i, req in enumerate(requests):
            for j in range(req.n):
                p = req.prefixes[j] if req.prefixes else empty_cut()
                if p.finished:
                    results[i][j] = p
                    continue
                budget = sampling.max_new_tokens - len(p.tokens)
                if budget <= 0:
                    results[i][j] = Completion(p.tokens, p.logprobs, "length", versions=p.versions)
                    continue
                rows.append((i, j, [*map(int, req.prompt), *map(int, p.tokens)], budget, p))
        reported: set[int] = set()
        stop = False

        def report() -> bool:
            nonlocal stop
            for i, slots in enumerate(results):
                if stop or i in reported or any(c is None or not c.finished for c in slots):
                    continue
                reported.add(i)
                if on_group is not None and on_group(i, list(slots)):
                    stop = True
            return stop

        def finished(row: int, c: Completion) -> bool:
            i, j, _, _, p = batch[row]
            results[i][j] = p.extended(c.tokens, c.logprobs, c.finish_reason, version)
            return report()

        report()
        self._cache = None  # grouped generation keeps no cache (multi-turn episodes use generate)
        gen = torch.Generator(device=self.device).manual_seed(int(sampling.seed))
        new_tokens = 0
        for start in range(0, len(rows), self.max_batch):
            batch = rows[start : start + self.max_batch]
            if stop:  # never started: cut where their prefixes were
                for i, j, _, _, p in batch:
                    results[i][j] = p
                continue
            outs = self._generate_batch([r[2] for r in batch], [r[3] for r in batch], sampling, gen,
                                        on_finished=finished)
            for (i, j, _, _, p), c in zip(batch, outs):
                new_tokens += len(c.tokens)
                if results[i][j] is None:  # cut by the stop
                    results[i][j] = p.extended(c.tokens, c.logprobs, c.finish_reason, version)
        self.stats["generated_tokens"] += new_tokens
        self.stats["generate_seconds"] += time.perf_counter() - t0
        return [[c if c is not None else empty_cut() for c in slots] for slots in results]

    def _generate_batch(self, rows: list[list[int]], budgets: list[int], sampling: Sampling, gen: torch.Generator,
                        on_finished: Callable[[int, Completion], bool] | None = None,
                        keep: bool = False) -> list[Completion]:
        """One batch of rows, each with its own budget of new tokens. `on_finished(row, completion)` is called for
        each row as it finishes; once it returns True the rows still generating are cut (finish ABORTED). `keep`: keep the keys and values
        for the next call (multi-turn continuation, module docstring)."""
        from megatron.core.inference.contexts import StaticInferenceContext  # deferred: megatron after prepare_device

        lengths = [len(r) for r in rows]
        if min(lengths) < 1:
            raise ValueError("prompts: every prompt needs at least one token")
        total = min(max(a + b for a, b in zip(lengths, budgets)), self.seq_length)
        if max(lengths) >= total:
            raise ValueError(f"prompts: a prompt of {max(lengths)} tokens leaves no room to generate within "
                             f"model seqLength {self.seq_length}")
        b, dev = len(rows), self.device
        tokens = torch.zeros(b, total, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = torch.tensor(r)
        tokens = tokens.to(dev)
        plen = torch.tensor(lengths, device=dev)
        budget = torch.tensor(budgets, device=dev)
        logps = torch.zeros(b, total, device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        end = torch.full((b,), total, dtype=torch.long, device=dev)  # first position after each row's completion
        reason = ["length"] * b
        stop = torch.tensor(sorted(sampling.stop_token_ids), dtype=torch.long, device=dev)
        ctx, prev = self._continued(rows, total, min(lengths) - 1) if self.reuse_cache else (None, 0)
        if ctx is None:
            ctx = StaticInferenceContext(b, total)
        self._cache = None
        pos = torch.arange(total, device=dev).unsqueeze(0).expand(b, -1)
        routed = None
        if self.routing is not None:  # [rows, positions, layers, k]: -1 until a position is fed
            routed = torch.full((b, total, self.routing.num_layers, self.routing.top_k), -1, dtype=torch.int16)
        cur = prev
        for cur in range(min(lengths), total):
            if routed is not None:
                self.routing.prepare(record=True)
            logits = self.model(tokens[:, prev:cur], pos[:, prev:cur], None, inference_context=ctx,
                                runtime_gather_output=True)
            if routed is not None:  # the router saw [positions, rows] flattened: position s of row i is s·b + i
                rec = self.routing.recorded()
                routed[:, prev:cur] = rec.view(cur - prev, b, *rec.shape[1:]).transpose(0, 1)
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
            hit_len = generating & (new_tokens >= budget)
            newly = torch.nonzero(hit_stop | hit_len).flatten().tolist()
            for i in newly:
                reason[i] = "stop" if bool(hit_stop[i]) else "length"
            finished = hit_stop | hit_len
            end = torch.where(finished, cur + 1, end)
            done |= finished
            if on_finished is not None and newly:
                halt = False
                for i in newly:
                    halt = on_finished(i, self._completion(tokens, logps, lengths[i], int(end[i]), reason[i], i, routed))
                if halt:  # enough: every row still generating is cut after its last token
                    for i in torch.nonzero(~done).flatten().tolist():
                        reason[i] = ABORTED
                        end[i] = max(cur + 1, lengths[i])
                    break
            if bool(done.all()):
                break
        out = [self._completion(tokens, logps, lengths[i], int(end[i]), reason[i], i, routed) for i in range(b)]
        if keep and self.reuse_cache and on_finished is None:  # positions < cur were fed: their keys and values
            self._cache = (ctx, [tokens[i, :min(int(end[i]), cur)].cpu().numpy() for i in range(b)])
        return out

    @staticmethod
    def _completion(tokens: torch.Tensor, logps: torch.Tensor, start: int, end: int, reason: str,
                    row: int, routed: torch.Tensor | None = None) -> Completion:
        return Completion(tokens=tokens[row, start:end].cpu().numpy().astype(np.int32),
                          logprobs=logps[row, start:end].cpu().numpy().astype(np.float32), finish_reason=reason,
                          routed_experts=None if routed is None else
                          routed[row, :end].reshape(end, -1).cpu().numpy().copy())

    def _continued(self, rows: list[list[int]], total: int, limit: int):
        """(a cache for `rows` holding the last call's keys and values of their longest cached prefixes, the
        position to feed from), or (None, 0) when no row shares a prefix with the cache (see the module docstring).
        `limit`: feed at least the last token of the shortest row."""
        from megatron.core.inference.contexts import StaticInferenceContext  # deferred: megatron after prepare_device

        if self._cache is None or limit < 1:
            return None, 0
        old, cached = self._cache
        width = max(len(c) for c in cached)
        table = np.full((len(cached), width), -1, np.int64)
        for j, c in enumerate(cached):
            table[j, :len(c)] = c
        pick, start = [], limit
        for r in rows:
            n = min(len(r), width)
            shared = np.cumprod(table[:, :n] == np.asarray(r[:n], np.int64), axis=1).sum(axis=1)
            j = int(shared.argmax())
            pick.append(j)
            start = min(start, int(shared[j]))
        if start < 1:
            return None, 0
        ctx = StaticInferenceContext(len(rows), total)
        index = torch.tensor(pick, device=self.device)
        self._cache = None
        for layer in list(old.key_value_memory_dict):
            memories = old.key_value_memory_dict.pop(layer)  # freed as we go: one layer's old cache at a time
            fresh = []
            for m in memories:
                t = torch.empty((total, len(rows), *m.shape[2:]), dtype=m.dtype, device=m.device)
                t[:start] = m[:start, index]
                fresh.append(t)
            ctx.key_value_memory_dict[layer] = tuple(fresh)
        ctx.sequence_len_offset = start
        ctx.enable_decode_mode()
        self.stats["reused_tokens"] += start * len(rows)
        return ctx, start

    def close(self) -> None:
        pass


def _init_single_process() -> None:
    """torch.distributed (gloo, world 1, an in-memory store: no port) and Megatron's parallel state, once."""
    from megatron.core import parallel_state  # deferred: megatron after prepare_device

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def build(spec, store, arch: Architecture) -> MegatronEngine:
    """The engine table's builder of `rollout.engine.type: megatron`: the run's model (`arch`), its weight versions
    read from the store (`store_sync.py` publishes them)."""
    e = spec.rollout.engine
    return MegatronEngine(arch, fetch=store.read_weights, max_batch=e.max_batch, seed=spec.seed,
                          record_routing=spec.trainer.moe.routing_replay and arch.moe is not None,
                          lora=None if spec.trainer.lora is None else LoRASettings.from_spec(spec.trainer.lora))
