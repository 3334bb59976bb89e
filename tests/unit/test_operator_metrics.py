"""The operator's per-run series (kube-state-metrics style) and the runs-by-phase gauge, from `PhaseTracker`."""

from __future__ import annotations

from trainingrun.api.models import PHASES
from trainingrun.operator import metrics


def series(run: str, ns: str = "ns1") -> dict[tuple[str, tuple], float]:
    """{(sample name, labels other than namespace/run): value} of one run in the operator's registry."""
    out = {}
    for fam in metrics.REGISTRY.collect():
        for s in fam.samples:
            if s.labels.get("run") == run and s.labels.get("namespace") == ns:
                rest = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("namespace", "run")))
                out[(s.name, rest)] = s.value
    return out


def phase_values(run: str, ns: str = "ns1") -> dict[str, float]:
    return {dict(labels)["phase"]: v for (name, labels), v in series(run, ns).items()
            if name == "trainingrun_operator_run_phase"}


def runs_by_phase() -> dict[str, float]:
    return {s.labels["phase"]: s.value for fam in metrics.REGISTRY.collect() for s in fam.samples
            if s.name == "trainingrun_operator_runs"}


def test_one_series_per_phase_with_the_current_one_set_and_removed_with_the_run():
    t = metrics.PhaseTracker()
    t.set("u1", "Pending", namespace="ns1", name="r1", restarts=0, step=0)
    assert phase_values("r1") == {p: float(p == "Pending") for p in PHASES}
    t.set("u1", "Running", restarts=2, step=17)  # namespace/name remembered from the first call
    assert phase_values("r1") == {p: float(p == "Running") for p in PHASES}
    assert series("r1")[("trainingrun_operator_run_restarts", ())] == 2
    assert series("r1")[("trainingrun_operator_run_step", ())] == 17
    assert ("trainingrun_operator_run_progress_percent", ()) not in series("r1")  # no status.progress yet
    t.set("u1", "Running", restarts=2, step=18, progress={"percentage": 40, "estimatedRemainingSeconds": 90})
    assert series("r1")[("trainingrun_operator_run_progress_percent", ())] == 40
    assert series("r1")[("trainingrun_operator_run_eta_seconds", ())] == 90
    t.set("u1", "Running", restarts=2, step=18, progress={"percentage": 40})  # the pace unknown again
    assert ("trainingrun_operator_run_eta_seconds", ()) not in series("r1")
    assert ("trainingrun_operator_run_engine_replicas", ()) not in series("r1")  # no engines of its own
    t.set("u1", "Running", restarts=2, step=18, engines=3)  # status.engineReplicas: the pool's size
    assert series("r1")[("trainingrun_operator_run_engine_replicas", ())] == 3
    assert runs_by_phase() == {p: float(p == "Running") for p in PHASES}  # the aggregate counts the run too
    t.set("u1", None)
    assert series("r1") == {}


def test_recreated_run_keeps_its_series_when_the_old_one_is_cleaned_up_late():
    t = metrics.PhaseTracker()
    t.set("old", "Failed", namespace="ns1", name="r2", restarts=3)
    t.set("new", "Pending", namespace="ns1", name="r2", restarts=0)  # same name, new uid
    t.set("old", None)  # the old run's daemon finishes after the new run's first reconcile
    assert phase_values("r2") == {p: float(p == "Pending") for p in PHASES}
    assert series("r2")[("trainingrun_operator_run_restarts", ())] == 0
    assert runs_by_phase()["Failed"] == 0 and runs_by_phase()["Pending"] == 1
    t.set("new", None)
    assert series("r2") == {}


def test_first_set_needs_the_runs_name():
    import pytest

    with pytest.raises(ValueError, match="namespace and name"):
        metrics.PhaseTracker().set("u3", "Pending")
