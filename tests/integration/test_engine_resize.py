"""The engine pool resized while the rollout runs (issue 32 item 3, the rollout's side): the pool re-reads its list
of servers before each call (`EnginePool(members=..., adapter_for=...)`; in a cluster the file the operator keeps up
to date, $TRAININGRUN_ENGINE_URL_FILE, read by `vllm.engine.read_urls`). Under the real `EnginePool` with the
in-memory `TimedReplica`s of test_engine_slots.py: an added server loads the pool's current version before it gets
a request; a removed one leaves between calls and gets nothing more; no prompt is lost or answered twice.
"""

from __future__ import annotations

import threading

from tests.integration.test_engine_slots import (  # noqa: F401 - fast: the fixture
    SAMPLING, TimedReplica, fast, finished, requests, wait_until,
)
from trainingrun.engines.pool import EnginePool
from trainingrun.engines.vllm.engine import read_urls


def resizable(names: list[str], said: list[str]) -> tuple[EnginePool, dict[str, TimedReplica], list[str]]:
    """A pool over `names`, reading its list from a list the test edits; every adapter ever made, by URL."""
    made = {f"timed://{n}": TimedReplica(n) for n in names}
    listed = [f"timed://{n}" for n in names]

    def adapter_for(url: str) -> TimedReplica:
        made.setdefault(url, TimedReplica(url.removeprefix("timed://")))
        return made[url]

    pool = EnginePool([made[u] for u in listed], fetch=lambda v: {"version": v}, concurrency=4, stall_seconds=5,
                      restart_timeout=30, say=said.append, members=lambda: list(listed), adapter_for=adapter_for)
    pool.load_weights(0)
    return pool, made, listed


def test_an_added_server_loads_the_current_version_before_its_first_request(fast):
    said: list[str] = []
    pool, made, listed = resizable(["a", "b"], said)
    pool.load_weights(1)
    listed.append("timed://c")
    gate = threading.Semaphore(0)
    made.setdefault("timed://c", TimedReplica("c")).load_gate = gate  # its load waits for the test
    out = pool.generate_groups(requests(12), SAMPLING)
    c = made["timed://c"]
    assert finished(out) and len(out) == 12
    wait_until(lambda: c.loads == [1], 10, "engine-2 loading version 1")
    assert [r.url for r in pool.replicas] == listed and c.received == 0  # still loading: no request
    assert any("resized from 2 to 3" in m for m in said), said
    gate.release()
    wait_until(lambda: pool.replicas[2].live, 10, "engine-2 live once it holds version 1")
    assert c.label_now == pool.label(1)
    out = pool.generate_groups(requests(24, first=12), SAMPLING)
    assert finished(out) and c.received > 0
    assert pool.replicas[2].name == "engine-2"


def test_a_removed_server_leaves_between_calls_and_gets_nothing_more(fast):
    said: list[str] = []
    pool, made, listed = resizable(["a", "b", "c"], said)
    out = pool.generate_groups(requests(12), SAMPLING)
    assert finished(out) and made["timed://c"].received > 0
    del listed[1:]
    before = {u: r.received for u, r in made.items()}
    out = pool.generate_groups(requests(12, first=12), SAMPLING)
    assert finished(out) and len(out) == 12  # every prompt answered once, by the server left
    assert [r.url for r in pool.replicas] == ["timed://a"]
    assert made["timed://b"].received == before["timed://b"] and made["timed://c"].received == before["timed://c"]
    assert made["timed://a"].received == before["timed://a"] + 12
    pool.load_weights(1)  # loads go to the servers of the pool only
    assert made["timed://a"].loads == [0, 1] and made["timed://b"].loads == [0]


def test_a_server_removed_then_added_again_keeps_its_name_and_counters(fast):
    """3 -> 1 -> 3 with the same URLs (the operator's are stable per replica): the servers come back as the same
    replicas, so a rollout's share of each one's counters (a difference of two readings) never goes negative."""
    said: list[str] = []
    pool, made, listed = resizable(["a", "b", "c"], said)
    pool.generate_groups(requests(12), SAMPLING)
    before = pool.engine_counts()
    b = pool.replicas[1]
    full = list(listed)
    del listed[1:]
    pool.generate_groups(requests(6, first=12), SAMPLING)
    pool.load_weights(1)  # while b and c are out
    listed[:] = full
    pool.generate_groups(requests(6, first=18), SAMPLING)
    wait_until(lambda: all(r.live for r in pool.replicas), 10, "every server back in the pool")
    assert [r.name for r in pool.replicas] == ["engine-0", "engine-1", "engine-2"] and pool.replicas[1] is b
    out = pool.generate_groups(requests(12, first=24), SAMPLING)
    assert finished(out)
    after = pool.engine_counts()
    assert all(after[n].minus(before[n]).seconds >= 0 for n in before)
    assert made["timed://b"].loads == [0, 1] and made["timed://a"].loads == [0, 1]  # the version moved on: loaded


