"""`weightSync.type: store`, the megatron engine's weight sync: the trainer-side publisher of the full weights as raw
tensors through the run's store (`Store.publish_weights`, pickle-free wire format, bf16 as its 16 bits), written by
trainer rank 0; the in-process engine (`megatron.py`) reads a version back with `Store.read_weights`.

At tensor or expert parallelism > 1 the ranks of one whole copy of the model (data-parallel replica 0; with experts,
expert-data-parallel replica 0) first gather the full canonical state (`modeling.state.gather_live_state`, the gather
every publisher uses); the in-process engine is one rank. Versions older than the newest the rollout may still need
(version − maxPolicyLag) are released. Which pipeline-parallel sizes it serves is a rule of the spec.

A LoRA run (`trainer.lora`; the engine applies adapters, `megatron.py`): this publisher's first version carries the
frozen base and the adapters, unmerged (meta `lora: "base+adapters"`), every later one the adapters alone
(`lora: "adapters"`, gathered as the vllm adapter sync gathers them: `iter_live_buckets(adapters=True)`), so
`weight_sync_bytes` is the adapters' from the second version on. A restarted trainer group's publisher starts again
with the base (the engine of a restarted rollout needs it).
"""

from __future__ import annotations

import time
from typing import Any

from trainingrun.modeling.architecture import Architecture


class StoreWeightPublisher:
    """The `store` publisher (see the module docstring); a `trainingrun.trainer.weights.WeightPublisher`."""

    def __init__(self, store, *, rank: int, max_policy_lag: int, arch: Architecture, dp_rank: int = 0,
                 lora: bool = False, **layout):
        self.store, self.rank, self.lag = store, rank, max_policy_lag
        self.arch, self.dp_rank = arch, dp_rank
        self.lora, self.sent_base = lora, False  # a LoRA run: the base once, then adapters only
        self.layout = layout  # `gather_live_state`'s keywords (`modeling.state.live_layout`); none: one process
        self.last_seconds = 0.0
        self.last_bytes = 0

    def publish(self, version: int, module: Any) -> None:
        self.last_seconds, self.last_bytes = 0.0, 0  # what this publish moved
        if self.dp_rank != 0:
            return
        from trainingrun.modeling.state import gather_live_state, tensors_arrays  # deferred: torch

        t0 = time.perf_counter()
        extra: dict[str, Any] = {}
        if self.lora:
            state, extra["lora"] = self._lora_state(module)
        else:
            # a collective over the TP group: every TP rank of replica 0 takes part; rank 0 receives the full state
            state = gather_live_state(module, self.arch, **self.layout)
        if self.rank != 0:
            return
        arrays, dtypes = tensors_arrays(state)
        self.store.publish_weights(version, arrays, {"dtypes": dtypes, "version": version, **extra})
        self.store.release_weights_below(max(0, version - self.lag))
        self.last_seconds = time.perf_counter() - t0
        self.last_bytes = sum(a.nbytes for a in arrays.values())

    def _lora_state(self, module: Any) -> tuple[dict | None, str]:
        """(rank 0: the adapters, with the frozen base the first time; None elsewhere, mode) — collectives of the
        TP/PP ranks of replica 0, as `gather_live_state`."""
        from trainingrun.modeling.state import gather_live_state  # deferred: torch
        from trainingrun.modeling.stream import iter_live_buckets  # deferred: torch

        state: dict | None = {}
        mode = "adapters"
        if not self.sent_base:
            state = gather_live_state(module, self.arch, merge=False, **self.layout)
            mode, self.sent_base = "base+adapters", True
        for bucket in iter_live_buckets(module, self.arch, 1 << 30, adapters=True, **self.layout):
            if state is not None:
                state.update(bucket)
        return state, mode

    def close(self) -> None:
        pass


def make_store_publisher(spec, store, *, arch: Architecture, rank: int, attempt: int = 0) -> StoreWeightPublisher:
    """The engine table's publisher factory for `weightSync.type: store` (Megatron's parallel state is initialised)."""
    from trainingrun.modeling.state import live_layout  # deferred: torch, megatron

    return StoreWeightPublisher(store, rank=rank, max_policy_lag=spec.rollout.max_policy_lag, arch=arch,
                                lora=spec.trainer.lora is not None, **live_layout())
