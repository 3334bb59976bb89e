"""The run plan shared by the operator and the local launcher: roles, ranks, contract environment, ports."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainingrun.api import load_trainingrun
from trainingrun.plan import build_plan

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"


@pytest.mark.parametrize("distinct", [False, True])
def test_plan_processes_and_contract_env(distinct):
    run = load_trainingrun(TINY)
    plan = build_plan(run, store_url="file:///tmp/s", config_path="/c/run.yaml", master_addr="10.0.0.1",
                      master_port=1234, attempt=2, metrics_port=9000, distinct_ports=distinct,
                      extra_env={"X": "y"})
    n = run.spec.trainer.replicas
    assert [p.name for p in plan.processes] == ["rollout", *(f"trainer-{r}" for r in range(n))]
    assert plan.rollout.args == ("rollout",) and all(t.args == ("trainer",) for t in plan.trainers)
    for p in plan.processes:
        assert p.env["TRAININGRUN_RUN"] == "tiny" and p.env["TRAININGRUN_STORE_URL"] == "file:///tmp/s"
        assert p.env["TRAININGRUN_CONFIG"] == "/c/run.yaml" and p.env["TRAININGRUN_ATTEMPT"] == "2"
        assert p.env["X"] == "y" and p.env["TRAININGRUN_METRICS_PORT"] == str(p.metrics_port)
    assert "RANK" not in plan.rollout.env
    for r, t in enumerate(plan.trainers):
        assert (t.env["RANK"], t.env["WORLD_SIZE"]) == (str(r), str(n))
        assert (t.env["MASTER_ADDR"], t.env["MASTER_PORT"]) == ("10.0.0.1", "1234")
    ports = [p.metrics_port for p in plan.processes]
    assert ports == (list(range(9000, 9000 + n + 1)) if distinct else [9000] * (n + 1))
    assert plan.world_size == plan.data_parallel_size == n
