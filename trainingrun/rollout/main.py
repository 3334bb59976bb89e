"""`trainingrun rollout`: the rollout pod's program (the loop itself: `trainingrun.rollout.loop`).

Environment (`trainingrun.contract.env.ProcessEnv`, written by trainingrun/plan.py): TRAININGRUN_CONFIG,
TRAININGRUN_STORE_URL, TRAININGRUN_RUN, TRAININGRUN_ATTEMPT, TRAININGRUN_METRICS_PORT (metrics:
`trainingrun.metrics.rollout`). Exit codes: 0 done, 1 store or runtime error (an engine pool with no live engine
included: one line naming the engines and their last errors), 78 (EXIT_CONFIG_ERROR) configuration error, a
published weight version the engine refused (damaged or changed after publishing: one line naming it), or engines
that fail deterministically (every engine with the same error, or one again after each restart: one line with the
engine's own message).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from trainingrun.api import load_trainingrun
from trainingrun.cliargs import positive_seconds
from trainingrun.contract.engine import DeterministicEngineError, EngineUnavailable, WeightsRefused
from trainingrun.contract.env import CONFIG_ENV, METRICS_PORT_ENV, STORE_URL_ENV, ProcessEnv
from trainingrun.contract.errors import EXIT_CONFIG_ERROR, ConfigError, StoreError
from trainingrun.rollout.loop import RolloutLoop, RolloutResult, run_rollout
from trainingrun.store import exit_status, open_store

__all__ = ["RolloutResult", "add_arguments", "run", "run_rollout"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help=f"TrainingRun YAML (default: ${CONFIG_ENV})")
    parser.add_argument("--store", default=None, help=f"store URL (default: ${STORE_URL_ENV})")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help=f"serve Prometheus /metrics on this port (default: ${METRICS_PORT_ENV}; 0/unset: off)")
    parser.add_argument("--max-wait", type=positive_seconds, default=None,
                        help="give up (exit 1) after waiting this many seconds for trainers to consume (default: forever)")


# ------------------------------------------------------------------------------------------------------ CLI
def run(args: argparse.Namespace) -> int:
    try:
        env = ProcessEnv.from_environ()
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    config = args.config or env.config
    store_url = args.store or env.store_url
    metrics_port = env.metrics_port if args.metrics_port is None else args.metrics_port
    if not config:
        print(f"config error: no TrainingRun given (--config or {CONFIG_ENV})", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if not store_url:
        print(f"config error: no store URL given (--store or {STORE_URL_ENV})", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        training_run = load_trainingrun(config)
        # fenced by the run's attempt; the one rollout writer of the store (a second one is refused at once)
        store = open_store(store_url, attempt=env.attempt)
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
    name = env.run or training_run.metadata.name
    metrics = None
    if metrics_port and training_run.spec.metrics.enabled:
        from trainingrun.metrics.rollout import RolloutMetrics  # deferred: prometheus_client

        metrics = RolloutMetrics(name)
        try:
            port = metrics.serve(metrics_port)
            print(f"rollout: metrics on port {port}", file=sys.stderr, flush=True)
        except OSError as exc:  # metrics must never stop the run
            print(f"rollout: warning: cannot serve metrics on port {metrics_port}: {exc}", file=sys.stderr)
    result = None
    try:
        result = RolloutLoop(training_run.spec, store, metrics=metrics, max_wait=args.max_wait).run()
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except StoreError as exc:
        print(f"store error: {exc}", file=sys.stderr)
        return exit_status(exc)
    except TimeoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except WeightsRefused as exc:  # a committed version never changes: no restart can help
        print(f"error: the engine refused a published weight version: {exc}; not restarting (a committed version "
              "is never republished)", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except DeterministicEngineError as exc:  # the engines' own error, the same everywhere: no restart can help
        print(f"error: engine: {exc}; not restarting (a restart meets the same error)", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except EngineUnavailable as exc:  # the engines: one line naming them (the failure policy restarts the group)
        print(f"error: engine: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
        if metrics is not None and result is None:  # failed: no final values worth lingering for
            metrics.close()
    print(json.dumps({"rollouts": result.rollouts, "samples": result.samples, "steps": result.steps,
                      "leftover_samples": result.leftover_samples, **result.totals}), flush=True)
    if metrics is not None:
        linger = training_run.spec.metrics.linger_seconds
        if linger and metrics.server is not None:  # a scrape after the last rollout sees the final counters
            print(f"rollout: serving final metrics for {linger}s (metrics.lingerSeconds)", file=sys.stderr, flush=True)
            time.sleep(linger)
        metrics.close()
    return 0
