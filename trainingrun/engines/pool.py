"""The engine pool: the rollout's `Engine` (trainingrun/contract/engine.py) over a pool of inference servers, whatever
engine serves them. Engine-agnostic: it reaches a server only through a `ReplicaAdapter` (`replica.py`); the vLLM adapter is
`trainingrun.engines.vllm.engine`, and a new engine type that serves requests from servers brings its own adapter and
reuses everything here (docs/architecture.md, "A new engine type"). This module imports no engine's code.

One server or several (`engine.replicas` of the run's own, or the comma-separated `engine.url`), each a `Replica` (`replica.py`):
its adapter, the weight version it holds, the requests it has in flight and when it last answered.

The adapter (`ReplicaAdapter`) is what the pool needs of one server: `generate` (one request: n samples of one
prompt, with the tokens, their log-probabilities and finish reasons), `abort` (every request in flight answers now
with its tokens so far: finish "abort"), `label` (the weight label the server holds: `label_prefix` + version once a
version loaded completely, LOADING + ... while a load runs or after one failed, anything else after a restart),
`wait_healthy` and `load` (load a published version, labelling the server only once it is complete). Its errors are
the contract's: `EngineUnavailable` (down, restarting, dead: retried elsewhere and recovered), `WeightsRefused` (a
damaged or foreign version), `EngineError` (refused: not retried).

Dispatch (`generate_groups`; `generate` is the same without a stop): one `Call` of `trainingrun.engines.dispatch`
per call — the per-request ledger and the dispatch loop, sticky routing, stalls, deaths, abort, the check of answers
(its module docstring). A replica it takes out is recovered here (`_recover`): its label, then the pool's current
weight version loaded (the version barrier), then back in the pool. What lasts across calls is the pool's: each
replica's in-flight limit (`concurrency`: a fixed number, or "auto": an `AdaptiveLimit` per replica between
AUTO_LOW and AUTO_HIGH, starting at DEFAULT_CONCURRENCY), the affinity table (`release` forgets ended
conversations), each replica's counters (`engine_counts`: prefix-cache queries and hits from the engine's own
counters, requests in flight over time, its limit), and the engine errors it answered with (`_fault`: the same
error from every replica, or from one each time it came back — FAULT_REPEATS returns — while no other serves, is a
`DeterministicEngineError`; with others serving that one is left out of the pool for good, `Replica.broken`).

One generate call at a time: a second call while one runs raises `RuntimeError` naming the rule — the abort
(server-wide), the stall watch, the requeue of a replica taken out and the requests-in-flight figure belong to the
one call that runs; a caller with requests from several threads batches them into one call (`rollout/sessions.py`'s
`EngineGate`).

Weights (`load_weights(version)`): `fetch(version)` says where the version is (an HF directory for `disk`, trainer
rank 0's address for `broadcast`: the version's meta); every replica loads it in parallel (`ReplicaAdapter.load`,
the meta with JOINT = {id, members} when several load it together: broadcast serves them in one transfer, and a
replica whose part failed transfers again alone; a recovery or a late replica loads alone), and the seconds each took
are recorded (`last_sync`). A replica found down is waited for and loaded again (up to MAX_RECOVERIES tries); a live
replica whose load fails is left out (recovered in the background) — unless no replica loaded the version: then
each whose load failed loads it again at once, alone (a pool of one included). A load taking longer than LOAD_REPORT_SECONDS is
reported ("engine-0 busy loading weights since 12:00:03 (30s)"); no load outlives `load_timeout` (+ the worker's
connect timeout): the worker bounds its own work. `WeightsRefused` (a damaged or foreign version) raises at once,
naming the replica. The pool holds version v once at least one replica does.

Resize (`members`: where the pool's current list of servers is read, e.g. the file the operator keeps up to date,
$TRAININGRUN_ENGINE_URL_FILE; `adapter_for`: a server's adapter from its URL): before each call, and before a weight
load when no call runs, the list is read again (`resize`). A server added joins through the recovery — its label,
the pool's current version loaded, then live — so it gets no request before it holds the current version. A server
removed leaves between calls, when the pool has no request in flight: nothing is cut; listed again, it comes back as
the same replica (its counters go on) through the same recovery. `applied` (optional) is told each list
the pool has just taken on (a local run's launcher stops a removed server only once the rollout's pool applied a list
without it). (A server that goes away
during a call, before the list said so, is a replica that died: its requests are re-sent to the others.)

Before a call each replica's weight label is checked (a server restarted since the last call is loaded again);
during it, answers count only once a probe of their replica finds the call's label (dispatch.py).
"""