def test_read_urls_follows_the_operators_file(tmp_path):
    path = tmp_path / "engines"
    assert read_urls(str(path)) is None  # not there (yet): the pool keeps its servers
    path.write_text("http://engine-0.r-engine.ns.svc:8000\n\nhttp://engine-1.r-engine.ns.svc:8000/\n")
    assert read_urls(str(path)) == ["http://engine-0.r-engine.ns.svc:8000", "http://engine-1.r-engine.ns.svc:8000"]


def test_vllm_pool_follows_its_file_over_http(tmp_path):
    """The vLLM engine over simulated vLLM servers (the same HTTP API and client path, no model), its list of
    servers in a file as the operator keeps it: a server added gets requests only under the pool's current weight
    version (never under its initial label); a server removed gets nothing more; every prompt answered once."""
    from tests.simengine import publish_disk_version
    from trainingrun.engines.simulated import SimConfig, SimulatedServer
    from trainingrun.engines.vllm.client import VLLMClient
    from trainingrun.engines.vllm.engine import VLLMEngine, VLLMReplica, make_clients
    from trainingrun.contract.engine import GroupRequest, Sampling
    from trainingrun.store import open_store

    store = open_store(f"file://{tmp_path / 'store'}")
    for v in (0, 1):
        publish_disk_version(store, tmp_path / "weights", v)
    servers = [SimulatedServer(SimConfig(token_seconds=0.001, median_tokens=20)).start() for _ in range(3)]
    listed = tmp_path / "engines"
    urls = [s.url.rstrip("/") for s in servers]
    sampling = Sampling(temperature=1.0, max_new_tokens=50, stop_token_ids=(2,), seed=1)
    reqs = [GroupRequest(prompt=[5, 6, 7, 3 + i], n=2, seed=1000 + i) for i in range(24)]
    try:
        listed.write_text("".join(f"{u}\n" for u in urls[:2]))
        pool = VLLMEngine(make_clients(urls[:2], timeout=60), fetch=lambda v: store.read_weights(v)[1],
                          concurrency=4, restart_timeout=60, say=lambda m: None,
                          members=lambda: read_urls(str(listed)),
                          adapter_for=lambda u: VLLMReplica(VLLMClient(u, timeout=60)))
        pool.load_weights(0)
        assert all(len(g) == 2 for g in pool.generate_groups(reqs, sampling))
        pool.load_weights(1)
        listed.write_text("".join(f"{u}\n" for u in urls))  # 2 -> 3
        out = pool.generate_groups(reqs, sampling)
        assert len(out) == 24 and all(len(g) == 2 and all(c.finished for c in g) for g in out)
        wait_until(lambda: len(pool.replicas) == 3 and pool.replicas[2].live, 30, "engine-2 in the pool")
        out = pool.generate_groups(reqs, sampling)
        assert len(out) == 24 and all(len(g) == 2 and all(c.finished for c in g) for g in out)
        added = servers[2].engine.served_by_label
        assert set(added) == {"v1"} and sum(added.values()) > 0, added  # only ever under the current version
        listed.write_text(f"{urls[0]}\n")  # 3 -> 1
        before = [s.engine.served for s in servers]
        out = pool.generate_groups(reqs, sampling)
        assert len(out) == 24 and all(len(g) == 2 and all(c.finished for c in g) for g in out)
        after = [s.engine.served for s in servers]
        assert after[1:] == before[1:] and after[0] == before[0] + 24, (before, after)
        assert [r.url for r in pool.replicas] == urls[:1]
        pool.close()
    finally:
        for s in servers:
            s.close()
        store.close()


def test_a_server_added_while_the_pool_version_is_released_joins_with_the_next(fast, monkeypatch):
    """Regression (seen in the local 1 -> 2 -> 1 run on vLLM): the list is re-read at the start of load_weights(v + 1),
    so an added server's join began loading the pool's version v, which the trainers had already released (lag 0
    keeps the newest): the fetch raised StoreError, the join thread died with a traceback and the server joined only
    at the next call. Now a failed fetch is retried like an unavailable server, and it joins holding v + 1."""
    crashed: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashed.append(args.exc_value))
    said: list[str] = []
    pool, made, listed = resizable(["a"], said)
    released = {0}

    def fetch(v):
        if v in released:
            raise KeyError(f"weight version {v} is not committed")
        return {"version": v}

    pool.fetch = fetch
    listed.append("timed://b")
    pool.load_weights(1)
    wait_until(lambda: len(pool.replicas) == 2 and pool.replicas[1].live, 10, "engine-1 live holding version 1")
    assert crashed == [] and made["timed://b"].loads == [1] and made["timed://b"].label_now == pool.label(1)
    out = pool.generate_groups(requests(12), SAMPLING)
    assert finished(out) and made["timed://b"].received > 0
