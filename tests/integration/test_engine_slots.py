"""The engine pool's per-replica slots (`Replica.outstanding`, `trainingrun.engines.dispatch`): a request sent holds
one slot of its replica until its answer (or failure) comes back, whatever became of its call — re-sent elsewhere
after a stall or a death, given up after an abort, or the call over — and only the call that waits for it counts
the answer. A pool serves one call at a time.

Regression: a late answer went into the event queue of a call that had returned, where nobody read it, so its
replica's `outstanding` stayed raised for good; once it reached the replica's limit the pool sent that replica
nothing more, and a call that had only that replica looped forever in `Call.run` (reported from a thread dump of the
engine-death test under load).

The replicas here are `TimedReplica`s: in-memory `ReplicaAdapter`s whose every answer the test times — at once,
late, never until released, a failure, a server's own abort, a stopped server (requests and probes hang until it
is thawed), an abort it ignores — under the real `EnginePool`.
"""

from __future__ import annotations

import collections
import threading
import time
import typing
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainingrun.contract.engine import ABORTED, EngineError, EngineTimeout, EngineUnavailable, GroupRequest, Sampling
from trainingrun.engines import dispatch
from trainingrun.engines import pool as pool_mod
from trainingrun.engines.pool import EnginePool

EOS = 2
SAMPLING = Sampling(temperature=1.0, max_new_tokens=16, stop_token_ids=(EOS,), seed=1)
STALL_SECONDS = 0.25


class Answer(typing.NamedTuple):
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass(frozen=True)
class Kind:
    """How a `TimedReplica` answers one request: after `delay` seconds (None: when the test releases it), with
    `outcome` (answer, fail: EngineUnavailable, refuse: EngineError, abort: the server's own abort), honouring an
    abort unless `deaf`; `stops`: the request stops its server (requests and probes hang until thawed)."""

    delay: float | None
    outcome: str = "answer"
    deaf: bool = False
    stops: bool = False


KINDS = {
    "answer": Kind(0.0),
    "slow": Kind(0.15),
    "hold": Kind(None),
    "deaf-hold": Kind(None, deaf=True),
    "deaf": Kind(0.4, deaf=True),  # ignores aborts, answers later than ABORT_WAIT below
    "fail": Kind(0.005, "fail"),
    "refuse": Kind(0.005, "refuse"),
    "server-abort": Kind(0.005, "abort"),
    "stall": Kind(0.02, stops=True),
}


@dataclass
class _Request:
    kind: Kind
    prompt: list[int]
    n: int
    due: float
    released: bool = False
    aborted: bool = False


def completion(prompt: list[int], sample: int) -> list[int]:
    s = sum(prompt) + 3 * sample
    return [3 + (s + j) % 5 for j in range(s % 3)] + [EOS]


