"""trainingrun.schedule: the pure data-parallel scheduler (numpy + stdlib; no torch, no I/O).

``build_dp_schedule`` splits a rollout's samples into steps, packs each step into micro-batches and distributes them
over data-parallel ranks; ``schedule_stats`` measures the result. Contract invariants: :mod:`.dp_schedule`.

Module map:
  dp_schedule.py  ``build_dp_schedule`` and ``DPSchedule``: step splitting, the per-step schedule, the leftover; the
                  contract's invariants, written at its top
  packing.py      one step's samples packed into micro-batches, then distributed over the data-parallel ranks
  cost.py         the load cost models (``tokens``, ``flops``)
  stats.py        balance statistics of a schedule (``schedule_stats``), one dict per step
  cli.py          ``trainingrun schedule``: a schedule's per-step statistics for a list of lengths
"""

from .cost import COST_MODELS, FLOPS_LINEAR_COEFF, sample_costs
from .dp_schedule import DPSchedule, build_dp_schedule, split_steps, step_fits
from .packing import lower_bound_microbatches
from .stats import schedule_stats

__all__ = [
    "COST_MODELS",
    "DPSchedule",
    "FLOPS_LINEAR_COEFF",
    "build_dp_schedule",
    "lower_bound_microbatches",
    "sample_costs",
    "schedule_stats",
    "split_steps",
    "step_fits",
]
