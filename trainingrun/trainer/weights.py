"""Weight publishing on the trainer side: the seam between the trainers and the generator's engine.

After every trained rollout each rank calls `Trainer.sync_weights()`, which hands the model to the run's
`WeightPublisher` (`spec.weightSync`) with the new **weight version** = the number of rollouts trained so far
(version 0 = the initial weights). Versions are what bounded staleness counts: rollout k is generated with weights
of version >= k - maxPolicyLag (docs/trainer.md, "Weight sync").

A publisher's obligations:
  * `publish(version, module)` is called on every rank, in step (a publisher may gather tensor-parallel shards with a
    collective); rank 0 writes. It returns when version `version` is *loadable* by the engine.
  * a version becomes visible to the rollout only when it is complete: a reader never sees half the tensors of a
    version, and an interrupted publish leaves the previous version as the newest (never half-applied).
  * publishing the same version twice (a restarted trainer group) is harmless.
  * `close()` releases what it holds.
Implementations are chosen by `make_publisher` from `spec.weightSync.type`; without weight sync there is none
(replayed rollouts need no weights).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from trainingrun.modeling.architecture import Architecture
from trainingrun.vllm.publish import make_vllm_publisher


class WeightPublisher(Protocol):
    def publish(self, version: int, module: Any) -> None:
        """Make the weights of `module` (the unwrapped Megatron model of this rank) loadable as `version`."""

    def close(self) -> None: ...


class StoreWeightPublisher:
    """`weightSync.type: store`: the state dict as raw tensors through the run's store (`Store.publish_weights`,
    pickle-free wire format, bf16 as its 16 bits), written by rank 0; versions older than the newest the rollout may
    still need (version − maxPolicyLag) are released."""

    def __init__(self, store, *, rank: int, max_policy_lag: int):
        self.store, self.rank, self.lag = store, rank, max_policy_lag
        self.last_seconds = 0.0
        self.last_bytes = 0

    def publish(self, version: int, module: Any) -> None:
        if self.rank != 0:
            return
        from trainingrun.modeling.state import state_dict_arrays  # deferred: torch

        t0 = time.perf_counter()
        arrays, dtypes = state_dict_arrays(module)
        self.store.publish_weights(version, arrays, {"dtypes": dtypes, "version": version})
        self.store.release_weights_below(max(0, version - self.lag))
        self.last_seconds = time.perf_counter() - t0
        self.last_bytes = sum(a.nbytes for a in arrays.values())

    def close(self) -> None:
        pass


def make_publisher(spec, store, *, arch: Architecture, rank: int, attempt: int = 0) -> WeightPublisher | None:
    """The publisher `spec.weightSync` asks for, or None (replayed rollouts need no weights); `arch`: the run's
    resolved model. Which sync reaches which engine is a rule of the spec (`TrainingRunSpec`, checked at admission):
    store for the megatron engine, disk or broadcast for vllm."""
    if spec.rollout.source.type != "generate":
        return None
    if spec.weight_sync.type == "store":
        if spec.trainer.pipeline_parallel_size > 1:  # it publishes rank 0's own state dict: one pipeline stage
            raise ValueError(f"weightSync.type: store publishes trainer rank 0's state dict, which holds one stage "
                             f"of trainer.pipelineParallelSize {spec.trainer.pipeline_parallel_size}; allowed: "
                             "pipelineParallelSize 1 with store, or the vllm engine (disk, broadcast), whose "
                             "publishers gather the stages")
        return StoreWeightPublisher(store, rank=rank, max_policy_lag=spec.rollout.max_policy_lag)
    return make_vllm_publisher(spec, store, arch=arch, rank=rank, attempt=attempt)
