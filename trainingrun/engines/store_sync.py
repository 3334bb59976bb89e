"""`weightSync.type: store`, the megatron engine's weight sync: the trainer-side publisher of the full weights as raw
tensors through the run's store (`Store.publish_weights`, pickle-free wire format, bf16 as its 16 bits), written by
trainer rank 0; the in-process engine (`megatron.py`) reads a version back with `Store.read_weights`.

At tensor or expert parallelism > 1 the ranks of one whole copy of the model (data-parallel replica 0; with experts,
expert-data-parallel replica 0) first gather the full canonical state (`modeling.state.gather_live_state`, the gather
every publisher uses); the in-process engine is one rank. Versions older than the newest the rollout may still need
(version − maxPolicyLag) are released. Which pipeline-parallel sizes it serves is a rule of the spec.
"""

from __future__ import annotations

import time
from typing import Any

from trainingrun.modeling.architecture import Architecture


class StoreWeightPublisher:
    """The `store` publisher (see the module docstring); a `trainingrun.trainer.weights.WeightPublisher`."""

    def __init__(self, store, *, rank: int, max_policy_lag: int, arch: Architecture, dp_rank: int = 0, **layout):
        self.store, self.rank, self.lag = store, rank, max_policy_lag
        self.arch, self.dp_rank = arch, dp_rank
        self.layout = layout  # `gather_live_state`'s keywords (`modeling.state.live_layout`); none: one process
        self.last_seconds = 0.0
        self.last_bytes = 0

    def publish(self, version: int, module: Any) -> None:
        self.last_seconds, self.last_bytes = 0.0, 0  # what this publish moved
        if self.dp_rank != 0:
            return
        from trainingrun.modeling.state import gather_live_state, tensors_arrays  # deferred: torch

        t0 = time.perf_counter()
        # a collective over the TP group: every TP rank of replica 0 takes part; rank 0 receives the full state
        state = gather_live_state(module, self.arch, **self.layout)
        if self.rank != 0:
            return
        arrays, dtypes = tensors_arrays(state)
        self.store.publish_weights(version, arrays, {"dtypes": dtypes, "version": version})
        self.store.release_weights_below(max(0, version - self.lag))
        self.last_seconds = time.perf_counter() - t0
        self.last_bytes = sum(a.nbytes for a in arrays.values())

    def close(self) -> None:
        pass


def make_store_publisher(spec, store, *, arch: Architecture, rank: int, attempt: int = 0) -> StoreWeightPublisher:
    """The engine table's publisher factory for `weightSync.type: store` (Megatron's parallel state is initialised)."""
    from trainingrun.modeling.state import live_layout  # deferred: torch, megatron

    return StoreWeightPublisher(store, rank=rank, max_policy_lag=spec.rollout.max_policy_lag, arch=arch,
                                **live_layout())
