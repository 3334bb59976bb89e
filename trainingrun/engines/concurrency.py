"""Adaptive in-flight limits of the engine pool (`rollout.engine.vllm.concurrency: auto`): one `AdaptiveLimit` per
replica grows and trims how many requests the pool keeps in flight at that replica, from the engine's own signals
(`replica.EngineSignals`: requests running and waiting in the engine, KV-cache usage, preemptions). Pure and
engine-agnostic: the dispatch (`trainingrun.engines.dispatch`) reads the signals every CONTROL_SECONDS while a call
runs and hands them here with the replica's requests in flight.

The rule, at each reading (the engine counts requests as it runs them — vLLM one per sample —, the pool per
request of n samples: only the engine's own ratios are used):
  * over — the engine queues more than WAITING_SLACK of what it runs, or it preempted requests since the last reading
    (its KV cache overflowed): trim to the share of our requests it runs, plus HEADROOM so a request is always there
    when one finishes: limit = ceil(in flight × running / (running + waiting) × (1 + HEADROOM)), never below
    TRIM_FLOOR of the old limit in one reading; after preemptions with nothing queued, × PREEMPT_TRIM;
  * room — nothing queued, the KV cache below KV_GROW, and the limit is what held requests back (requests were
    waiting in the pool while the replica was at its limit): grow by GROW;
  * otherwise hold.
The limit stays within [low, high] (the pool's AUTO_LOW … AUTO_HIGH). An engine that reports no signals keeps the
limit it started with. Measured against fixed limits: benchmarks/engine_pool.py, docs/vllm.md "Adaptive concurrency".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainingrun.engines.replica import EngineSignals

CONTROL_SECONDS = 0.25  # how often the dispatch reads each replica's signals while a call runs
WAITING_SLACK = 0.05  # queued / running in the engine below this: not over
HEADROOM = 0.1  # above the share the engine runs, so a request waits whenever one finishes
TRIM_FLOOR = 0.5  # one reading never trims below half the old limit
PREEMPT_TRIM = 0.9  # preemptions with nothing queued: the KV cache overflowed as sequences grew
KV_GROW = 0.9  # grow only while the KV cache is used below this
GROW = 1.5


@dataclass
class AdaptiveLimit:
    """One replica's in-flight limit (see the module docstring)."""

    limit: int
    low: int
    high: int
    _preemptions: float | None = None
    decisions: int = 0  # readings that moved the limit (tests, benchmarks)

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"adaptive limit: bounds [{self.low}, {self.high}] must satisfy 1 <= low <= high")
        self.limit = min(max(self.limit, self.low), self.high)

    def update(self, s: EngineSignals | None, inflight: int, blocked: bool) -> int:
        """The new limit after one reading `s` (None: no signals: hold); `inflight`: our requests at the replica
        now; `blocked`: requests waited in the pool because this replica was at its limit."""
        if s is None or s.running is None or s.waiting is None:
            return self.limit
        preempted = (s.preemptions is not None and self._preemptions is not None
                     and s.preemptions > self._preemptions)
        if s.preemptions is not None:
            self._preemptions = s.preemptions
        running, waiting = max(s.running, 0.0), max(s.waiting, 0.0)
        old = self.limit
        if waiting > WAITING_SLACK * max(running, 1.0) and running > 0 and inflight > 0:
            share = running / (running + waiting)
            target = math.ceil(inflight * share * (1 + HEADROOM))
            self.limit = max(target, math.ceil(old * TRIM_FLOOR))
            self.limit = min(self.limit, old)
        elif preempted:
            self.limit = math.floor(old * PREEMPT_TRIM)
        elif waiting == 0 and blocked and inflight >= old and (s.kv_usage is None or s.kv_usage < KV_GROW):
            self.limit = math.ceil(old * GROW)
        self.limit = min(max(self.limit, self.low), self.high)
        self.decisions += int(self.limit != old)
        return self.limit