from __future__ import annotations

import itertools
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from trainingrun.contract.engine import (
    Completion,
    DeterministicEngineError,
    EngineCounts,
    EngineError,
    EngineFault,
    EngineUnavailable,
    GroupRequest,
    OnGroup,
    Sampling,
    WeightsRefused,
)
from trainingrun.engines.concurrency import AdaptiveLimit
from trainingrun.engines.dispatch import AffinityTable, Call
from trainingrun.engines.replica import (
    LOADING,
    MAX_RECOVERIES,
    PROBE_TIMEOUT,
    Answer,
    EngineSignals,
    Replica,
    ReplicaAdapter,
)

__all__ = ["DEFAULT_CONCURRENCY", "JOINT", "LOADING", "MAX_RECOVERIES", "Answer", "EnginePool", "EngineSignals",
           "Replica", "ReplicaAdapter"]

DEFAULT_CONCURRENCY = 64  # a fixed limit's default, and where an adaptive one starts
AUTO_LOW, AUTO_HIGH = 4, 4096  # bounds of an adaptive limit (AUTO_HIGH: the API's largest fixed number)
STICKY_WAIT = 0.0  # seconds a request waits for room at its affinity's replica: none (benchmarks/engine_pool.py sticky-wait)
FAULT_REPEATS = 2  # a replica that came back and failed with the same engine error this often: deterministic
LOAD_REPORT_SECONDS = 30.0
JOINT = "joint"  # meta key of one sync of the pool: {"id", "members"}; an adapter may serve the members together
REMOVED = "removed from the pool"  # `Replica.broken` of a server a resize took out


