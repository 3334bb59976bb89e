"""The run plan shared by the operator and the local launcher: roles, ranks, contract environment, ports."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainingrun.api import load_trainingrun, parse_trainingrun
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


@pytest.mark.parametrize("gpus", [0, 1, 2, 4])
def test_trainer_ports_and_ranks_with_several_workers_per_pod(gpus):
    """Pod env stays node-level (RANK = pod index, WORLD_SIZE = pods); local ports never collide with G workers each."""
    run = load_trainingrun(TINY)
    doc = run.model_dump(by_alias=True, exclude_none=True, mode="json")
    doc["spec"]["trainer"].update(replicas=3, gpusPerReplica=gpus)
    run = parse_trainingrun(doc)
    g = max(gpus, 1)
    local = build_plan(run, store_url="file:///s", config_path="/c", master_addr="127.0.0.1", metrics_port=9000,
                       distinct_ports=True)
    pod = build_plan(run, store_url="file:///s", config_path="/c", master_addr="m", metrics_port=9000)
    assert local.world_size == pod.world_size == 3 * g and local.data_parallel_size == 3 * g
    for plan in (local, pod):
        assert [(t.env["RANK"], t.env["WORLD_SIZE"]) for t in plan.trainers] == [(str(r), "3") for r in range(3)]
        assert all(t.workers == g and len(t.metrics_ports) == g for t in plan.trainers)
        assert plan.rollout.workers == 1 and plan.rollout.metrics_ports == (9000,)
    every = [p for proc in local.processes for p in proc.metrics_ports]
    assert sorted(every) == list(range(9000, 9000 + 1 + 3 * g)), "one block of consecutive ports, no collision"
    assert [t.metrics_ports[0] for t in local.trainers] == [9001 + r * g for r in range(3)]
    assert all(t.metrics_ports == tuple(range(9000, 9000 + g)) for t in pod.trainers)
