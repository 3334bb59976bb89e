"""(sum, count) reduction and the exporter's exposition, with known values."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trainingrun.metrics.exporter import TrainerExporter
from trainingrun.metrics.names import TRAINER_GAUGES, TRAINER_WEIGHTED
from trainingrun.metrics.reduce import Weighted, WeightedSet, pairs_to_set, reduce_sets


def test_ranks_with_different_counts_reduce_to_the_global_per_sample_mean() -> None:
    per_rank = [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [10.0], [7.0, 9.0]]  # 6, 1 and 2 samples
    sets = [WeightedSet.from_values({"loss": v}) for v in per_rank]
    reduced = reduce_sets(sets)
    flat = [x for v in per_rank for x in v]
    assert reduced.means()["loss"] == pytest.approx(sum(flat) / len(flat))  # 47/9
    mean_of_means = sum(sum(v) / len(v) for v in per_rank) / 3
    assert reduced.means()["loss"] != pytest.approx(mean_of_means)  # the naive average is wrong here


@given(st.lists(st.lists(st.floats(-1e3, 1e3), max_size=20), min_size=1, max_size=8))
def test_reduction_equals_flat_mean(per_rank: list[list[float]]) -> None:
    reduced = reduce_sets(WeightedSet.from_values({"x": v}) for v in per_rank)
    flat = [x for v in per_rank for x in v]
    assert reduced.pairs["x"].count == len(flat)
    assert reduced.means()["x"] == pytest.approx(sum(flat) / len(flat) if flat else 0.0, abs=1e-9)


def test_weighted_and_pairs() -> None:
    w = Weighted()
    assert w.mean == 0.0
    w.observe(2.0)
    w.add(10.0, 3)
    assert (w.sum, w.count, w.mean) == (12.0, 4.0, 3.0)
    s = pairs_to_set(["a", "b"], [[6.0, 2.0], [0.0, 0.0]])
    assert s.means() == {"a": 3.0, "b": 0.0}


def _families(exporter: TrainerExporter) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(generate_latest(exporter.registry).decode()):
        for sample in fam.samples:
            out.setdefault(sample.name, {})[sample.labels.get("rank", "")] = sample.value
    return out


def test_exporter_exposes_sum_count_pairs_and_rank0_gauges() -> None:
    e0, e1 = TrainerExporter("r", 0), TrainerExporter("r", 1)
    e0.add_weighted({"trainingrun_trainer_sample_loss": (6.0, 3)})
    e0.add_weighted({"trainingrun_trainer_sample_loss": (4.0, 1)})
    e1.add_weighted({"trainingrun_trainer_sample_loss": (20.0, 2)})
    e0.set_gauges({"trainingrun_trainer_loss": 1.5})
    e1.set_gauges({"trainingrun_trainer_loss": 9.0})  # ignored: only rank 0 exports gauges
    e0.inc("trainingrun_trainer_rank_tokens", 100)
    f0, f1 = _families(e0), _families(e1)
    assert f0["trainingrun_trainer_sample_loss_sum"]["0"] == 10.0
    assert f0["trainingrun_trainer_sample_loss_count"]["0"] == 4.0
    total = f0["trainingrun_trainer_sample_loss_sum"]["0"] + f1["trainingrun_trainer_sample_loss_sum"]["1"]
    count = f0["trainingrun_trainer_sample_loss_count"]["0"] + f1["trainingrun_trainer_sample_loss_count"]["1"]
    assert total / count == pytest.approx(30.0 / 6)
    assert f0["trainingrun_trainer_loss"]["0"] == 1.5
    assert "trainingrun_trainer_loss" not in f1
    assert f0["trainingrun_trainer_rank_tokens_total"]["0"] == 100
    for name in TRAINER_WEIGHTED:
        assert f"{name}_sum" in f1 and f"{name}_count" in f1
    assert set(TRAINER_GAUGES) <= set(f0)
    assert all(name.startswith("trainingrun_") for name in f0)
    with pytest.raises(KeyError, match="not a weighted trainer metric"):
        e0.add_weighted({"trainingrun_nope": (1.0, 1)})
