"""Prometheus metrics of the rollout process (prometheus-client, its own CollectorRegistry).

The `trainingrun_rollout_*` families (names and help: `names.ROLLOUT`, `names.ROLLOUT_WEIGHTED`), label `run` on
every one: what the source produced and the filters dropped, generated rollouts' rewards, tokens and waits, groups
aborted and each engine's last weight-sync seconds, prefix-cache queries and hits, requests in flight and in-flight
limit (label engine), multi-turn episodes (weighted (sum, count) pairs: turns and tool calls per episode, tool error
rate, ...; failures by reason; agents: failures by reason, the gateway's request latency and its refused keys), what
was published, the schedule's imbalance and the publish latency, the rollouts pending; and the `trainingrun_eval_*`
families of the evaluations on held-out prompts (`names.EVAL`: the last evaluation's gauges, evaluations and failed
rewards counted). Served on `TRAININGRUN_METRICS_PORT` by `trainingrun rollout` (`trainingrun.rollout.main`); the
trainer's counterpart is `exporter.TrainerExporter`.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, start_http_server

from trainingrun.metrics.exporter import WeightedCollector
from trainingrun.metrics.names import EVAL, ROLLOUT, ROLLOUT_WEIGHTED


class RolloutMetrics:
    """The `trainingrun_rollout_*` metrics (names: trainingrun.metrics.names.ROLLOUT) in their own registry."""

    def __init__(self, run: str):
        self.registry = CollectorRegistry()
        labels = ["run"]
        helps = {**ROLLOUT, **EVAL}
        mk = lambda cls, name, extra=(), **kw: cls(name, helps[name], labels + list(extra),  # noqa: E731
                                                   registry=self.registry, **kw)
        self.run = run
        self.produced = mk(Counter, "trainingrun_rollout_samples_produced").labels(run)
        self._filtered = mk(Counter, "trainingrun_rollout_samples_filtered", ["filter"])
        self.filtered = {f: self._filtered.labels(run, f) for f in ("max_length", "zero_variance", "stale")}
        self.groups = mk(Counter, "trainingrun_rollout_groups", ["state"])
        # generated rollouts
        self.reward = mk(Summary, "trainingrun_rollout_reward").labels(run)
        self._failures = mk(Counter, "trainingrun_rollout_reward_failures", ["reason"])
        self.generated_tokens = mk(Counter, "trainingrun_rollout_generated_tokens").labels(run)
        self.generate_seconds = mk(Counter, "trainingrun_rollout_generate_seconds").labels(run)
        self.weight_wait_seconds = mk(Counter, "trainingrun_rollout_weight_wait_seconds").labels(run)
        self.weight_version = mk(Gauge, "trainingrun_rollout_weight_version").labels(run)
        self.engine_sync_seconds = mk(Gauge, "trainingrun_rollout_engine_weight_sync_seconds", ["engine"])
        self.prefix_queries = mk(Counter, "trainingrun_rollout_engine_prefix_cache_queries", ["engine"])
        self.prefix_hits = mk(Counter, "trainingrun_rollout_engine_prefix_cache_hits", ["engine"])
        self.engine_inflight = mk(Gauge, "trainingrun_rollout_engine_inflight", ["engine"])
        self.engine_concurrency = mk(Gauge, "trainingrun_rollout_engine_concurrency", ["engine"])
        # multi-turn episodes: weighted (sum, count) pairs (names.ROLLOUT_WEIGHTED) and failures by reason
        self.episodes = WeightedCollector(ROLLOUT_WEIGHTED, {"run": run}, "rollout")
        self.registry.register(self.episodes)
        self.truncated_episodes = mk(Counter, "trainingrun_rollout_truncated_episodes").labels(run)
        self._env_failures = mk(Counter, "trainingrun_rollout_environment_failures", ["reason"])
        # agents through the gateway: failures by reason, request latency, requests with a wrong key
        self._agent_failures = mk(Counter, "trainingrun_rollout_agent_failures", ["reason"])
        self.gateway_seconds = mk(
            Histogram, "trainingrun_rollout_gateway_request_seconds",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        ).labels(run)
        self.gateway_unauthorized = mk(Counter, "trainingrun_rollout_gateway_unauthorized").labels(run)
        self.published = mk(Counter, "trainingrun_rollout_samples_published").labels(run)
        self.rollouts = mk(Counter, "trainingrun_rollout_rollouts_published").labels(run)
        self.imbalance = mk(Gauge, "trainingrun_rollout_schedule_imbalance").labels(run)
        self.publish_seconds = mk(
            Histogram, "trainingrun_rollout_publish_seconds",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        ).labels(run)
        self.pending = mk(Gauge, "trainingrun_rollout_pending").labels(run)
        # evaluations (rollout.eval): the last one's figures
        self.eval_gauges = {name: mk(Gauge, f"trainingrun_eval_{name}").labels(run)
                            for name in ("reward_mean", "pass_at_1", "pass_at_k", "response_length_mean",
                                         "weight_version", "step", "seconds")}
        self.evaluations = mk(Counter, "trainingrun_eval_evaluations").labels(run)
        self._eval_failures = mk(Counter, "trainingrun_eval_reward_failures", ["reason"])
        self.server = None

    def observe_generation(self, gen, rewards) -> None:
        """One generated source rollout (`rollout.generate.GenerateStats`) and its rewards."""
        for r in rewards:
            self.reward.observe(float(r))
        for reason, n in gen.reward_failed.items():
            self._failures.labels(self.run, reason).inc(n)
        self.generated_tokens.inc(gen.generated_tokens)
        self.generate_seconds.inc(gen.generate_seconds)
        self.weight_wait_seconds.inc(gen.wait_seconds)
        self.weight_version.set(gen.weight_version)
        for engine, seconds in gen.sync_seconds.items():
            self.engine_sync_seconds.labels(self.run, engine).set(seconds)
        for engine, c in gen.engines.items():  # `contract.engine.EngineCounts`: this rollout's share
            self.prefix_queries.labels(self.run, engine).inc(max(c.prefix_queries, 0.0))
            self.prefix_hits.labels(self.run, engine).inc(max(c.prefix_hits, 0.0))
            self.engine_inflight.labels(self.run, engine).set(c.inflight)
            self.engine_concurrency.labels(self.run, engine).set(c.concurrency)
        if gen.groups_aborted:
            self.groups.labels(self.run, "aborted").inc(gen.groups_aborted)
        if gen.episodes is not None:
            self.observe_episodes(gen.episodes)
        for seconds in gen.gateway_latencies:
            self.gateway_seconds.observe(seconds)

    def observe_episodes(self, ep) -> None:
        """A source rollout's episodes (`contract.published.EpisodeCounts`): its (sum, count) pairs and failures."""
        for name, (total, count) in ep.pairs().items():
            metric = f"trainingrun_rollout_{name}"
            if metric in ROLLOUT_WEIGHTED:
                self.episodes.add(metric, total, count)
        self.truncated_episodes.inc(ep.truncated)
        failures = self._agent_failures if ep.agent else self._env_failures
        for reason, n in ep.failures.items():
            failures.labels(self.run, reason).inc(n)
        self.gateway_unauthorized.inc(ep.unauthorized)

    def observe_eval(self, rec) -> None:
        """One evaluation (`contract.evaluation.EvalRecord`)."""
        for name, gauge in self.eval_gauges.items():
            gauge.set(getattr(rec, name))
        self.evaluations.inc()

    def observe_eval_failures(self, counts: dict[str, int]) -> None:
        for reason, n in counts.items():
            self._eval_failures.labels(self.run, reason).inc(n)

    def serve(self, port: int, addr: str | None = None) -> int:
        if addr is None:  # a pod is scraped on its IP; elsewhere stay on loopback
            addr = "0.0.0.0" if os.environ.get("KUBERNETES_SERVICE_HOST") else "127.0.0.1"
        self.server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return self.server.server_address[1]

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