class EnginePool:
    """The pool (see the module docstring). `adapters`: one `ReplicaAdapter` per server; `names`: the replicas'
    names (default engine-0, engine-1, ...); `name`: the engine type (`Engine.name`)."""

    def __init__(self, adapters: Sequence[ReplicaAdapter], *, fetch: Callable[[int], dict[str, Any]],
                 name: str = "pool", label_prefix: str = "v", concurrency: int | str = DEFAULT_CONCURRENCY,
                 restart_timeout: float = 900.0, load_timeout: float = 600.0, stall_seconds: float = 60.0,
                 sticky_wait: float = STICKY_WAIT, seeded: bool = False, names: Sequence[str] | None = None,
                 say: Callable[[str], None] | None = None,
                 members: Callable[[], Sequence[str] | None] | None = None,
                 adapter_for: Callable[[str], ReplicaAdapter] | None = None,
                 applied: Callable[[Sequence[str]], None] | None = None):
        adapters = list(adapters)
        if not adapters:
            raise ValueError("clients: a pool needs at least one server")
        names = list(names) if names is not None else [f"engine-{i}" for i in range(len(adapters))]
        self.name = name
        self.replicas = [Replica(n, a) for n, a in zip(names, adapters, strict=True)]
        self.fetch = fetch
        self.label_prefix = label_prefix
        if concurrency != "auto" and not (isinstance(concurrency, int) and concurrency >= 1):
            raise ValueError(f"concurrency: {concurrency!r}; allowed: an integer >= 1 or 'auto'")
        self.concurrency = concurrency
        start = DEFAULT_CONCURRENCY if concurrency == "auto" else int(concurrency)
        for r in self.replicas:
            r.limit = start
        self.adaptive = ({r.name: AdaptiveLimit(start, AUTO_LOW, AUTO_HIGH) for r in self.replicas}
                         if concurrency == "auto" else {})
        self.sticky_wait = sticky_wait
        self.affinity = AffinityTable()
        self._prefix_base: dict[str, tuple[float, float]] = {}  # each replica's counters at the last reading
        self.restart_timeout = restart_timeout
        self.load_timeout = load_timeout
        self.stall_seconds = stall_seconds
        self.seeded = seeded
        self.say = say or (lambda msg: print(f"rollout: {name}: {msg}", file=sys.stderr, flush=True))
        self._version = -1
        self._lock = threading.RLock()
        self._calling = threading.Lock()  # held by the one generate call that runs
        self._closed = threading.Event()
        self._tickets = itertools.count()
        if members is not None and adapter_for is None:
            raise ValueError("members: a pool that reads its list of servers needs adapter_for (URL -> adapter)")
        self.members, self.adapter_for, self.applied = members, adapter_for, applied
        self._left: dict[str, Replica] = {}  # servers a resize removed, by URL: the same one back keeps its counters
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
        if self._calling.acquire(blocking=False):  # no call runs: the list of servers may change now
            try:
                self._read_members()
            finally:
                self._calling.release()
        meta = self.fetch(version)
        t0 = time.perf_counter()
        with self._lock:
            targets = [r for r in self.replicas if not r.recovering and not r.broken]
        outcome: dict[str, BaseException | None] = {}
        # one sync of the pool: the adapters may serve its replicas together (broadcast: one transfer for all)
        together = {**meta, JOINT: {"id": uuid.uuid4().hex[:12], "members": len(targets)}} if len(targets) > 1 else meta
        self._load_all(targets, version, together, outcome, wait=len(targets) == 1)
        if not any(outcome.get(r.name, 1) is None for r in targets):
            # no replica loaded it: each one whose load failed (not refused) loads again, alone, once — a pool
            # of one too (a transfer cut by a transient fault, e.g. a connection closed while its group formed,
            # would end the rollout); a lone server that went away was waited for already (`_load_replica`)
            again = [r for r in targets if isinstance(outcome.get(r.name), EngineUnavailable)
                     and not isinstance(outcome.get(r.name), WeightsRefused)
                     and (len(targets) > 1 or not self._went_away(r))]
            for r in again:
                self.say(f"{r.describe()}: loading weight version {version} failed ({outcome[r.name]}); "
                         "loading it again")
            self._load_all(again, version, meta, outcome, wait=True)
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

    def _load_once(self, r: Replica, version: int, meta: dict[str, Any], *, go_live: bool = True) -> None:
        """Load `version` into `r`; with `go_live` it serves at once. The recovery loads without: it puts `r` back
        only after checking, under the lock, that `version` is still the pool's (else a replica holding an older
        version got requests of the newer one, and a later load of that one confirmed their answers)."""
        t0 = time.perf_counter()
        result = r.adapter.load(version, meta, label=self.label, timeout=self.load_timeout)
        with self._lock:
            r.version, r.stalled, r.failed = version, False, False
            r.live = r.live or go_live
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
            if r.recovering or r.broken or self._closed.is_set():
                return
            r.recovering = True
        self.stats["recoveries"] += 1
        self.say(f"{r.describe()}: {why}; taken out of the pool, waiting up to {self.restart_timeout:.0f}s for it")
        threading.Thread(target=self._recovery, args=(r,), name=f"recover-{r.name}", daemon=True).start()

    def _recovery(self, r: Replica) -> None:
        t0 = time.monotonic()
        try:
            while not self._closed.is_set() and not r.broken and time.monotonic() - t0 < self.restart_timeout:
                version = self._version
                try:
                    label = r.adapter.label(timeout=PROBE_TIMEOUT)
                    if label != self.label(version):
                        try:
                            meta = self.fetch(version)
                        except Exception as exc:  # noqa: BLE001 - the fetch is the caller's (a store, a file)
                            # e.g. a server added by a resize at the start of load_weights(v + 1): the pool's
                            # version v may be released already (lag 0 keeps the newest); v + 1 comes next
                            raise EngineUnavailable(f"weight version {version} cannot be fetched: "
                                                    f"{type(exc).__name__}: {exc}") from None
                        self._load_once(r, version, meta, go_live=False)
                    elif version != self._version:
                        continue
                    with self._lock:
                        if self._version != version:
                            continue  # a newer version came meanwhile: load that one
                        r.version, r.live, r.stalled, r.failed = version, True, False, False
                        r.last_seen = time.monotonic()
                        r.fault_back = bool(r.fault)
                    self.say(f"{r.describe()}: back in the pool after {time.monotonic() - t0:.1f}s, holding weight "
                             f"version {version}")
                    return
                except WeightsRefused as exc:
                    r.last_error = str(exc)
                    break
                except EngineError as exc:  # EngineUnavailable included
                    r.last_error = str(exc)
                self._closed.wait(1.0)
            if r.broken == REMOVED:
                return  # a resize took it out of the pool: nothing to wait for
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
            if r.recovering or r.broken:
                continue
            try:
                label = r.adapter.label(timeout=PROBE_TIMEOUT)
            except EngineUnavailable as exc:
                self._recover(r, f"unavailable before generating ({exc})")
                continue
            if label == want:
                with self._lock:
                    r.fault_back = r.fault_back or (bool(r.fault) and not r.live)
                    r.live, r.version, r.failed, r.stalled = True, self._version, False, False
                    r.last_seen = time.monotonic()
            else:
                self._recover(r, f"its weight label is {label!r}, not {want!r} (restarted, or a load was "
                                 "interrupted)")

    # ------------------------------------------------------------------ resize
    def _read_members(self) -> None:
        """The pool's servers as `members` lists them now (nothing when it has no list, or none could be read)."""
        if self.members is None:
            return
        try:
            urls = self.members()
        except (OSError, ValueError) as exc:
            self.say(f"cannot read the list of servers ({exc}); the pool keeps its {len(self.replicas)}")
            return
        if urls:
            self.resize(urls)
            if self.applied is not None:  # the removed servers are let go: no call or load will reach them
                self.applied(list(dict.fromkeys(urls)))

    def resize(self, urls: Sequence[str]) -> None:
        """The pool's servers become `urls` (module docstring, "Resize"); call it only when no call runs. Kept
        servers keep their state; an added one is named engine-<i> after its place in `urls`."""
        wanted = list(dict.fromkeys(urls))
        assert self.adapter_for is not None, "resize needs adapter_for"
        with self._lock:
            have = {r.url: r for r in self.replicas}
            if not wanted or set(wanted) == set(have):
                return
            gone = [r for u, r in have.items() if u not in wanted]
            kept = {r.name for r in self.replicas if r.url in wanted}
            for r in gone:
                r.live, r.broken = False, r.broken or REMOVED  # a recovery under way stops using it
                self._prefix_base.pop(r.name, None)
                self.adaptive.pop(r.name, None)
                self._left[r.url] = r
            start = DEFAULT_CONCURRENCY if self.concurrency == "auto" else int(self.concurrency)
            replicas, added = [], []
            for i, url in enumerate(wanted):
                if url in have:
                    replicas.append(have[url])
                    continue
                r = self._left.pop(url, None)  # back: its counters go on (a rollout's share is a difference)
                if r is not None and r.broken == REMOVED and r.name not in kept:
                    r.broken, r.live, r.failed, r.stalled, r.limit = "", False, False, False, start
                else:
                    name = f"engine-{i}" if f"engine-{i}" not in kept else f"engine-{i}-{url}"
                    r = Replica(name, self.adapter_for(url), limit=start)
                if self.concurrency == "auto":
                    self.adaptive[r.name] = AdaptiveLimit(start, AUTO_LOW, AUTO_HIGH)
                replicas.append(r)
                added.append(r)
            self.replicas = replicas
        self.say(f"resized from {len(have)} to {len(wanted)} server(s)"
                 + (f"; removed {', '.join(r.describe() for r in gone)}" if gone else "")
                 + (f"; added {', '.join(r.describe() for r in added)}" if added else ""))
        if self._version >= 0:
            for r in added:  # the current version first, then live (the recovery's steps)
                with self._lock:
                    if r.recovering:
                        continue  # a recovery begun before it left goes on: it joins through that one
                    r.recovering = True
                threading.Thread(target=self._recovery, args=(r,), name=f"join-{r.name}", daemon=True).start()

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: Sampling, *,
                 affinities: Sequence[str | None] | None = None) -> list[list[Completion]]:
        """n completions of each prompt; `affinities` (one per prompt, or None): sticky routing (dispatch.py)."""
        seeds = np.random.SeedSequence([int(sampling.seed), 0x61]).generate_state(max(len(prompts), 1))
        keys = list(affinities) if affinities is not None else [None] * len(prompts)
        if len(keys) != len(prompts):
            raise ValueError(f"affinities: {len(keys)} for {len(prompts)} prompts")
        requests = [GroupRequest(prompt=[int(t) for t in p], n=n, seed=int(s), affinity=a)
                    for p, s, a in zip(prompts, seeds, keys)]
        return self.generate_groups(requests, sampling)

    def release(self, affinities) -> None:
        """Forget these affinities (conversations that ended)."""
        with self._lock:
            self.affinity.release(affinities)

    def generate_groups(self, requests: Sequence[GroupRequest], sampling: Sampling, *,
                        on_group: OnGroup | None = None) -> list[list[Completion]]:
        """One call (dispatch.py). One generate call at a time: a second one while a call runs raises
        `RuntimeError` (module docstring)."""
        if not self._calling.acquire(blocking=False):
            raise RuntimeError(f"{self.name}: another generate call is running on this engine pool; the pool serves "
                               "one generate call at a time (callers with requests from several threads batch them "
                               "into one call, as rollout/sessions.py's EngineGate does)")
        try:
            return self._call(requests, sampling, on_group)
        finally:
            self._calling.release()

    def _call(self, requests: Sequence[GroupRequest], sampling: Sampling,
              on_group: OnGroup | None) -> list[list[Completion]]:
        if self._version < 0:
            raise EngineError("generate before load_weights: the engine holds no weight version yet")
        t0 = time.perf_counter()
        self._read_members()
        self._check_replicas()
        self._read_all_signals(first=True)  # the counters' starting point of a replica not read yet
        call = Call(self, list(requests), sampling, on_group)
        out = call.run()
        self._read_all_signals()  # the call's last prefix-cache counts
        self.stats["generated_tokens"] += call.new_tokens
        self.stats["generate_seconds"] += time.perf_counter() - t0
        return out

    def served(self) -> dict[str, int]:
        """Requests each replica answered so far."""
        return {r.name: r.answered for r in self.replicas}

    # ------------------------------------------------------------------ what each engine did
    def engine_counts(self) -> dict[str, EngineCounts]:
        """Each replica's counters so far (a rollout's share: the difference of two readings)."""
        with self._lock:
            return {r.name: EngineCounts(prefix_queries=r.prefix_queries, prefix_hits=r.prefix_hits,
                                         inflight_seconds=r.inflight_seconds, seconds=r.call_seconds,
                                         concurrency=r.limit) for r in self.replicas}

    def _signals(self, r: Replica, s: EngineSignals) -> None:
        """A reading of `r`'s signals: its prefix-cache counters' increments counted (a counter that fell: the
        server restarted, counting from 0)."""
        with self._lock:
            r.signals = s
            if s.prefix_queries is None or s.prefix_hits is None:
                return
            base = self._prefix_base.get(r.name)
            if base is not None:
                q0, h0 = base if s.prefix_queries >= base[0] and s.prefix_hits >= base[1] else (0.0, 0.0)
                r.prefix_queries += s.prefix_queries - q0
                r.prefix_hits += s.prefix_hits - h0
            self._prefix_base[r.name] = (s.prefix_queries, s.prefix_hits)

    def _read_all_signals(self, *, first: bool = False) -> None:
        """Read every live replica's signals now (after a call: its prefix-cache counts; `first`: only those never
        read, before a call); failures ignored."""
        for r in self.replicas:
            read = getattr(r.adapter, "signals", None)
            if read is None or not r.live or (first and r.name in self._prefix_base):
                continue
            try:
                s = read(timeout=PROBE_TIMEOUT)
            except EngineError:
                continue
            if isinstance(s, EngineSignals):
                self._signals(r, s)

    # ------------------------------------------------------------------ engine errors
    def _fault(self, r: Replica, exc: EngineUnavailable) -> DeterministicEngineError | None:
        """A request of `r` failed: with an engine error (`EngineFault`) compared with the others' (module
        docstring), the `DeterministicEngineError` that ends the call, else None."""
        if not isinstance(exc, EngineFault):
            return None
        cause = normalise_cause(exc.cause)
        with self._lock:
            if r.fault == cause and r.fault_back:
                r.fault_repeats += 1
            elif r.fault != cause:
                r.fault, r.fault_repeats = cause, 0
            r.fault_back = False
            every = len(self.replicas) > 1 and all(x.fault == cause for x in self.replicas)
            again = r.fault_repeats >= FAULT_REPEATS
            serving = [x for x in self.replicas if x is not r and not x.broken and not x.fault]
            if again and serving and not every:  # the others serve: this one is left out, the run goes on
                r.broken, again = cause, False
        if r.broken == cause and not every:
            self.say(f"{r.describe()} failed with the same error each time it came back ({r.fault_repeats + 1} "
                     f"times): {exc.cause}; left out of the pool, {len(serving)} engine(s) serve on")
        if every:
            names = ", ".join(x.describe() for x in self.replicas)
            return DeterministicEngineError(f"every engine of the pool failed with the same error ({names}): "
                                            f"{exc.cause}")
        if again:
            return DeterministicEngineError(f"{r.describe()} failed with the same error each time it came back "
                                            f"({r.fault_repeats + 1} times): {exc.cause}")
        return None

    def _answered(self, r: Replica) -> None:
        """`r` answered a request: its last engine error is over."""
        with self._lock:
            r.fault, r.fault_back, r.fault_repeats = "", False, 0

    def close(self) -> None:
        self._closed.set()


def normalise_cause(cause: str) -> str:
    """An engine error's message without what differs between two servers or requests (request ids, long hex, URLs),
    so the same error from two engines compares equal."""
    text = re.sub(r"https?://\S+", "<url>", cause.strip())
    text = re.sub(r"\b(cmpl|chatcmpl|req)-[0-9a-zA-Z-]+", r"\1-<id>", text)
    return re.sub(r"\b[0-9a-fA-F]{12,}\b", "<hex>", text)
