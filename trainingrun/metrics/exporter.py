"""Prometheus exporter of a trainer rank (prometheus-client, its own CollectorRegistry).

Per rank, labels {run, rank}:
  * weighted metrics (`names.TRAINER_WEIGHTED`) as a summary-typed family, i.e. exactly the two counters `X_sum` and
    `X_count` — `sum(rate(X_sum[5m])) / sum(rate(X_count[5m]))` is the mean over all samples of any set of ranks;
  * counters (`names.TRAINER_COUNTERS`), exposed with prometheus-client's `_total` suffix.
Rank 0 also exports the per-step gauges (`names.TRAINER_GAUGES`), reduced over all ranks.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import SummaryMetricFamily

from trainingrun.metrics.names import TRAINER_COUNTERS, TRAINER_GAUGES, TRAINER_WEIGHTED
from trainingrun.metrics.reduce import Weighted


class WeightedCollector:
    """Serves running (sum, count) pairs as summary families (X_sum, X_count): `names` maps each metric name to its
    help text; one label set per collector (a trainer rank's {run, rank}, the rollout's {run}); `kind` names the
    program in errors."""

    def __init__(self, names: Mapping[str, str], labels: Mapping[str, str], kind: str):
        self.names, self.kind = dict(names), kind
        self.label_names, self.labels = tuple(labels), tuple(labels.values())
        self.pairs = {name: Weighted() for name in self.names}
        self.lock = threading.Lock()

    def add(self, name: str, total: float, count: float) -> None:
        if name not in self.pairs:
            raise KeyError(f"metric name: {name!r} is not a weighted {self.kind} metric; allowed: {sorted(self.pairs)}")
        with self.lock:
            self.pairs[name].add(total, count)

    def collect(self):
        with self.lock:
            snapshot = {n: (w.sum, w.count) for n, w in self.pairs.items()}
        for name, (total, count) in snapshot.items():
            fam = SummaryMetricFamily(name, self.names[name], labels=self.label_names)
            fam.add_metric(self.labels, count_value=count, sum_value=total)
            yield fam


class TrainerExporter:
    """Metrics of one trainer rank. `serve(port)` starts /metrics; without it the values are only kept in memory."""

    def __init__(self, run: str, rank: int, *, gauges: bool | None = None):
        self.run, self.rank = run, rank
        self.registry = CollectorRegistry(auto_describe=True)
        self.weighted = WeightedCollector(TRAINER_WEIGHTED, {"run": run, "rank": str(rank)}, "trainer")
        self.registry.register(self.weighted)
        self.counters = {
            name: Counter(name.removesuffix("_total"), doc, ("run", "rank"), registry=self.registry).labels(run, str(rank))
            for name, doc in TRAINER_COUNTERS.items()
        }
        self.gauges = {}
        if gauges if gauges is not None else rank == 0:
            self.gauges = {
                name: Gauge(name, doc, ("run", "rank"), registry=self.registry).labels(run, str(rank))
                for name, doc in TRAINER_GAUGES.items()
            }
        self.server = None
        self.port: int | None = None

    def serve(self, port: int, addr: str | None = None) -> None:
        """Serve /metrics on `port`. Default address: all interfaces in a pod (Prometheus scrapes the pod IP),
        127.0.0.1 elsewhere."""
        if addr is None:
            addr = "0.0.0.0" if os.environ.get("KUBERNETES_SERVICE_HOST") else "127.0.0.1"
        self.server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = self.server.server_address[1]

    def add_weighted(self, pairs: Mapping[str, tuple[float, float]]) -> None:
        """This rank's (sum, count) for the step, per weighted metric name."""
        for name, (total, count) in pairs.items():
            self.weighted.add(name, total, count)

    def inc(self, name: str, amount: float) -> None:
        self.counters[name].inc(amount)

    def set_gauges(self, values: Mapping[str, float]) -> None:
        """Rank 0's reduced per-step values; ignored on other ranks."""
        for name, value in values.items():
            if name not in TRAINER_GAUGES:
                raise KeyError(f"metric name: {name!r} is not a trainer gauge; allowed: {sorted(TRAINER_GAUGES)}")
            if name in self.gauges:
                self.gauges[name].set(float(value))

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
