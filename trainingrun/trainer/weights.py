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
Implementations are the engine table's (`trainingrun.engines.table`: each engine type's publishers by
`spec.weightSync.type`), chosen by `make_publisher`; without weight sync there is none (replayed rollouts need no
weights).
"""

from __future__ import annotations

from typing import Any, Protocol

from trainingrun.engines.table import make_publisher as engine_publisher
from trainingrun.modeling.architecture import Architecture


class WeightPublisher(Protocol):
    def publish(self, version: int, module: Any) -> None:
        """Make the weights of `module` (the unwrapped Megatron model of this rank) loadable as `version`."""

    def close(self) -> None: ...


def make_publisher(spec, store, *, arch: Architecture, rank: int, attempt: int = 0) -> WeightPublisher | None:
    """The publisher `spec.weightSync` asks for, or None (replayed rollouts need no weights); `arch`: the run's
    resolved model. The publishers are the engine table's (`trainingrun.engines.table`): which sync reaches which
    engine is a rule of the spec (`TrainingRunSpec`, checked at admission) — store for the megatron engine
    (`engines/store_sync.py`), disk or broadcast for vllm (`engines/vllm/publish.py`)."""
    if spec.rollout.source.type != "generate":
        return None
    return engine_publisher(spec, store, arch=arch, rank=rank, attempt=attempt)
