"""One server of the engine pool as the pool sees it: the `ReplicaAdapter` an engine type writes for its servers
(what the pool needs of one server), the `Replica` record the pool keeps of it, and the constants of the label
protocol shared by the pool (`trainingrun.engines.pool`: weights, recovery) and its dispatch
(`trainingrun.engines.dispatch`). Engine-agnostic: imports no engine's code.
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
        """n samples of one prompt (token ids) with at most `max_tokens` new tokens; `seed` None: unseeded."""

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


@dataclass
class Replica:
    """One server of the pool, as the rollout sees it."""

    name: str
    adapter: ReplicaAdapter
    version: int = -1  # the weight version it holds (loaded and labelled)
    live: bool = False  # takes requests
    recovering: bool = False
    outstanding: int = 0  # our requests in flight
    answered: int = 0  # requests it answered (counted once each)
    last_seen: float = field(default_factory=time.monotonic)  # its last answer or probe
    last_error: str = ""
    last_sync: float = 0.0  # seconds its last load took
    stalled: bool = False
    failed: bool = False  # gave up waiting for it (restart_timeout); probed again at the next call

    @property
    def url(self) -> str:
        return str(getattr(self.adapter, "url", "?"))

    def describe(self) -> str:
        return f"{self.name} ({self.url})"
