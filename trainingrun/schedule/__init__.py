"""trainingrun.schedule: the pure data-parallel scheduler (numpy + stdlib; no torch, no I/O).

``build_dp_schedule`` splits a rollout's samples into steps, packs each step into micro-batches and distributes them
over data-parallel ranks; ``schedule_stats`` measures the result. Contract invariants: :mod:`.dp_schedule`.
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
