"""One server of the engine pool as the pool sees it: the `ReplicaAdapter` an engine type writes for its servers
(what the pool needs of one server), the `EngineSignals` it may report (its load, its prefix cache), the `Replica`
record the pool keeps of it, and the constants of the label protocol shared by the pool (`trainingrun.engines.pool`:
weights, recovery) and its dispatch (`trainingrun.engines.dispatch`). Engine-agnostic: imports no engine's code.

`signals` is optional: an adapter without it (or that returns None) gives the pool no load signals, so its replica
keeps a fixed in-flight limit (`DEFAULT_CONCURRENCY` under `concurrency: auto`) and reports no prefix-cache figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainingrun.contract.engine import Sampling

MAX_RECOVERIES = 5
PROBE_TIMEOUT = 5.0
LOADING = "loading:"  # a replica's label while a load runs (and after one failed): never a version's label


class Answer(Protocol):
    """One sample of a replica's answer."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"; anything else: cut (an abort) — the tokens so far


class ReplicaAdapter(Protocol):
    """What the pool needs of one server (see the module docstring). Errors: `EngineUnavailable` (down: recovered),
    `WeightsRefused` (a version it will never load), `EngineError` (a refused request)."""

    url: str  # where it is (messages only)

    def generate(self, prompt: list[int], *, n: int, max_tokens: int, sampling: Sampling,
                 seed: int | None) -> Sequence[Answer]:
        """n samples of one prompt (token ids) with at most `max_tokens` new tokens; `seed` None: unseeded. Returns
        or raises within a bound of the adapter's own (a client timeout): until then the request holds its slot."""

    def abort(self) -> None:
        """Every request in flight answers now with its tokens so far; errors are swallowed (best effort)."""

    def label(self, timeout: float | None = None) -> str:
        """The weight label it holds (`EngineUnavailable` when it cannot be reached)."""

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until it is healthy again (`EngineUnavailable` after `timeout`)."""

    def load(self, version: int, meta: dict[str, Any], *, label: Callable[[int], str],
             timeout: float) -> dict[str, Any]:
        """Load weight `version` (its published `meta`), labelled `label(version)` only once complete, within
        `timeout`; returns what the load reports (its seconds, ...)."""

    # optional (module docstring):
    # def signals(self, timeout: float) -> EngineSignals | None:
    #     """Its load and prefix-cache counters now (`EngineUnavailable` when it cannot be reached)."""


@dataclass(frozen=True)
class EngineSignals:
    """What a server says of its own load (vLLM: its Prometheus /metrics): gauges now and counters so far; None where
    the engine does not say. Requests are counted as the engine counts them (vLLM: one per sample)."""

    running: float | None = None  # requests being generated
    waiting: float | None = None  # requests queued in the engine (no room: KV cache or batch full)
    kv_usage: float | None = None  # share of the KV cache in use, 0..1
    prefix_queries: float | None = None  # counter: prompt tokens looked up in the prefix cache
    prefix_hits: float | None = None  # counter: of those, tokens found cached
    preemptions: float | None = None  # counter: running requests the engine pushed back to make room


@dataclass
class Replica:
    """One server of the pool, as the rollout sees it."""

    name: str
    adapter: ReplicaAdapter
    version: int = -1  # the weight version it holds (loaded and labelled)
    live: bool = False  # takes requests
    recovering: bool = False
    outstanding: int = 0  # our requests sent and not yet answered (any call's; dispatch.py "Slots")
    answered: int = 0  # requests it answered (counted once each)
    last_seen: float = field(default_factory=time.monotonic)  # its last answer or probe
    last_error: str = ""
    last_sync: float = 0.0  # seconds its last load took
    stalled: bool = False
    failed: bool = False  # gave up waiting for it (restart_timeout); probed again at the next call
    limit: int = 64  # requests it may have in flight (fixed, or moved by its `AdaptiveLimit`)
    signals: EngineSignals | None = None  # the last it reported
    # what it did, cumulative over the pool's calls (`EnginePool.engine_counts`)
    inflight_seconds: float = 0.0  # ∫ our requests in flight dt
    call_seconds: float = 0.0  # seconds of calls
    prefix_queries: float = 0.0  # prompt tokens its prefix cache was asked for (from its counters' increments)
    prefix_hits: float = 0.0
    # the engine error (`EngineFault.cause`) its last failed request ended with, until it answers one
    fault: str = ""
    fault_back: bool = False  # it came back into the pool since that error
    fault_repeats: int = 0  # times it came back and failed with that same error again
    broken: str = ""  # that error, once it failed so FAULT_REPEATS times while others served: left out for good

    @property
    def url(self) -> str:
        return str(getattr(self.adapter, "url", "?"))

    def describe(self) -> str:
        return f"{self.name} ({self.url})"
