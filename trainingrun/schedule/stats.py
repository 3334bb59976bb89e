"""Balance statistics of a :class:`~trainingrun.schedule.DPSchedule`, one dict per step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .cost import check_cost, sample_costs
from .dp_schedule import DPSchedule
from .packing import lower_bound_microbatches


def schedule_stats(
    schedule: DPSchedule,
    lengths: Sequence[int],
    *,
    max_tokens_per_gpu: int | None = None,
    cost: str = "tokens",
) -> list[dict[str, Any]]:
    """Per step: ``step``, ``global_batch_size``, ``microbatches_per_rank``, ``lower_bound_microbatches`` (per rank:
    the aligned lower bound of :func:`~trainingrun.schedule.packing.lower_bound_microbatches` divided by ``dp_size``;
    None when neither a token cap nor a static size is known), ``tokens``, ``max_rank_tokens``, ``mean_rank_tokens``,
    ``token_imbalance`` (max/mean), ``max_rank_flops``, ``mean_rank_flops``, ``flops_imbalance`` (FLOPs proxy
    ``a·L + L²``), ``imbalance`` (of the chosen ``cost``), ``max_microbatch_tokens``, ``empty_microbatches`` and
    ``fill_ratio`` (step tokens / (micro-batches × cap); None without a cap).

    ``max_tokens_per_gpu`` defaults to the schedule's own cap.
    """
    check_cost(cost)
    lens = np.asarray(lengths, dtype=np.int64)
    flops = sample_costs(lens, "flops")
    cap = max_tokens_per_gpu if max_tokens_per_gpu is not None else schedule.max_tokens_per_gpu
    size = schedule.micro_batch_size
    dp = schedule.dp_size
    out = []
    for s in range(schedule.num_steps):
        rank_tokens = np.zeros(dp)
        rank_flops = np.zeros(dp)
        mb_tokens: list[int] = []
        step_ids: list[int] = []
        for r in range(dp):
            for mb in schedule.step_microbatches(r, s):
                mb_tokens.append(int(lens[mb].sum()) if mb else 0)
                rank_tokens[r] += mb_tokens[-1]
                rank_flops[r] += float(flops[mb].sum()) if mb else 0.0
                step_ids.extend(mb)
        m = schedule.num_microbatches[s]
        step_tokens = int(rank_tokens.sum())
        if cap is not None:
            lower = lower_bound_microbatches(lens[step_ids], dp_size=dp, multiple=schedule.microbatch_multiple,
                                             token_cap=cap) // dp
        elif size is not None:
            lower = lower_bound_microbatches(lens[step_ids], dp_size=dp, multiple=schedule.microbatch_multiple,
                                             count_cap=size) // dp
        else:
            lower = None
        tok_imb = _ratio(rank_tokens.max(), rank_tokens.mean())
        flops_imb = _ratio(rank_flops.max(), rank_flops.mean())
        out.append({
            "step": s,
            "global_batch_size": schedule.global_batch_sizes[s],
            "microbatches_per_rank": m,
            "lower_bound_microbatches": lower,
            "tokens": step_tokens,
            "max_rank_tokens": int(rank_tokens.max()),
            "mean_rank_tokens": float(rank_tokens.mean()),
            "token_imbalance": tok_imb,
            "max_rank_flops": float(rank_flops.max()),
            "mean_rank_flops": float(rank_flops.mean()),
            "flops_imbalance": flops_imb,
            "imbalance": tok_imb if cost == "tokens" else flops_imb,
            "max_microbatch_tokens": max(mb_tokens, default=0),
            "empty_microbatches": sum(1 for t in mb_tokens if t == 0),
            "fill_ratio": None if cap is None else step_tokens / (m * dp * cap),
        })
    return out


def _ratio(top: float, mean: float) -> float:
    return float(top / mean) if mean > 0 else 1.0
