"""A real Prometheus scraping two real trainer exporters whose ranks hold different sample counts returns the global
per-sample mean through the contract's PromQL (sum of X_sum over sum of X_count)."""

from __future__ import annotations

import pytest

from tests.services import free_port, prometheus_server, wait_for
from trainingrun.metrics.exporter import TrainerExporter

METRIC = "trainingrun_trainer_sample_loss"


def test_prometheus_returns_global_mean_from_sum_count_pairs() -> None:
    rank_values = {0: [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], 1: [20.0, 40.0]}  # 7 and 2 samples
    exporters = []
    try:
        for rank, values in rank_values.items():
            e = TrainerExporter("prom-test", rank)
            e.serve(free_port(), addr="127.0.0.1")
            e.add_weighted({METRIC: (sum(values), len(values))})
            e.set_gauges({"trainingrun_trainer_loss": 0.25})
            exporters.append(e)
        targets = [f"127.0.0.1:{e.port}" for e in exporters]
        flat = [v for vs in rank_values.values() for v in vs]
        with prometheus_server(targets) as prom:
            # both targets scraped (each target's first sample appears on its own schedule)
            wait_for(lambda: len(prom.query(f"{METRIC}_sum")) == 2 and len(prom.query(f"{METRIC}_count")) == 2,
                     40, "both exporters scraped", interval=0.5)
            res = prom.query(f"sum({METRIC}_sum) / sum({METRIC}_count)")
            assert float(res[0]["value"][1]) == pytest.approx(sum(flat) / len(flat))  # 88/9, not (4+30)/2
            per_rank = prom.query(f"{METRIC}_count")
            assert sorted((r["metric"]["rank"], float(r["value"][1])) for r in per_rank) == [("0", 7.0), ("1", 2.0)]
            assert all(r["metric"]["run"] == "prom-test" for r in per_rank)
            gauges = prom.wait_query("trainingrun_trainer_loss", timeout=10)
            assert [g["metric"]["rank"] for g in gauges] == ["0"]  # reduced gauges: rank 0 only
    finally:
        for e in exporters:
            e.close()
