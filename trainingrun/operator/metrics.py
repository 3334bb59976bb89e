"""Operator metrics (names in `trainingrun.metrics.names.OPERATOR`), served by prometheus-client on their own port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from trainingrun.api.models import PHASES
from trainingrun.metrics.names import OPERATOR

REGISTRY = CollectorRegistry(auto_describe=True)


def _help(name: str) -> str:
    return OPERATOR[name]


# prometheus-client appends _total to counters; the base names are the contract's.
RECONCILE_SECONDS = Histogram(
    "trainingrun_operator_reconcile_seconds", _help("trainingrun_operator_reconcile_seconds"), ["handler"],
    registry=REGISTRY, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
RUNS = Gauge("trainingrun_operator_runs", _help("trainingrun_operator_runs"), ["phase"], registry=REGISTRY)
RESTARTS = Counter("trainingrun_operator_restarts", _help("trainingrun_operator_restarts"), registry=REGISTRY)
ERRORS = Counter("trainingrun_operator_errors", _help("trainingrun_operator_errors"), ["handler"], registry=REGISTRY)

for _phase in PHASES:
    RUNS.labels(phase=_phase).set(0)


class PhaseTracker:
    """Phase of every run this operator reconciles, exported as the runs-by-phase gauge."""

    def __init__(self) -> None:
        self.phases: dict[str, str] = {}

    def set(self, uid: str, phase: str | None) -> None:
        if phase is None:
            self.phases.pop(uid, None)
        else:
            self.phases[uid] = phase
        counts = {p: 0 for p in PHASES}
        for value in self.phases.values():
            counts[value] = counts.get(value, 0) + 1
        for p, n in counts.items():
            RUNS.labels(phase=p).set(n)
