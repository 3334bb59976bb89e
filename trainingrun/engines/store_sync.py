"""`weightSync.type: store`, the megatron engine's weight sync: the trainer-side publisher of the full weights as raw
tensors through the run's store, streamed and written in parallel (issue 28 item 5); the in-process engine
(`megatron.py`) reads a version back, assembled, with `Store.read_weights`.

Each version is written in parts (`Store.begin_weights` … `commit_weights`, `store/parts.py`): the ranks of one whole
copy of the model (data-parallel replica 0; with experts, expert-data-parallel replica 0) run the streamed gather
(`modeling.stream.iter_live_buckets`, buckets of `weightSync.bucketMiB`) and every owner of buckets
(`stream.shard_owner`: each TP or EP rank of every pipeline stage; a stage keeps the buckets of its own layers)
writes each bucket it assembles as a part of the version (pickle-free wire format, bf16 as
its 16 bits; the tensors' dtypes in the owner's record), a bucket at a time: no rank holds more than its shard and a
bucket or two, never the whole model. Then the owner's record (its parts, or the error that stopped it), a collective
of the whole world (the bytes written, summed: also the barrier), and rank 0 commits — the version becomes the
latest only once every owner's parts are there; an owner that failed leaves nothing committed, its parts removed,
and rank 0 raises `IncompleteWeights` naming it. Rank 0 decides first whether there is anything to write (a version
already committed, e.g. republished by a restarted group, is skipped by every rank: an int broadcast, nothing
pickled). Versions older than the newest the rollout may still need (version − maxPolicyLag) are released, their
parts with them.

A LoRA run (`trainer.lora`; the engine applies adapters, `megatron.py`): this publisher's first version carries the
frozen base (streamed by its owners as above, `iter_live_buckets(merge=False)`) and the adapters, unmerged (meta
`lora: "base+adapters"`), every later one the adapters alone (`lora: "adapters"`); the adapters (megabytes) are
gathered to rank 0 by the same loop (`iter_live_buckets(adapters=True)`) and written by it, so `weight_sync_bytes` is
the adapters' from the second version on. A restarted trainer group's publisher starts again with the base.

Every LoRA version's meta also names its base (`"base"`: the record LoRA checkpoints keep, `modeling.lora_base`:
{"source": "model.hf", "hf", "digest"} or {"source": "seed", "seed", "digest"}), so that the engine of a rollout
restarted alone — whose first version is adapters only — rebuilds the base itself (`lora_base.base_state`, the digest
checked) instead of needing it in the store: the store never holds the base after the first version. The record is the
trainer's (`set_base`: `TrainerCheckpoints.base_reference`, computed once per trainer process on rank 0 and shared
with the checkpoints; a model.hf digest cached beside them); it is taken in `_begin`, so a failure to compute it stops
every rank before anything is written.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.sync_plan import DEFAULT_BUCKET_MIB, bucket_bytes


class StoreWeightPublisher:
    """The `store` publisher (see the module docstring); a `trainingrun.trainer.weights.WeightPublisher`."""

    def __init__(self, store, *, rank: int, max_policy_lag: int, arch: Architecture, dp_rank: int = 0,
                 lora: bool = False, bucket_mib: int = DEFAULT_BUCKET_MIB, **layout):
        self.store, self.rank, self.lag = store, rank, max_policy_lag
        self.arch, self.dp_rank = arch, dp_rank
        self.lora, self.sent_base = lora, False  # a LoRA run: the base once, then adapters only
        self.base: Callable[[], dict[str, Any] | None] | None = None  # LoRA: the base record, on rank 0 (`set_base`)
        self._base_record: dict[str, Any] | None = None  # what this version's meta names (rank 0)
        self.layout = layout  # `iter_live_buckets`' keywords (`modeling.state.live_layout`); none: one process
        self.bucket_bytes = bucket_bytes(bucket_mib)  # ValueError naming weightSync.bucketMiB
        if layout:
            from trainingrun.modeling.stream import shard_owner  # deferred: torch

            owner, self.owners = shard_owner(**layout)
        else:
            owner, self.owners = 0, 1
        self.owner = owner if dp_rank == 0 else -1  # -1: writes no part (another data-parallel replica)
        self.last_seconds = 0.0
        self.last_bytes = 0  # rank 0: the version's tensor bytes (every owner's); elsewhere this rank's
        self.last_parts = 0  # the parts this rank wrote of the last version

    def set_base(self, reference: Callable[[], dict[str, Any] | None]) -> None:
        """A LoRA run: where every version's base record comes from (rank 0 calls it at each publish; it computes
        the record once, `TrainerCheckpoints.base_reference`)."""
        self.base = reference

    def publish(self, version: int, module: Any) -> None:
        self.last_seconds, self.last_bytes, self.last_parts = 0.0, 0, 0  # what this publish moved
        t0 = time.perf_counter()
        if not self._begin(version):
            return  # committed already: every rank skips (no collective of the gather runs)
        mode = None if not self.lora else "adapters" if self.sent_base else "base+adapters"
        written = self._write(version, module, mode)
        from trainingrun.modeling.stream import world_int  # deferred: torch

        total = world_int(written, "sum")  # every owner's record is written: the barrier before the commit
        self.sent_base = self.sent_base or mode is not None
        self.last_bytes = written
        if self.rank != 0:
            return
        lora = {} if mode is None else {"lora": mode, **({"base": self._base_record} if self._base_record else {})}
        self.store.commit_weights(version, self.owners, {"version": version, **lora})
        self.store.release_weights_below(max(0, version - self.lag))
        self.last_seconds, self.last_bytes = time.perf_counter() - t0, total

    def _begin(self, version: int) -> bool:
        """Rank 0's `begin_weights` on every rank: whether there is a version to write. Rank 0's failure (a store
        error, a fenced-off attempt, a LoRA base record it cannot compute) reaches the others as a RuntimeError,
        not as a hang in the next collective."""
        from trainingrun.modeling.stream import world_int  # deferred: torch

        fresh, error = 0, None
        if self.rank == 0:
            try:
                if self.lora and self.base is not None:  # before anything is written (module docstring)
                    self._base_record = self.base()
                fresh = int(self.store.begin_weights(version))
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the others learnt of it
                fresh, error = 2, exc
        fresh = world_int(fresh)
        if error is not None:
            raise error
        if fresh == 2:
            raise RuntimeError(f"weight version {version}: trainer rank 0 could not begin it in the store (its log "
                               "says why); nothing was written")
        return bool(fresh)

    def _streams(self, module: Any, mode: str | None) -> list[tuple[Iterator[dict], bool]]:
        """(a bucket stream, whether this rank writes what it yields) for each stream of this version: the weights
        (merged; a LoRA run's first version: the frozen base) sharded over the owners, and a LoRA run's adapters,
        gathered on TP rank 0 and written by trainer rank 0. Every rank of replica 0 runs each to its end."""
        from trainingrun.modeling.stream import iter_live_buckets  # deferred: torch

        streams = []
        if mode != "adapters":
            streams.append((iter_live_buckets(module, self.arch, self.bucket_bytes, shard=self.owners > 1,
                                              merge=mode is None, **self.layout), self.owner >= 0))
        if mode is not None:
            streams.append((iter_live_buckets(module, self.arch, self.bucket_bytes, adapters=True, **self.layout),
                            self.rank == 0))
        return streams

    def _write(self, version: int, module: Any, mode: str | None) -> int:
        """This rank's part of the version: its buckets written as parts as they arrive, then (an owner) its record
        — its parts and their dtypes, or the error that stopped it (the streams are run to their end either way, so
        that the other ranks' collectives complete). The tensors' bytes written (without the parts' headers)."""
        if self.dp_rank != 0:
            return 0
        from trainingrun.modeling.state import tensors_arrays  # deferred: torch

        parts: list[dict] = []
        dtypes: dict[str, str] = {}
        error, nbytes = None, 0
        for stream, mine in self._streams(module, mode):
            for bucket in stream:
                if not mine or error is not None:
                    continue
                try:
                    arrays, types = tensors_arrays(bucket)
                    parts.append(self.store.write_weights_part(version, self.owner, len(parts), arrays))
                    dtypes.update(types)
                    nbytes += sum(a.nbytes for a in arrays.values())
                except Exception as exc:  # noqa: BLE001 - recorded for rank 0, which then commits nothing
                    error = f"{type(exc).__name__}: {exc}"
                del bucket
        self.last_parts = len(parts)
        if self.owner >= 0:
            try:
                if error is None:
                    self.store.write_weights_owner(version, self.owner, parts=parts, meta={"dtypes": dtypes})
                else:
                    self.store.write_weights_owner(version, self.owner, error=error)
            except Exception:  # noqa: BLE001 - rank 0 finds no record and names this owner
                pass
        return nbytes

    def close(self) -> None:
        pass


def make_store_publisher(spec, store, *, arch: Architecture, rank: int, attempt: int = 0) -> StoreWeightPublisher:
    """The engine table's publisher factory for `weightSync.type: store` (Megatron's parallel state is initialised)."""
    from trainingrun.modeling.state import live_layout  # deferred: torch, megatron

    return StoreWeightPublisher(store, rank=rank, max_policy_lag=spec.rollout.max_policy_lag, arch=arch,
                                lora=spec.trainer.lora is not None, bucket_mib=spec.weight_sync.bucket_mib,
                                **live_layout())