class TimedReplica:
    """A `ReplicaAdapter` whose answers the test times (module docstring). `script`: the kinds of the next requests
    it receives, in order (a deque, possibly shared by several replicas); "answer" once it is empty."""

    def __init__(self, name: str, script: collections.deque | None = None, *, thaw_after: float | None = None):
        self.url = f"timed://{name}"
        self.script = script if script is not None else collections.deque()
        self.thaw_after = thaw_after
        self.label_now = "initial"
        self.slow_probes_after_answer = 0  # after each answer, that many probes time out (a busy server)
        self.slow_probes = 0
        self.load_fails = False
        self.load_gate: threading.Semaphore | None = None  # set: each load waits for a permit the test releases
        self.loads: list[int] = []  # the versions of the loads begun
        self.frozen = False
        self.cond = threading.Condition()
        self.active: list[_Request] = []
        self.received = 0

    # -- the adapter
    def generate(self, prompt, *, n, max_tokens, sampling, seed):
        with self.cond:
            kind = KINDS[self.script.popleft() if self.script else "answer"]
            req = _Request(kind, list(prompt), n, float("inf") if kind.delay is None else time.monotonic() + kind.delay)
            self.active.append(req)
            self.received += 1
            if kind.stops:
                self.freeze()
            try:
                while self.frozen or not (req.released or req.aborted or time.monotonic() >= req.due):
                    self.cond.wait(0.01)
            finally:
                self.active.remove(req)
                self.cond.notify_all()
        if req.aborted:  # cut: the first token so far
            return [Answer(completion(prompt, i)[:1], [-0.5], "abort") for i in range(n)]
        if kind.outcome == "fail":
            raise EngineUnavailable(f"{self.url}: connection refused")
        if kind.outcome == "refuse":
            raise EngineError(f"{self.url}: 400 the request was refused")
        if kind.outcome == "abort":
            return [Answer(completion(prompt, i)[:1], [-0.5], "abort") for i in range(n)]
        with self.cond:
            self.slow_probes = self.slow_probes_after_answer
        return [Answer(t, [-0.25] * len(t), "stop") for t in (completion(prompt, i) for i in range(n))]

    def abort(self) -> None:
        with self.cond:
            if self.frozen:
                return  # a stopped server answers nothing, its abort neither
            for req in self.active:
                if not req.kind.deaf:
                    req.aborted = True
            self.cond.notify_all()

    def label(self, timeout: float | None = None) -> str:
        with self.cond:
            if self.slow_probes > 0:
                self.slow_probes -= 1
                self.cond.wait(60.0 if timeout is None else timeout)
                raise EngineTimeout(f"{self.url}: did not answer in time")
            end = time.monotonic() + (60.0 if timeout is None else timeout)
            while self.frozen:
                if time.monotonic() >= end:
                    raise EngineUnavailable(f"{self.url}: timed out")
                self.cond.wait(0.01)
            return self.label_now

    def wait_healthy(self, timeout: float) -> float:
        return 0.0

    def load(self, version, meta, *, label, timeout):
        self.loads.append(version)
        if self.load_gate is not None:
            assert self.load_gate.acquire(timeout=30), "the test never let this load finish"
        if self.load_fails:
            raise EngineUnavailable(f"{self.url}: connection refused")
        with self.cond:
            self.label_now = label(version)
        return {}

    # -- the test's hands
    def freeze(self) -> None:
        with self.cond:
            self.frozen = True
            if self.thaw_after is not None:
                threading.Timer(self.thaw_after, self.thaw).start()

    def thaw(self) -> None:
        with self.cond:
            self.frozen = False
            self.cond.notify_all()

    def release(self) -> None:
        with self.cond:
            for req in self.active:
                req.released = True
            self.cond.notify_all()

    def busy(self) -> int:
        with self.cond:
            return len(self.active)


@pytest.fixture
def fast(monkeypatch):
    """The dispatch's clocks shortened so that stalls and ignored aborts take fractions of a second."""
    monkeypatch.setattr(dispatch, "PROBE_SECONDS", 0.05)
    monkeypatch.setattr(dispatch, "PROBE_TIMEOUT", 0.2)
    monkeypatch.setattr(dispatch, "ABORT_GRACE", 0.1)
    monkeypatch.setattr(dispatch, "ABORT_WAIT", 0.3)
    monkeypatch.setattr(pool_mod, "PROBE_TIMEOUT", 0.2)


def make_pool(adapters, concurrency: int, said: list[str] | None = None, stall_seconds: float = STALL_SECONDS
              ) -> EnginePool:
    pool = EnginePool(adapters, fetch=lambda v: {"version": v}, concurrency=concurrency,
                      stall_seconds=stall_seconds, restart_timeout=30,
                      say=said.append if said is not None else (lambda m: None))
    pool.load_weights(0)
    return pool


def requests(count: int, first: int = 0) -> list[GroupRequest]:
    return [GroupRequest(prompt=[5, 6, 3 + i], n=1, seed=100 + i) for i in range(first, first + count)]


