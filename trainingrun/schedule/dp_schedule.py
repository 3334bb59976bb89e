"""Per-step data-parallel schedule for one rollout's samples.

Contract invariants (each asserted by tests/unit/test_schedule*.py; :meth:`DPSchedule.validate` re-checks the
structural ones for a schedule read from the store):

1. Every sample not in ``leftover`` is placed exactly once: the ``partitions`` and ``leftover`` together hold each
   index of ``lengths`` exactly once.
2. A group (samples with equal group id) is never split across steps, nor between a step and ``leftover``.
3. Every rank runs the same number of micro-batches ``num_microbatches[s]`` in step ``s``, a multiple of
   ``microbatch_multiple`` (and ≥ ``microbatch_multiple``).
4. Each rank's micro-batch positions, flattened in order, are exactly ``range(len(partitions[r]))``.
5. Dynamic mode: a micro-batch holds at most ``max_tokens_per_gpu`` tokens, unless it is a single oversized sample.
   Static mode: a micro-batch holds at most ``micro_batch_size`` samples.
6. ``global_batch_sizes[s]`` is the number of samples of step ``s`` over all ranks, and
   ``sum(global_batch_sizes) == len(lengths) - len(leftover)``.
7. Every rank gets at least one sample in every step.
8. Bad arguments raise ``ValueError`` whose message starts with the argument's name (``"dp_size: ..."``).

Steps and leftover: groups are ordered by first appearance; step ``s`` is groups ``[s·G, (s+1)·G)`` with
``G = global_batch_size`` (``None``: all groups form one step). Trailing groups that do not fill a step go to
``leftover`` (group order, then sample index), to be carried into the next rollout; nothing is dropped.

Short steps: a step with fewer samples than ``dp_size`` is a ``ValueError`` (naming ``global_batch_size``, or
``lengths`` when ``global_batch_size`` is None). The pure function never invents padding; the rollout, which knows
the step sizes before calling, puts such a short trailing step into ``leftover``.

Empty micro-batches: only in dynamic mode and only when unavoidable, i.e. when the aligned micro-batch count exceeds
the step's sample count (a few samples each close to the cap). Every rank still gets a sample (7); trainers run an
empty micro-batch as a zero-loss pass. Static mode raises ``ValueError`` instead (``micro_batch_size``).

The planning algorithm is in :mod:`trainingrun.schedule.packing`, the cost models in :mod:`trainingrun.schedule.cost`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .cost import check_cost, sample_costs
from .packing import aligned, plan_step


@dataclass(frozen=True)
class DPSchedule:
    """The schedule of one rollout. Plain lists of ints, so it travels as JSON (:meth:`to_dict` / :meth:`from_dict`).

    ``partitions[r]``: sample indices of rank ``r`` in micro-batch order, flat over steps.
    ``micro_batch_indices[r][k]``: positions into ``partitions[r]`` of rank ``r``'s ``k``-th micro-batch, flat over
    steps (step ``s`` owns ``num_microbatches[s]`` consecutive entries).
    ``num_microbatches[s]``: micro-batches per rank in step ``s`` (the same for every rank).
    ``global_batch_sizes[s]``: samples in step ``s`` over all ranks.
    ``leftover``: sample indices of trailing groups that did not fill a step.
    The remaining fields record how the schedule was built (used by :func:`schedule_stats` and :meth:`validate`).
    """

    partitions: list[list[int]]
    micro_batch_indices: list[list[list[int]]]
    num_microbatches: list[int]
    global_batch_sizes: list[int]
    leftover: list[int]
    microbatch_multiple: int = 1
    max_tokens_per_gpu: int | None = None
    micro_batch_size: int | None = None
    cost: str = "tokens"

    # ------------------------------------------------------------------------------------------------ convenience
    @property
    def dp_size(self) -> int:
        return len(self.partitions)

    @property
    def num_steps(self) -> int:
        return len(self.num_microbatches)

    def _step_range(self, step: int) -> tuple[int, int]:
        if not 0 <= step < self.num_steps:
            raise IndexError(f"step {step} out of range 0..{self.num_steps - 1}")
        start = sum(self.num_microbatches[:step])
        return start, start + self.num_microbatches[step]

    def step_microbatches(self, rank: int, step: int) -> list[list[int]]:
        """Rank ``rank``'s micro-batches in step ``step``, each a list of sample indices (possibly empty, see the
        module docstring)."""
        if not 0 <= rank < self.dp_size:
            raise IndexError(f"rank {rank} out of range 0..{self.dp_size - 1}")
        start, stop = self._step_range(step)
        part = self.partitions[rank]
        return [[part[p] for p in mb] for mb in self.micro_batch_indices[rank][start:stop]]

    def step_samples(self, step: int) -> list[int]:
        """All sample indices of step ``step`` (rank by rank, in micro-batch order)."""
        return [i for r in range(self.dp_size) for mb in self.step_microbatches(r, step) for i in mb]

    def step_loss_tokens(self, loss_token_counts: Sequence[int]) -> list[int]:
        """Per step, the sum of ``loss_token_counts[i]`` over its samples: the denominator of token-normalised loss.

        ``loss_token_counts`` is indexed by sample index (one entry per sample of the rollout)."""
        counts = np.asarray(loss_token_counts)
        needed = 1 + max((i for part in self.partitions for i in part), default=-1)
        if counts.ndim != 1 or len(counts) < needed:
            raise ValueError(f"loss_token_counts: need one count per sample (at least {needed}), got {len(counts)}")
        return [int(counts[self.step_samples(s)].sum()) if self.global_batch_sizes[s] else 0
                for s in range(self.num_steps)]

    # -------------------------------------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (fresh plain lists)."""
        return {
            "partitions": [list(map(int, p)) for p in self.partitions],
            "micro_batch_indices": [[list(map(int, mb)) for mb in r] for r in self.micro_batch_indices],
            "num_microbatches": list(map(int, self.num_microbatches)),
            "global_batch_sizes": list(map(int, self.global_batch_sizes)),
            "leftover": list(map(int, self.leftover)),
            "microbatch_multiple": int(self.microbatch_multiple),
            "max_tokens_per_gpu": self.max_tokens_per_gpu,
            "micro_batch_size": self.micro_batch_size,
            "cost": self.cost,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DPSchedule:
        """Inverse of :meth:`to_dict`; validates the structural invariants (``ValueError`` if broken)."""
        try:
            sched = cls(
                partitions=[[int(i) for i in p] for p in data["partitions"]],
                micro_batch_indices=[[[int(i) for i in mb] for mb in r] for r in data["micro_batch_indices"]],
                num_microbatches=[int(x) for x in data["num_microbatches"]],
                global_batch_sizes=[int(x) for x in data["global_batch_sizes"]],
                leftover=[int(i) for i in data.get("leftover", [])],
                microbatch_multiple=int(data.get("microbatch_multiple", 1)),
                max_tokens_per_gpu=_opt_int(data.get("max_tokens_per_gpu")),
                micro_batch_size=_opt_int(data.get("micro_batch_size")),
                cost=str(data.get("cost", "tokens")),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"schedule: malformed schedule dict ({exc!r})") from None
        sched.validate()
        return sched

    def validate(self, lengths: Sequence[int] | None = None) -> None:
        """Check invariants 1, 3, 4, 6, 7 (and 5 when ``lengths`` is given); raise ``ValueError`` naming the first
        broken one."""
        dp = self.dp_size
        if dp < 1 or len(self.micro_batch_indices) != dp:
            raise ValueError("schedule: partitions and micro_batch_indices need one entry per rank (at least one)")
        if len(self.global_batch_sizes) != self.num_steps:
            raise ValueError("schedule: global_batch_sizes and num_microbatches differ in length")
        mult = self.microbatch_multiple
        if any(m < mult or m % mult for m in self.num_microbatches):
            raise ValueError(f"schedule: num_microbatches must be positive multiples of microbatch_multiple={mult}")
        total = sum(self.num_microbatches)
        for r in range(dp):
            if len(self.micro_batch_indices[r]) != total:
                raise ValueError(f"schedule: rank {r} has {len(self.micro_batch_indices[r])} micro-batches, "
                                 f"num_microbatches sums to {total}")
            flat = [p for mb in self.micro_batch_indices[r] for p in mb]
            if flat != list(range(len(self.partitions[r]))):
                raise ValueError(f"schedule: rank {r}'s micro-batch positions do not flatten to its partition")
        for s in range(self.num_steps):
            per_rank = [sum(map(len, self.step_microbatches(r, s))) for r in range(dp)]
            if sum(per_rank) != self.global_batch_sizes[s]:
                raise ValueError(f"schedule: step {s} holds {sum(per_rank)} samples, global_batch_sizes says "
                                 f"{self.global_batch_sizes[s]}")
            if min(per_rank) < 1:
                raise ValueError(f"schedule: a rank has no sample in step {s}")
        placed = [i for p in self.partitions for i in p] + list(self.leftover)
        if len(set(placed)) != len(placed) or min(placed, default=0) < 0:
            raise ValueError("schedule: a sample index is negative or placed twice")
        if lengths is None:
            return
        lens = list(lengths)
        if sorted(placed) != list(range(len(lens))):
            raise ValueError("schedule: partitions and leftover do not cover the samples exactly once")
        cap, size = self.max_tokens_per_gpu, self.micro_batch_size
        for r in range(dp):
            for mb in self.micro_batch_indices[r]:
                ids = [self.partitions[r][p] for p in mb]
                if cap is not None and len(ids) > 1 and sum(lens[i] for i in ids) > cap:
                    raise ValueError(f"schedule: a micro-batch of rank {r} exceeds max_tokens_per_gpu={cap}")
                if size is not None and len(ids) > size:
                    raise ValueError(f"schedule: a micro-batch of rank {r} exceeds micro_batch_size={size}")


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


# ------------------------------------------------------------------------------------------------------ arguments


def _check_lengths(lengths: Any) -> np.ndarray:
    try:
        arr = np.asarray(lengths)
    except Exception:  # noqa: BLE001 - ragged or otherwise unconvertible input
        raise ValueError("lengths: must be a 1-D sequence of positive integers") from None
    if arr.ndim != 1:
        raise ValueError(f"lengths: must be a 1-D sequence of positive integers, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.floor(arr)):
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"lengths: must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr < 1)
    if len(bad):
        raise ValueError(f"lengths: must be positive, lengths[{bad[0]}] = {arr[bad[0]]}")
    return arr


def _check_int(name: str, value: Any, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}: must be an integer ≥ 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name}: must be ≥ 1, got {value}")
    return int(value)


def _group_order(n: int, group_ids: Any) -> tuple[np.ndarray, np.ndarray]:
    """Samples ordered by group (groups by first appearance, samples by index) and the group boundaries in it."""
    if group_ids is None:
        return np.arange(n), np.arange(n + 1)
    ids = group_ids.tolist() if isinstance(group_ids, np.ndarray) else list(group_ids)
    if len(ids) != n:
        raise ValueError(f"group_ids: need one group id per sample ({n}), got {len(ids)}")
    codes: dict[Any, int] = {}
    try:
        code = np.fromiter((codes.setdefault(g, len(codes)) for g in ids), dtype=np.int64, count=n)
    except TypeError:
        raise ValueError("group_ids: group ids must be hashable (ints or strings)") from None
    order = np.argsort(code, kind="stable")
    bounds = np.concatenate(([0], np.cumsum(np.bincount(code, minlength=len(codes)))))
    return order, bounds


def split_steps(n: int, group_ids: Any, global_batch_size: int | None) -> tuple[list[np.ndarray], list[int]]:
    """Split ``n`` samples into steps of ``global_batch_size`` whole groups; return (step sample indices, leftover)."""
    order, bounds = _group_order(n, group_ids)
    n_groups = len(bounds) - 1
    if n_groups == 0:
        return [], []
    per_step = n_groups if global_batch_size is None else global_batch_size
    n_steps = n_groups // per_step
    steps = [order[bounds[s * per_step]:bounds[(s + 1) * per_step]] for s in range(n_steps)]
    return steps, order[bounds[n_steps * per_step]:].tolist()


# ------------------------------------------------------------------------------------------------------------ build


def step_fits(num_samples: int, *, dp_size: int, micro_batch_size: int | None = None, microbatch_multiple: int = 1) -> bool:
    """Whether :func:`build_dp_schedule` can plan one step of ``num_samples`` samples (instead of raising).

    Every rank needs a sample (``num_samples >= dp_size``). Static mode (``micro_batch_size``) also needs a sample in
    each of its aligned micro-batches: ``ceil(n / micro_batch_size)`` rounded up to a multiple of
    ``dp_size × microbatch_multiple`` must not exceed ``n``. Dynamic mode has no such limit (empty micro-batches).
    The rollout asks this before it forms a step, so a step that cannot be planned is carried (or reported), never
    published.
    """
    n = int(num_samples)
    if n < dp_size:
        return False
    if micro_batch_size is None:
        return True
    return aligned(-(-n // micro_batch_size), dp_size * microbatch_multiple) <= n



def build_dp_schedule(
    lengths: Sequence[int],
    *,
    dp_size: int,
    global_batch_size: int | None = None,
    group_ids: Sequence[Any] | None = None,
    max_tokens_per_gpu: int | None = None,
    micro_batch_size: int | None = None,
    microbatch_multiple: int = 1,
    cost: str = "tokens",
) -> DPSchedule:
    """Split a rollout's samples into steps and plan each step's micro-batches over ``dp_size`` ranks.

    ``lengths[i]``: tokens of sample ``i`` (≥ 1). ``global_batch_size``: groups per step (None: one step of all
    groups). ``group_ids``: group of each sample (None: every sample its own group). Exactly one of
    ``max_tokens_per_gpu`` (dynamic micro-batches capped in tokens) and ``micro_batch_size`` (static: at most that
    many samples per micro-batch) is given. ``microbatch_multiple``: micro-batches per rank per step must be a
    multiple of it (virtual pipeline stages). ``cost``: ``"tokens"`` or ``"flops"``, the load that is balanced.
    See the module docstring for the invariants, short steps and empty micro-batches.
    """
    lens = _check_lengths(lengths)
    dp = _check_int("dp_size", dp_size)
    gbs = _check_int("global_batch_size", global_batch_size, optional=True)
    cap = _check_int("max_tokens_per_gpu", max_tokens_per_gpu, optional=True)
    mbs = _check_int("micro_batch_size", micro_batch_size, optional=True)
    mult = _check_int("microbatch_multiple", microbatch_multiple)
    check_cost(cost)
    if (cap is None) == (mbs is None):
        raise ValueError("max_tokens_per_gpu: give exactly one of max_tokens_per_gpu (dynamic micro-batches) and "
                         "micro_batch_size (static micro-batches)")
    assert dp is not None and mult is not None
    steps, leftover = split_steps(len(lens), group_ids, gbs)
    costs = sample_costs(lens, cost)

    partitions: list[list[int]] = [[] for _ in range(dp)]
    positions: list[list[list[int]]] = [[] for _ in range(dp)]
    num_microbatches: list[int] = []
    global_batch_sizes: list[int] = []
    for s, idx in enumerate(steps):  # before any planning: a short step is a caller error, reported first
        if len(idx) < dp:
            name = "lengths" if gbs is None else "global_batch_size"
            raise ValueError(f"{name}: step {s} has {len(idx)} samples, fewer than dp_size={dp}; every rank needs "
                             f"at least one sample per step (put a short trailing step into leftover)")
    for s, idx in enumerate(steps):
        try:
            local, sizes = plan_step(lens[idx], costs[idx], dp_size=dp, multiple=mult, token_cap=cap, count_cap=mbs,
                                     cost_is_tokens=cost == "tokens")
        except ValueError as exc:
            raise ValueError(f"{exc} (step {s})") from None
        ordered = idx[local].tolist()
        taken = 0
        for r, rank_sizes in enumerate(sizes):
            start = len(partitions[r])
            count = sum(rank_sizes)
            partitions[r] += ordered[taken:taken + count]
            taken += count
            for size in rank_sizes:
                positions[r].append(list(range(start, start + size)))
                start += size
        num_microbatches.append(len(sizes[0]))
        global_batch_sizes.append(len(idx))
    return DPSchedule(
        partitions=partitions,
        micro_batch_indices=positions,
        num_microbatches=num_microbatches,
        global_batch_sizes=global_batch_sizes,
        leftover=leftover,
        microbatch_multiple=mult,
        max_tokens_per_gpu=cap,
        micro_batch_size=mbs,
        cost=cost,
    )
