"""The plan of a streamed weight sync (issue 28 item 1): tensors in order → buckets, and who owns each tensor's parts.

Pure (no torch, no I/O): tested on any CPU by property tests (tests/unit/test_sync_plan.py).

Invariants (each asserted by a test):
  * every tensor is in exactly one bucket, and the buckets, read in order, give the tensors in their given order;
  * a bucket holds at most `bucket_bytes` bytes, except a single tensor larger than that, which gets a bucket of its
    own;
  * `bucket_bytes` comes from `spec.weightSync.bucketMiB` (1–16384 MiB, default 512: the API validates the range).

Ownership (`owners`): a tensor of pipeline stage s lives on the ranks of that stage; a tensor split over tensor
parallelism (or over expert parallelism) has one part on each TP (EP) rank of the stage, a replicated one is whole on
each and is read from the stage's first rank. Ranks are given as (pp_rank, tp_rank, ep_rank) triples.

Sharded snapshots (`assign_owners`): the buckets of a stage are spread over its TP (EP) ranks, balanced by bytes.

This module is the plan only; `modeling/stream.py` gathers by it for the disk, broadcast and store publishers
(docs/vllm.md, docs/rl.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MIB = 1 << 20
MIN_BUCKET_MIB, MAX_BUCKET_MIB, DEFAULT_BUCKET_MIB = 1, 16384, 512


@dataclass(frozen=True)
class Bucket:
    """One bucket: the tensor names in order and their total bytes."""

    names: tuple[str, ...]
    nbytes: int


def bucket_bytes(bucket_mib: int = DEFAULT_BUCKET_MIB) -> int:
    """Bytes of one bucket of `bucket_mib` MiB; ValueError naming weightSync.bucketMiB outside 1–16384."""
    if isinstance(bucket_mib, bool) or not isinstance(bucket_mib, int) \
            or not MIN_BUCKET_MIB <= bucket_mib <= MAX_BUCKET_MIB:
        raise ValueError(f"weightSync.bucketMiB must be an integer in {MIN_BUCKET_MIB}..{MAX_BUCKET_MIB}, "
                         f"got {bucket_mib!r}")
    return bucket_mib * MIB


def plan_buckets(sizes: Iterable[tuple[str, int]], limit: int) -> list[Bucket]:
    """Greedy, order-keeping buckets of (name, bytes) pairs: a bucket is closed when the next tensor would take it
    over `limit`; a tensor larger than `limit` gets a bucket of its own. ValueError on a repeated name, a negative
    size or a limit below 1."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1 byte, got {limit}")
    out: list[Bucket] = []
    names: list[str] = []
    total = 0
    seen: set[str] = set()
    for name, nbytes in sizes:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the sync plan")
        if nbytes < 0:
            raise ValueError(f"tensor {name!r} has a negative size {nbytes}")
        seen.add(name)
        if names and total + nbytes > limit:
            out.append(Bucket(tuple(names), total))
            names, total = [], 0
        names.append(name)
        total += nbytes
    if names:
        out.append(Bucket(tuple(names), total))
    return out


@dataclass(frozen=True)
class Layout:
    """The model-parallel sizes of one whole copy of the model."""

    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for field, value in (("tp", self.tp), ("pp", self.pp), ("ep", self.ep)):
            if value < 1:
                raise ValueError(f"layout {field} must be at least 1, got {value}")


def owners(stage: int, split: str | None, layout: Layout) -> tuple[tuple[int, int, int], ...]:
    """The (pp_rank, tp_rank, ep_rank) ranks a tensor of pipeline `stage` is read from: every TP rank of the stage for
    `split == "tp"`, every EP rank for `split == "ep"`, the stage's first rank for a replicated tensor (None)."""
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage {stage} outside 0..{layout.pp - 1}")
    if split == "tp":
        return tuple((stage, t, 0) for t in range(layout.tp))
    if split == "ep":
        return tuple((stage, 0, e) for e in range(layout.ep))
    if split is None:
        return ((stage, 0, 0),)
    raise ValueError(f"split must be 'tp', 'ep' or None, got {split!r}")


def assign_owners(sizes: Sequence[int], owners: int) -> list[int]:
    """The owner (0 … owners − 1) of each bucket of a sharded snapshot, balancing bytes: largest bucket first, each to
    the owner holding the fewest bytes so far (ties: the lower owner, then the earlier bucket) — deterministic, so
    every rank of a stage computes the same. No owner holds more than 1/owners of the bytes plus one bucket."""
    if owners < 1:
        raise ValueError(f"owners must be at least 1, got {owners}")
    held = [0] * owners
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        g = min(range(owners), key=lambda g: (held[g], g))
        out[i] = g
        held[g] += sizes[i]
    return out


def peak_bytes(buckets: Sequence[Bucket]) -> int:
    """Sync memory the streamed plan needs at most: the two largest buckets (one being filled, one being sent)."""
    sizes = sorted((b.nbytes for b in buckets), reverse=True)
    return sum(sizes[:2])