def wait_until(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def outstanding(pool: EnginePool) -> list[int]:
    with pool._lock:
        return [r.outstanding for r in pool.replicas]


def live(pool: EnginePool, i: int) -> bool:
    with pool._lock:
        return pool.replicas[i].live and not pool.replicas[i].recovering


def call_in_thread(pool: EnginePool, reqs: list[GroupRequest], on_group=None) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run():
        try:
            box["out"] = pool.generate_groups(reqs, SAMPLING, on_group=on_group)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            box["error"] = exc

    t = threading.Thread(target=run, name="test-call", daemon=True)
    t.start()
    return t, box


def unstick(pool: EnginePool, t: threading.Thread) -> None:
    """A call that hangs on leaked slots (the defect) is let go, so a failing test does not leave it looping."""
    if t.is_alive():
        with pool._lock:
            for r in pool.replicas:
                r.outstanding = 0
        t.join(10)


def finished(out) -> bool:
    return all(c.finished and c.finish_reason != ABORTED for g in out for c in g)


# ------------------------------------------------------------------------------------------------ the reported hang
def test_a_late_answer_of_a_request_re_sent_after_a_stall_frees_its_slot(fast):
    """engine-0 stops with the call's first request; after stallSeconds that request goes to engine-1 and the call
    returns. engine-0 then answers it (late: its call is over) and comes back. With engine-1 out, the next call has
    only engine-0: it must be served there, not loop forever waiting for a slot the late answer never gave back."""
    said: list[str] = []
    a, b = TimedReplica("a", collections.deque(["stall"])), TimedReplica("b")
    pool = make_pool([a, b], concurrency=1, said=said)
    t = None
    try:
        out = pool.generate_groups(requests(2), SAMPLING)
        assert finished(out)
        assert any("engine-0" in m and "has not answered for" in m for m in said), said
        assert pool.served() == {"engine-0": 0, "engine-1": 2}
        # the stalled request is still in flight at engine-0
        wait_until(lambda: outstanding(pool) == [1, 0], 2, f"in flight: {outstanding(pool)}")
        a.thaw()  # engine-0 answers the request its call no longer waits for, and comes back
        wait_until(lambda: a.busy() == 0 and live(pool, 0), 10, f"engine-0 back in the pool ({said})")
        b.label_now, b.load_fails = "default", True  # engine-1 restarted and cannot load: out of the pool
        t, box = call_in_thread(pool, requests(3, first=10))
        t.join(10)
        assert not t.is_alive(), (f"the call hangs: engine-0's slots {outstanding(pool)[0]} of "
                                  f"{pool.replicas[0].limit} stay taken by the late answer")
        assert "error" not in box, box
        assert finished(box["out"])
        # the late answer freed its slot and counted nowhere: engine-0 answered the second call's 3 requests only
        assert pool.served() == {"engine-0": 3, "engine-1": 2}
        assert outstanding(pool) == [0, 0]
    finally:
        a.thaw()
        a.release()
        if t is not None:
            unstick(pool, t)
        pool.close()


def test_a_late_answer_of_a_request_given_up_after_an_abort_frees_its_slot(fast):
    """The call stops after its first group; engine-1's request ignores the abort and is given up after ABORT_WAIT
    (cut), the call returns; its answer comes later. engine-1's slot must be free for the next call."""
    a = TimedReplica("a")
    b = TimedReplica("b", collections.deque(["deaf-hold"]))
    said: list[str] = []
    pool = make_pool([a, b], concurrency=1, said=said)
    t = None
    try:
        out = pool.generate_groups(requests(3), SAMPLING, on_group=lambda i, c: True)
        assert finished([out[0]]) and out[1][0].finish_reason == ABORTED and len(out[1][0].tokens) == 0
        assert outstanding(pool) == [0, 1]  # engine-1's request is still running there
        served = pool.served()
        assert served["engine-1"] == 0, served
        b.release()  # its answer comes after its call gave it up
        wait_until(lambda: b.busy() == 0, 10, "engine-1 answered")
        a.label_now, a.load_fails = "default", True  # engine-0 out: the next call has only engine-1
        t, box = call_in_thread(pool, requests(2, first=10))
        t.join(10)
        assert not t.is_alive(), f"the call hangs: engine-1's slots {outstanding(pool)[1]} stay taken"
        assert "error" not in box, box
        assert finished(box["out"])
        # the given-up answer counted nowhere: engine-1 answered the second call's 2 requests only
        assert pool.served() == {"engine-0": served["engine-0"], "engine-1": 2}, said
        assert outstanding(pool) == [0, 0]
    finally:
        b.release()
        if t is not None:
            unstick(pool, t)
        pool.close()


def test_a_late_answer_of_a_call_that_raised_frees_its_slot(fast):
    """A call that ends with an error (a refused request) leaves its other requests in flight; they answer later."""
    a = TimedReplica("a", collections.deque(["refuse"]))
    b = TimedReplica("b", collections.deque(["hold"]))
    pool = make_pool([a, b], concurrency=1)
    try:
        with pytest.raises(EngineError, match="refused"):
            pool.generate_groups(requests(2), SAMPLING)
        assert outstanding(pool)[1] == 1
        b.release()
        wait_until(lambda: outstanding(pool) == [0, 0], 5, f"slots released: {outstanding(pool)}")
        assert pool.served() == {"engine-0": 0, "engine-1": 0}
    finally:
        b.release()
        pool.close()


# ------------------------------------------------------------------------------------------------ a busy server
def test_a_probe_that_times_out_is_asked_again_and_the_answers_count(fast):
    """Regression (CI, test_vllm's large chunked-prefill batch on 2 cores): the probe that confirms an answer timed
    out while the CPU server was busy, and the engine was taken out of the pool (2 recoveries) and its answers sent
    again elsewhere. A probe that times out is asked again; the answers count once a probe finds the call's label."""
    said: list[str] = []
    a = TimedReplica("a")
    pool = make_pool([a], concurrency=2, said=said, stall_seconds=5.0)
    try:
        a.slow_probes_after_answer = 1  # the first probe after each answer times out (PROBE_TIMEOUT 0.2 s)
        t, box = call_in_thread(pool, requests(4))
        t.join(20)  # before the fix: taken out at every answer, its answers sent again to itself, for good
        assert not t.is_alive() and pool.stats["recoveries"] == 0, said
        assert "error" not in box and finished(box["out"]), box
        assert pool.served() == {"engine-0": 4} and a.received == 4, said
    finally:
        a.slow_probes, a.slow_probes_after_answer = 0, 0
        pool.close()


def test_probes_that_time_out_for_the_stall_time_take_the_engine_out_and_the_answers_go_elsewhere(fast):
    said: list[str] = []
    a, b = TimedReplica("a"), TimedReplica("b")
    pool = make_pool([a, b], concurrency=1, said=said)
    try:
        a.slow_probes_after_answer = 10**6  # engine-0 answers, then never answers a probe in time
        out = pool.generate_groups(requests(3), SAMPLING)
        assert finished(out)
        assert any("engine-0" in m and "a probe failed with answers unconfirmed" in m and "in time" in m
                   for m in said), said
        assert pool.served()["engine-0"] == 0 and pool.served()["engine-1"] == 3, (pool.served(), said)
    finally:
        a.slow_probes, a.slow_probes_after_answer = 0, 0
        pool.close()


# ------------------------------------------------------------------------------------------------ the version barrier
def test_a_replica_recovered_while_the_pool_moved_on_serves_only_once_it_holds_the_new_version(fast):
    """Regression (test_vllm_e2e's dying-engine run under load, logprob_abs_diff 1.15): the recovery loaded the
    version current when it started, which marked the replica live at once; the pool had meanwhile moved to a newer
    version, so the replica got that version's requests while it held the older one (and a later load of the newer
    one confirmed their answers). It stays out until it holds the pool's version."""
    said: list[str] = []
    a, b = TimedReplica("a"), TimedReplica("b")
    pool = make_pool([a, b], concurrency=2, said=said)
    try:
        b.label_now, b.load_gate, b.loads = "initial", threading.Semaphore(0), []  # engine-1 restarted; its loads wait
        pool._recover(pool.replicas[1], "a request failed (test)")
        wait_until(lambda: b.loads == [0], 5, f"the recovery's first load ({b.loads})")
        pool.load_weights(1)  # the pool moves on meanwhile (engine-0 alone: engine-1 is being recovered)
        b.load_gate.release()  # engine-1's load of version 0 ends: it must not serve version 1's requests
        wait_until(lambda: b.loads == [0, 1], 5, f"the recovery loads the pool's new version ({b.loads})")
        with pool._lock:
            assert not pool.replicas[1].live, "engine-1 serves while it holds version 0 and the pool is at 1"
        b.load_gate.release()
        wait_until(lambda: live(pool, 1), 5, f"engine-1 back ({said})")
        assert pool.replicas[1].version == 1 and b.label_now == pool.label(1)
        out = pool.generate_groups(requests(8), SAMPLING)
        assert finished(out) and pool.served()["engine-1"] > 0
    finally:
        if b.load_gate is not None:
            b.load_gate.release(10)
        pool.close()


# ------------------------------------------------------------------------------------------------ one call at a time
def test_a_second_concurrent_call_is_refused_naming_the_rule(fast):
    a = TimedReplica("a", collections.deque(["hold"]))
    pool = make_pool([a], concurrency=4)
    t = None
    try:
        t, box = call_in_thread(pool, requests(1))
        wait_until(lambda: a.busy() == 1, 5, "the first call's request in flight")
        with pytest.raises(RuntimeError, match="one generate call at a time"):
            pool.generate_groups(requests(2, first=5), SAMPLING)
        with pytest.raises(RuntimeError, match="one generate call at a time"):
            pool.generate([[5, 6]], 1, SAMPLING)
        assert a.received == 1 and outstanding(pool) == [1]  # the refused calls sent nothing
        a.release()
        t.join(5)
        assert not t.is_alive() and finished(box["out"])
        # the pool serves the next call, also after one that raised
        a.script.append("refuse")
        with pytest.raises(EngineError):
            pool.generate_groups(requests(1), SAMPLING)
        assert finished(pool.generate_groups(requests(4), SAMPLING))
        assert outstanding(pool) == [0]
    finally:
        a.release()
        if t is not None:
            t.join(5)
        pool.close()


# ------------------------------------------------------------------------------------------------ every path
CALL = st.tuples(st.lists(st.sampled_from(["answer", "answer", "slow", "fail", "server-abort", "stall", "deaf",
                                           "refuse"]), max_size=10),
                 st.integers(1, 8),  # requests
                 st.integers(0, 4))  # stop after this many groups (0: no stop)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(replicas=st.integers(2, 3), concurrency=st.integers(1, 3), calls=st.lists(CALL, min_size=1, max_size=3))
def test_every_slot_comes_back_whatever_the_answers(fast, replicas, concurrency, calls):
    """Calls over a script of answers, failures, the servers' own aborts, stalls, aborts ignored and refusals (the
    replicas take the script's kinds in the order their requests arrive): after each call, once every request has
    answered, each replica's `outstanding` is 0 again, and what answered after its call returned counted nowhere.
    A last plain call then dispatches to every replica."""
    script: collections.deque = collections.deque()
    fakes = [TimedReplica(f"r{i}", script, thaw_after=0.6) for i in range(replicas)]
    pool = make_pool(fakes, concurrency)
    try:
        for kinds, count, stop_after in calls:
            script.clear()
            script.extend(kinds)
            groups: list[int] = []
            on_group = (lambda i, c: groups.append(i) or len(groups) >= stop_after) if stop_after else None
            before = pool.served()
            raised = None
            try:
                out = pool.generate_groups(requests(count), SAMPLING, on_group=on_group)
            except EngineError as exc:
                raised = exc
            returned = pool.served()
            wait_until(lambda: not any(f.busy() or f.frozen for f in fakes), 10, "every request answered")
            wait_until(lambda: all(live(pool, i) for i in range(replicas)), 10, "every replica back")
            wait_until(lambda: outstanding(pool) == [0] * replicas, 2,
                       f"slots still taken after every request answered: {outstanding(pool)} ({kinds}, "
                       f"{count} requests, stop after {stop_after})")
            assert pool.served() == returned, "an answer that came after its call returned was counted"
            added = sum(returned.values()) - sum(before.values())
            if raised is not None:
                assert "refuse" in kinds and "refused" in str(raised)
                assert added <= count
            elif stop_after and stop_after <= count:
                assert added <= count and len(groups) >= min(stop_after, count)
            else:
                assert finished(out) and added == count, (added, count, kinds)
        script.clear()
        before = [f.received for f in fakes]
        assert finished(pool.generate_groups(requests(4 * replicas * concurrency), SAMPLING))
        assert all(f.received > b for f, b in zip(fakes, before)), [f.received for f in fakes]
        assert outstanding(pool) == [0] * replicas
    finally:
        for f in fakes:
            f.thaw()
            f.release()
        pool.close()
