"""`trainingrun rollout`: the rollout pod's program, and `run_rollout()` for in-process use.

Flow for each rollout k (see docs/store.md):
  source rollout i → filters (max length, zero reward variance) → advantages → prepend the groups carried over →
  split into steps (fixed: globalBatchSize groups each; dynamic: one step) → `build_dp_schedule` → per-rank
  payloads → wait while `pending_rollouts() >= maxPendingRollouts` → publish (payloads, schedule, commit) → save
  the resume state (key "rollout_state": next k, next source index, carried groups, offsets, totals).
A source rollout whose groups do not fill a step publishes nothing: its groups are carried and the next source
rollout is drawn, so every published rollout has at least one step and k counts published rollouts (numRollouts of
them; a jsonl source may end earlier). At the end, `finish(k)`; groups still carried are reported, never silently
dropped. A restarted rollout reads its state and continues; the rollout it was publishing when it died is rebuilt
from the same state, bit for bit (synthetic data depends only on seed and source index), and re-publishing a
committed rollout is a no-op.

Environment (trainingrun/plan.py): TRAININGRUN_CONFIG, TRAININGRUN_STORE_URL, TRAININGRUN_RUN,
TRAININGRUN_METRICS_PORT. Exit codes: 0 done, 1 store or runtime error, 78 (EXIT_CONFIG_ERROR) configuration error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainingrun.api.models import TrainingRun, TrainingRunSpec
from trainingrun.plan import EXIT_CONFIG_ERROR
from trainingrun.rollout.pipeline import apply_filters, build_rollout, compute_advantages, split_into_steps
from trainingrun.rollout.sources import (
    ConfigError,
    Group,
    SyntheticConfig,
    load_jsonl,
    synthetic_rollout,
)
from trainingrun.store.base import Store, StoreError

STATE_KEY = "rollout_state"
STATE_VERSION = 1
MAX_EMPTY_SOURCE_ROLLOUTS = 100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=os.environ.get("TRAININGRUN_CONFIG"),
                        help="TrainingRun YAML (default: $TRAININGRUN_CONFIG)")
    parser.add_argument("--store", default=os.environ.get("TRAININGRUN_STORE_URL"),
                        help="store URL (default: $TRAININGRUN_STORE_URL)")
    parser.add_argument("--metrics-port", type=int, default=_int_env("TRAININGRUN_METRICS_PORT"),
                        help="serve Prometheus /metrics on this port (default: $TRAININGRUN_METRICS_PORT; 0/unset: off)")
    parser.add_argument("--max-wait", type=float, default=None,
                        help="give up (exit 1) after waiting this many seconds for trainers to consume (default: forever)")


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value and value.isdigit() else None


# ------------------------------------------------------------------------------------------------------ metrics
class RolloutMetrics:
    """The `trainingrun_rollout_*` metrics (names: trainingrun.metrics.names.ROLLOUT) in their own registry."""

    def __init__(self, run: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        from trainingrun.metrics.names import ROLLOUT

        self.registry = CollectorRegistry()
        labels = ["run"]
        mk = lambda cls, name, extra=(), **kw: cls(name, ROLLOUT[name], labels + list(extra), registry=self.registry, **kw)  # noqa: E731
        self.produced = mk(Counter, "trainingrun_rollout_samples_produced").labels(run)
        self._filtered = mk(Counter, "trainingrun_rollout_samples_filtered", ["filter"])
        self.filtered = {f: self._filtered.labels(run, f) for f in ("max_length", "zero_variance")}
        self.published = mk(Counter, "trainingrun_rollout_samples_published").labels(run)
        self.rollouts = mk(Counter, "trainingrun_rollout_rollouts_published").labels(run)
        self.imbalance = mk(Gauge, "trainingrun_rollout_schedule_imbalance").labels(run)
        self.publish_seconds = mk(
            Histogram, "trainingrun_rollout_publish_seconds",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        ).labels(run)
        self.pending = mk(Gauge, "trainingrun_rollout_pending").labels(run)
        self.server = None

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


# ------------------------------------------------------------------------------------------------------ state
@dataclass
class RolloutState:
    """What a restarted rollout needs to continue exactly where it was (stored as JSON under STATE_KEY)."""

    fingerprint: str
    next_rollout: int = 0  # index of the next rollout to publish
    source_index: int = 0  # next source rollout to draw
    step_offset: int = 0  # optimizer steps published so far
    samples_offset: int = 0  # samples published so far
    carried: list[Group] = field(default_factory=list)  # filtered groups waiting for a step
    empty_streak: int = 0  # consecutive source rollouts that published nothing
    totals: dict[str, int] = field(default_factory=lambda: {"produced": 0, "max_length": 0, "zero_variance": 0})
    finished: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION, "fingerprint": self.fingerprint, "next_rollout": self.next_rollout,
            "source_index": self.source_index, "step_offset": self.step_offset,
            "samples_offset": self.samples_offset, "carried": [g.to_json() for g in self.carried],
            "empty_streak": self.empty_streak, "totals": dict(self.totals), "finished": self.finished,
            "updated_at": time.time(),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RolloutState:
        if d.get("version") != STATE_VERSION:
            raise StoreError(f"{STATE_KEY}: unknown state version {d.get('version')!r} (expected {STATE_VERSION})")
        return cls(
            fingerprint=d["fingerprint"], next_rollout=int(d["next_rollout"]), source_index=int(d["source_index"]),
            step_offset=int(d["step_offset"]), samples_offset=int(d["samples_offset"]),
            carried=[Group.from_json(g) for g in d["carried"]], empty_streak=int(d.get("empty_streak", 0)),
            totals={k: int(v) for k, v in d["totals"].items()}, finished=bool(d["finished"]),
        )


def config_fingerprint(spec: TrainingRunSpec, dp_size: int) -> str:
    """Hash of everything that decides the published data (not numRollouts/maxPendingRollouts, which may change)."""
    rollout = spec.rollout.to_dict()
    for volatile in ("numRollouts", "maxPendingRollouts", "resources"):
        rollout.pop(volatile, None)
    t = spec.trainer
    relevant = {
        "seed": spec.seed, "rollout": rollout, "dp_size": dp_size, "model": spec.model.resolved(),
        "trainer": [t.max_tokens_per_gpu, t.micro_batch_size, t.microbatch_multiple, t.loss_type],
    }
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------------ the loop
@dataclass
class RolloutResult:
    rollouts: int  # published
    samples: int  # published
    steps: int
    leftover_groups: int  # carried at the end, not published
    leftover_samples: int
    totals: dict[str, int]
    resumed: bool


def _check_config(spec: TrainingRunSpec, dp_size: int) -> None:
    """Settings that can never work; ConfigError naming the field."""
    r = spec.rollout
    if r.filters.zero_variance and r.group_size < 2:
        raise ConfigError(
            "rollout.filters.zeroVariance: with groupSize 1 every group has zero reward variance and would be "
            "dropped; set groupSize >= 2 or zeroVariance: false"
        )
    if r.steps.policy == "fixed" and r.steps.global_batch_size * r.group_size < dp_size and r.source.type == "synthetic":
        raise ConfigError(
            f"rollout.steps.globalBatchSize: {r.steps.global_batch_size} groups of {r.group_size} samples per step "
            f"are fewer than the {dp_size} data-parallel ranks (each rank needs a sample per step)"
        )
    if r.source.type == "synthetic":
        vocab = r.source.synthetic.vocab_size
        model_vocab = int(spec.model.resolved()["vocab_size"])
        if vocab is not None and vocab > model_vocab:
            raise ConfigError(
                f"rollout.source.synthetic.vocabSize: {vocab} exceeds model vocabSize {model_vocab}"
            )


def run_rollout(
    run: TrainingRun | TrainingRunSpec,
    store: Store,
    *,
    dp_size: int | None = None,
    metrics: RolloutMetrics | None = None,
    progress: Callable[[str], None] | None = None,
    max_wait: float | None = None,
    poll_interval: float = 0.1,
) -> RolloutResult:
    """Produce, filter, schedule and publish every rollout of `run` into `store`; resumes from the stored state.

    Raises ConfigError for configuration/input errors, StoreError for store errors, TimeoutError when trainers
    consumed nothing for `max_wait` seconds.
    """
    spec = run.spec if isinstance(run, TrainingRun) else run
    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    r = spec.rollout
    dp = spec.trainer.data_parallel_size if dp_size is None else dp_size
    _check_config(spec, dp)
    model = spec.model.resolved()
    seq_length = int(model["seq_length"])
    max_length = min(r.filters.max_length or seq_length, seq_length)
    groups_per_rollout = r.samples_per_rollout // r.group_size
    t = spec.trainer

    # ---- source
    jsonl = None
    if r.source.type == "jsonl":
        assert r.source.jsonl is not None
        jsonl = load_jsonl(r.source.jsonl.path, vocab_size=int(model["vocab_size"]))
        say(f"rollout: {jsonl.path}: {jsonl.num_samples} samples in {len(jsonl.groups)} groups")
        synth = None
    else:
        s = r.source.synthetic
        synth = SyntheticConfig(
            task=s.task, min_length=s.min_length, max_length=s.max_length,
            vocab_size=s.vocab_size or int(model["vocab_size"]), group_size=r.group_size,
            groups_per_rollout=groups_per_rollout, seed=spec.seed,
        )

    def draw(i: int) -> list[Group] | None:
        if synth is not None:
            return synthetic_rollout(synth, i)
        start = i * groups_per_rollout
        if start >= len(jsonl.groups):
            return None
        # copies: filters/advantages must not change the loaded data (a rebuilt rollout must be identical)
        return [Group(g.group_id, g.tokens, g.loss_masks, g.rewards.copy(), g.sample_ids,
                      None if g.advantages is None else g.advantages.copy(), g.has_reward)
                for g in jsonl.groups[start : start + groups_per_rollout]]

    # ---- state
    fingerprint = config_fingerprint(spec, dp)
    stored = store.get_json(STATE_KEY)
    resumed = stored is not None
    if stored is not None:
        state = RolloutState.from_json(stored)
        if state.fingerprint != fingerprint:
            raise ConfigError(
                f"store {store.url} holds rollout state of a different configuration (fingerprint "
                f"{state.fingerprint}, this spec {fingerprint}): seed, rollout, model or trainer batching changed; "
                "use a fresh store for a changed run"
            )
        say(f"rollout: resuming at rollout {state.next_rollout} (source rollout {state.source_index}, "
            f"{sum(len(g) for g in state.carried)} carried samples)")
    else:
        state = RolloutState(fingerprint=fingerprint)

    while not state.finished and state.next_rollout < r.num_rollouts:
        k = state.next_rollout
        groups = draw(state.source_index)
        if groups is None:
            say(f"rollout: source exhausted after {state.source_index} source rollouts")
            if state.next_rollout == 0:  # a run that trains nothing must not look like a success
                raise ConfigError(
                    f"rollout.source.jsonl: the source's {state.totals['produced']} samples gave no training step "
                    f"(filtered: max_length {state.totals['max_length']}, zero_variance "
                    f"{state.totals['zero_variance']}; {sum(len(g) for g in state.carried)} kept but too few for a "
                    "step); check rollout.filters (zeroVariance drops groups whose rewards all equal, e.g. groups "
                    "of one sample) and rollout.steps"
                )
            break
        produced = sum(len(g) for g in groups)
        kept, fstats = apply_filters(groups, max_length=max_length, zero_variance=r.filters.zero_variance)
        compute_advantages(kept, t.loss_type)
        candidates = state.carried + kept
        step_groups, carry = split_into_steps(
            candidates, policy=r.steps.policy, groups_per_step=r.steps.global_batch_size, dp_size=dp,
            micro_batch_size=t.micro_batch_size, microbatch_multiple=t.microbatch_multiple,
        )
        carried_in = sum(len(g) for g in state.carried)
        new_state = RolloutState(
            fingerprint=fingerprint, next_rollout=k, source_index=state.source_index + 1,
            step_offset=state.step_offset, samples_offset=state.samples_offset, carried=carry,
            totals={"produced": state.totals["produced"] + produced,
                    "max_length": state.totals["max_length"] + fstats.max_length,
                    "zero_variance": state.totals["zero_variance"] + fstats.zero_variance},
        )
        if metrics is not None:
            metrics.produced.inc(produced)
            for name, n in fstats.as_dict().items():
                metrics.filtered[name].inc(n)
        if not step_groups:
            new_state.empty_streak = state.empty_streak + 1
            say(f"rollout: source rollout {state.source_index}: {produced} produced, filtered {fstats.as_dict()}, "
                f"{sum(len(g) for g in carry)} samples carried: not enough for a step, drawing the next one")
            if new_state.empty_streak >= MAX_EMPTY_SOURCE_ROLLOUTS:
                raise ConfigError(
                    f"rollout.filters: {MAX_EMPTY_SOURCE_ROLLOUTS} source rollouts in a row did not fill one step "
                    f"(filtered so far: {new_state.totals}); the filters drop (nearly) everything"
                )
            store.put_json(STATE_KEY, new_state.to_json())
            state = new_state
            continue
        built = build_rollout(
            k, step_groups, dp_size=dp, policy=r.steps.policy, groups_per_step=r.steps.global_batch_size,
            max_tokens_per_gpu=t.max_tokens_per_gpu, micro_batch_size=t.micro_batch_size,
            microbatch_multiple=t.microbatch_multiple, step_offset=state.step_offset,
            samples_offset=state.samples_offset,
            extra={
                "source_index": state.source_index, "produced": produced, "filtered": fstats.as_dict(),
                "carried_in": carried_in, "carried_out": sum(len(g) for g in carry), "seed": spec.seed,
            },
        )
        _wait_for_room(store, k, r.max_pending_rollouts, metrics, say, max_wait, poll_interval)
        t0 = time.perf_counter()
        fresh = store.publish_rollout(k, built.payloads, built.schedule)
        seconds = time.perf_counter() - t0
        new_state.next_rollout = k + 1
        new_state.step_offset = state.step_offset + built.num_steps
        new_state.samples_offset = state.samples_offset + built.num_samples
        store.put_json(STATE_KEY, new_state.to_json())
        state = new_state
        if metrics is not None:
            metrics.published.inc(built.num_samples)
            metrics.rollouts.inc()
            metrics.imbalance.set(built.imbalance[-1])
            metrics.publish_seconds.observe(seconds)
        say(
            f"rollout {k}{'' if fresh else ' (already committed: re-publish skipped)'}: {produced} produced, "
            f"filtered {fstats.as_dict()}, {carried_in} carried in, {built.num_samples} samples in {built.num_steps} "
            f"step(s) (global batch sizes {built.schedule['global_batch_sizes']}), "
            f"{sum(len(g) for g in carry)} carried out, imbalance {max(built.imbalance):.3f}, published in {seconds:.3f}s"
        )

    leftover_samples = sum(len(g) for g in state.carried)
    if not state.finished:
        state.finished = True
        store.put_json(STATE_KEY, state.to_json())
    store.finish(state.next_rollout)
    if leftover_samples:
        say(f"rollout: {len(state.carried)} group(s) / {leftover_samples} sample(s) left over at the end: they did not "
            "fill a step and were not published")
    say(f"rollout: finished: {state.next_rollout} rollouts, {state.step_offset} steps, {state.samples_offset} samples "
        f"published; produced {state.totals['produced']}, filtered max_length {state.totals['max_length']}, "
        f"zero_variance {state.totals['zero_variance']}")
    return RolloutResult(
        rollouts=state.next_rollout, samples=state.samples_offset, steps=state.step_offset,
        leftover_groups=len(state.carried), leftover_samples=leftover_samples, totals=dict(state.totals),
        resumed=resumed,
    )


def data_report(store: Store) -> dict[str, Any] | None:
    """What happened to the run's data so far, from the rollout's stored state (None before the first rollout):
    samples produced, dropped by each filter, published (trained), and the groups still carried — at the end of a
    run these were never published: they did not fill a step (`leftover_groups`, `leftover_samples`)."""
    stored = store.get_json(STATE_KEY)
    if stored is None:
        return None
    carried = stored.get("carried", [])
    totals = stored.get("totals", {})
    return {
        "finished": bool(stored.get("finished")),
        "rollouts_published": int(stored.get("next_rollout", 0)),
        "source_rollouts": int(stored.get("source_index", 0)),
        "steps_published": int(stored.get("step_offset", 0)),
        "samples_published": int(stored.get("samples_offset", 0)),
        "samples_produced": int(totals.get("produced", 0)),
        "samples_filtered": {"max_length": int(totals.get("max_length", 0)),
                             "zero_variance": int(totals.get("zero_variance", 0))},
        "leftover_groups": len(carried),
        "leftover_samples": sum(len(g["offsets"]) - 1 for g in carried),
    }


def _wait_for_room(store: Store, k: int, max_pending: int, metrics, say, max_wait, poll_interval) -> None:
    """Backpressure: block while `max_pending` or more published rollouts are unconsumed."""
    is_committed = getattr(store, "is_committed", None)
    if is_committed is not None and is_committed(k):
        return  # restarted after publishing k: nothing new goes into the store
    waited = False
    t0 = time.monotonic()
    while True:
        pending = store.pending_rollouts()
        if metrics is not None:
            metrics.pending.set(pending)
        if pending < max_pending:
            if waited:
                say(f"rollout {k}: trainers caught up after {time.monotonic() - t0:.1f}s")
            return
        if not waited:
            say(f"rollout {k}: waiting for trainers ({pending} rollouts pending >= maxPendingRollouts={max_pending})")
            waited = True
        if max_wait is not None and time.monotonic() - t0 > max_wait:
            raise TimeoutError(f"rollout {k}: trainers consumed nothing for {max_wait:g}s ({pending} rollouts pending)")
        time.sleep(poll_interval)


# ------------------------------------------------------------------------------------------------------ CLI
def run(args: argparse.Namespace) -> int:
    from trainingrun.api import load_trainingrun
    from trainingrun.store import open_store

    if not args.config:
        print("config error: no TrainingRun given (--config or TRAININGRUN_CONFIG)", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if not args.store:
        print("config error: no store URL given (--store or TRAININGRUN_STORE_URL)", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        the_run = load_trainingrun(args.config)
        store = open_store(args.store)
    except (ValueError, ConfigError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except StoreError as exc:
        print(f"store error: {exc}", file=sys.stderr)
        return 1
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
        result = run_rollout(the_run, store, metrics=metrics, max_wait=args.max_wait)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except (StoreError, TimeoutError) as exc:
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
