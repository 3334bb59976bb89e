"""`trainingrun rollout`: the rollout pod's program (the loop itself: `trainingrun.rollout.loop`).

Environment (trainingrun/plan.py): TRAININGRUN_CONFIG, TRAININGRUN_STORE_URL, TRAININGRUN_RUN,
TRAININGRUN_METRICS_PORT. Exit codes: 0 done, 1 store or runtime error, 78 (EXIT_CONFIG_ERROR) configuration error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from trainingrun.cliargs import positive_seconds
from trainingrun.plan import EXIT_CONFIG_ERROR
from trainingrun.rollout.loop import STATE_KEY, RolloutLoop, RolloutResult, data_report, run_rollout
from trainingrun.rollout.sources import ConfigError
from trainingrun.store.base import StoreError

__all__ = ["STATE_KEY", "RolloutMetrics", "RolloutResult", "add_arguments", "data_report", "run", "run_rollout"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=os.environ.get("TRAININGRUN_CONFIG"),
                        help="TrainingRun YAML (default: $TRAININGRUN_CONFIG)")
    parser.add_argument("--store", default=os.environ.get("TRAININGRUN_STORE_URL"),
                        help="store URL (default: $TRAININGRUN_STORE_URL)")
    parser.add_argument("--metrics-port", type=int, default=_int_env("TRAININGRUN_METRICS_PORT"),
                        help="serve Prometheus /metrics on this port (default: $TRAININGRUN_METRICS_PORT; 0/unset: off)")
    parser.add_argument("--max-wait", type=positive_seconds, default=None,
                        help="give up (exit 1) after waiting this many seconds for trainers to consume (default: forever)")


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value and value.isdigit() else None


# ------------------------------------------------------------------------------------------------------ metrics
class RolloutMetrics:
    """The `trainingrun_rollout_*` metrics (names: trainingrun.metrics.names.ROLLOUT) in their own registry."""

    def __init__(self, run: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary

        from trainingrun.metrics.names import ROLLOUT

        self.registry = CollectorRegistry()
        labels = ["run"]
        mk = lambda cls, name, extra=(), **kw: cls(name, ROLLOUT[name], labels + list(extra), registry=self.registry, **kw)  # noqa: E731
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
        self.published = mk(Counter, "trainingrun_rollout_samples_published").labels(run)
        self.rollouts = mk(Counter, "trainingrun_rollout_rollouts_published").labels(run)
        self.imbalance = mk(Gauge, "trainingrun_rollout_schedule_imbalance").labels(run)
        self.publish_seconds = mk(
            Histogram, "trainingrun_rollout_publish_seconds",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        ).labels(run)
        self.pending = mk(Gauge, "trainingrun_rollout_pending").labels(run)
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

    def serve(self, port: int, addr: str | None = None) -> int:
        from prometheus_client import start_http_server

        if addr is None:  # a pod is scraped on its IP; elsewhere stay on loopback
            addr = "0.0.0.0" if os.environ.get("KUBERNETES_SERVICE_HOST") else "127.0.0.1"
        self.server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return self.server.server_address[1]

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


# ------------------------------------------------------------------------------------------------------ CLI
def run(args: argparse.Namespace) -> int:
    from trainingrun.api import load_trainingrun
    from trainingrun.store import attempt_from_env, exit_status, open_store

    if not args.config:
        print("config error: no TrainingRun given (--config or TRAININGRUN_CONFIG)", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if not args.store:
        print("config error: no store URL given (--store or TRAININGRUN_STORE_URL)", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        the_run = load_trainingrun(args.config)
        # fenced by the run's attempt; the one rollout writer of the store (a second one is refused at once)
        store = open_store(args.store, attempt=attempt_from_env())
        try:
            store.claim_writer()
        except StoreError:
            store.close()
            raise
    except (ValueError, ConfigError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except StoreError as exc:
        print(f"store error: {exc}", file=sys.stderr)
        return exit_status(exc)
    name = os.environ.get("TRAININGRUN_RUN") or the_run.metadata.name
    metrics = None
    if args.metrics_port and the_run.spec.metrics.enabled:
        metrics = RolloutMetrics(name)
        try:
            port = metrics.serve(args.metrics_port)
            print(f"rollout: metrics on port {port}", file=sys.stderr, flush=True)
        except OSError as exc:  # metrics must never stop the run
            print(f"rollout: warning: cannot serve metrics on port {args.metrics_port}: {exc}", file=sys.stderr)
    result = None
    try:
        result = RolloutLoop(the_run.spec, store, metrics=metrics, max_wait=args.max_wait).run()
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except StoreError as exc:
        print(f"store error: {exc}", file=sys.stderr)
        return exit_status(exc)
    except TimeoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
        if metrics is not None and result is None:  # failed: no final values worth lingering for
            metrics.close()
    print(json.dumps({"rollouts": result.rollouts, "samples": result.samples, "steps": result.steps,
                      "leftover_samples": result.leftover_samples, **result.totals}), flush=True)
    if metrics is not None:
        linger = the_run.spec.metrics.linger_seconds
        if linger and metrics.server is not None:  # a scrape after the last rollout sees the final counters
            print(f"rollout: serving final metrics for {linger}s (metrics.lingerSeconds)", file=sys.stderr, flush=True)
            time.sleep(linger)
        metrics.close()
    return 0
