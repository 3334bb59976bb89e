"""A rollout published for one data-parallel size, re-scheduled for another (elastic data parallelism).

When a run restarts at a new data-parallel size D' (another `--trainers`, or `spec.trainer.replicas` changed), the
store may still hold rollouts the rollout published for the old size D: those not yet acknowledged, and those
acknowledged but not yet covered by a checkpoint (a restarted group trains from its checkpoint, so it needs them
too). Their payloads are split D ways. Committed rollouts are immutable in the store, so they are not rewritten:
every trainer rank reads the D old payloads and re-schedules the rollout itself — a pure, deterministic function,
so all ranks compute the same plan and each takes its part. (The rollout schedules everything it publishes after
the restart for D' directly.)

The re-schedule keeps each step exactly: step s of the new plan holds the same samples as step s of the old one
(the old step index is the "group" of each sample and every step is one group), so GBS_s, the loss-token count T_s,
the LR schedule and the run's step/sample offsets are unchanged, and because the loss is DP-invariant, so is the
training. Only the split over ranks and micro-batches changes (with the same `maxTokensPerGPU` / `microBatchSize` /
`microbatchMultiple`). A step with fewer samples than D' cannot be split (every rank needs a sample): ValueError.

Acknowledgements stay in the old rollout's terms (its commit says D ranks must ack): new rank r acknowledges the
old ranks r, r + D', r + 2D', ... below D (`acked_ranks`), so every old rank is acknowledged exactly once whether
the group grew or shrank, and backpressure and release work unchanged.
"""

from __future__ import annotations

import numpy as np

from trainingrun.contract.fields import FIELDS, TOKEN
from trainingrun.contract.payload import PAYLOAD_FIELDS, PAYLOAD_OPTIONAL, RankPayload, token_width
from trainingrun.schedule import DPSchedule, build_dp_schedule


def acked_ranks(old_dp: int, new_dp: int, rank: int) -> list[int]:
    """The old ranks that new data-parallel rank `rank` acknowledges for a rollout published for `old_dp` ranks."""
    return list(range(rank, old_dp, new_dp))


def reschedule(schedule: DPSchedule, payloads: dict[int, RankPayload], dp_size: int) -> tuple[DPSchedule, dict[int, RankPayload]]:
    """(`schedule` re-planned over `dp_size` ranks with the same steps, the new per-rank payloads).

    `payloads` holds every old rank's payload (ranks 0..schedule.dp_size-1). ValueError naming the step when a step
    has fewer samples than `dp_size`."""
    old_dp = schedule.dp_size
    if sorted(payloads) != list(range(old_dp)):
        raise ValueError(f"payloads: need every old rank 0..{old_dp - 1}, got {sorted(payloads)}")
    # Every sample as (old rank, position in that rank's payload), in (step, original sample index) order.
    where: dict[int, tuple[int, int]] = {}
    for r, part in enumerate(schedule.partitions):
        for pos, i in enumerate(part):
            where[i] = (r, pos)
    order: list[tuple[int, int]] = []
    steps: list[int] = []
    for s in range(schedule.num_steps):
        members = sorted(schedule.step_samples(s))
        if len(members) < dp_size:
            raise ValueError(f"step {s} has {len(members)} samples, fewer than the new data-parallel size {dp_size} "
                             "(every rank needs a sample in every step)")
        order += [where[i] for i in members]
        steps += [s] * len(members)
    lengths = [int(payloads[r]["offsets"][p + 1] - payloads[r]["offsets"][p]) for r, p in order]
    new = build_dp_schedule(
        lengths, dp_size=dp_size, global_batch_size=1, group_ids=steps,
        max_tokens_per_gpu=schedule.max_tokens_per_gpu, micro_batch_size=schedule.micro_batch_size,
        microbatch_multiple=schedule.microbatch_multiple, cost=schedule.cost,
    )
    if list(new.global_batch_sizes) != list(schedule.global_batch_sizes) or new.leftover:
        raise AssertionError("re-schedule changed the steps")  # the construction above forbids it
    return new, {r: _gather(payloads, [order[j] for j in part]) for r, part in enumerate(new.partitions)}


def _gather(payloads: dict[int, RankPayload], picks: list[tuple[int, int]]) -> RankPayload:
    """A payload of the samples `picks` ((old rank, position) each), in that order: every field of the table
    (`contract.fields`) the payloads have, cut per token (W values per token with a width) or per sample."""
    dtypes = {**PAYLOAD_FIELDS, **{k: v for k, v in PAYLOAD_OPTIONAL.items() if k in payloads[0]}}
    rows = [FIELDS[name] for name in dtypes if name in FIELDS]  # all but offsets
    parts: dict[str, list] = {f.name: [] for f in rows}
    lens = []
    width = {f.name: {r: token_width(payloads[r], f.name) for r in payloads} for f in rows if f.per == TOKEN}
    for r, p in picks:
        src = payloads[r]
        a, b = int(src["offsets"][p]), int(src["offsets"][p + 1])
        for f in rows:
            if f.per == TOKEN:
                w = width[f.name][r]
                parts[f.name].append(np.asarray(src[f.name][a * w:b * w]))
            else:
                parts[f.name].append(src[f.name][p:p + 1])
        lens.append(b - a)
    offsets = np.zeros(len(picks) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    out: RankPayload = {name: np.concatenate(v) if v else np.zeros(0, dtypes[name]) for name, v in parts.items()}
    out["offsets"] = offsets
    return {name: out[name].astype(dtype, copy=False) for name, dtype in dtypes.items()}
