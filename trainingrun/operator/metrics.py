"""Operator metrics (names in `trainingrun.metrics.names.OPERATOR`), served by prometheus-client on their own port.

Two kinds:
  - operator-wide: reconcile latency, errors, runs by phase (`trainingrun_operator_runs{phase}`) and the restart
    counter — no run label;
  - per run, kube-state-metrics style, labels `namespace` (the run's namespace) and `run` (its name):
    `trainingrun_operator_run_phase{phase}` (1 for the current phase, 0 for every other phase),
    `trainingrun_operator_run_restarts` (status.restarts), `trainingrun_operator_run_step` (status.step, 0 before the
    trainers report progress), `trainingrun_operator_run_progress_percent` and `trainingrun_operator_run_eta_seconds`
    (status.progress.percentage and .estimatedRemainingSeconds, absent while unset),
    `trainingrun_operator_run_engine_replicas` (status.engineReplicas: the engine pool's size). A run's series are removed when the run goes away, so nothing stale is exported.
    Because the run's namespace is a label of the exposition, scrape the operator with `honor_labels: true` (the
    chart's ServiceMonitor does), else Prometheus renames it to `exported_namespace`.
"""

from __future__ import annotations

from dataclasses import dataclass

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
RUN_PHASE = Gauge("trainingrun_operator_run_phase", _help("trainingrun_operator_run_phase"),
                  ["namespace", "run", "phase"], registry=REGISTRY)
RUN_RESTARTS = Gauge("trainingrun_operator_run_restarts", _help("trainingrun_operator_run_restarts"),
                     ["namespace", "run"], registry=REGISTRY)
RUN_STEP = Gauge("trainingrun_operator_run_step", _help("trainingrun_operator_run_step"), ["namespace", "run"],
                 registry=REGISTRY)
RUN_PROGRESS = Gauge("trainingrun_operator_run_progress_percent", _help("trainingrun_operator_run_progress_percent"),
                     ["namespace", "run"], registry=REGISTRY)
RUN_ETA = Gauge("trainingrun_operator_run_eta_seconds", _help("trainingrun_operator_run_eta_seconds"),
                ["namespace", "run"], registry=REGISTRY)
RUN_ENGINES = Gauge("trainingrun_operator_run_engine_replicas", _help("trainingrun_operator_run_engine_replicas"),
                    ["namespace", "run"], registry=REGISTRY)
# per-run gauges that are absent while their status field is unset: (gauge, RunObs attribute)
_OPTIONAL = ((RUN_STEP, "step"), (RUN_PROGRESS, "progress"), (RUN_ETA, "eta"), (RUN_ENGINES, "engines"))

for _phase in PHASES:
    RUNS.labels(phase=_phase).set(0)


@dataclass
class RunObs:
    """What the per-run series of one run show."""

    namespace: str
    name: str
    phase: str
    restarts: int = 0
    step: int | None = None
    progress: int | None = None  # status.progress.percentage
    eta: int | None = None  # status.progress.estimatedRemainingSeconds
    engines: int | None = None  # status.engineReplicas


class PhaseTracker:
    """Every run this operator reconciles, keyed by uid: the runs-by-phase gauge and the per-run series."""

    def __init__(self) -> None:
        self.runs: dict[str, RunObs] = {}
        # (namespace, name) -> uid whose values the per-run series show. A re-created run has a new uid and the same
        # labels; the old run's late cleanup must not remove the new run's series.
        self.owner: dict[tuple[str, str], str] = {}

    def set(self, uid: str, phase: str | None, *, namespace: str | None = None, name: str | None = None,
            restarts: int | None = None, step: int | None = None, progress: dict | None = None,
            engines: int | None = None) -> None:
        """Record the run's phase (None: the run is gone or unknown — its series are removed)."""
        if phase is None:
            self._forget(uid)
        else:
            old = self.runs.get(uid)
            ns = namespace if namespace is not None else (old.namespace if old else None)
            nm = name if name is not None else (old.name if old else None)
            if ns is None or nm is None:
                raise ValueError(f"run {uid}: namespace and name are needed the first time its phase is set")
            progress = progress or {}
            obs = RunObs(ns, nm, phase, int(restarts or 0), None if step is None else int(step),
                         _int_or_none(progress.get("percentage")), _int_or_none(progress.get("estimatedRemainingSeconds")),
                         _int_or_none(engines))
            self.runs[uid] = obs
            self.owner[(ns, nm)] = uid
            self._export(obs)
        counts = {p: 0 for p in PHASES}
        for obs in self.runs.values():
            counts[obs.phase] = counts.get(obs.phase, 0) + 1
        for p, n in counts.items():
            RUNS.labels(phase=p).set(n)

    def _export(self, obs: RunObs) -> None:
        phases = PHASES if obs.phase in PHASES else (*PHASES, obs.phase)
        for p in phases:
            RUN_PHASE.labels(namespace=obs.namespace, run=obs.name, phase=p).set(1 if p == obs.phase else 0)
        RUN_RESTARTS.labels(namespace=obs.namespace, run=obs.name).set(obs.restarts)
        for gauge, attr in _OPTIONAL:
            value = getattr(obs, attr)
            if value is None:
                _remove(gauge, obs.namespace, obs.name)
            else:
                gauge.labels(namespace=obs.namespace, run=obs.name).set(value)

    def _forget(self, uid: str) -> None:
        obs = self.runs.pop(uid, None)
        if obs is None or self.owner.get((obs.namespace, obs.name)) != uid:
            return
        del self.owner[(obs.namespace, obs.name)]
        phases = PHASES if obs.phase in PHASES else (*PHASES, obs.phase)
        for p in phases:
            _remove(RUN_PHASE, obs.namespace, obs.name, p)
        _remove(RUN_RESTARTS, obs.namespace, obs.name)
        for gauge, _ in _OPTIONAL:
            _remove(gauge, obs.namespace, obs.name)


def _int_or_none(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]


def _remove(metric: Gauge, *labels: str) -> None:
    metric.remove(*labels)  # a labelset never exported is ignored
