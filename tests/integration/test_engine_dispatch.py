"""The engine pool's dispatch (issue 30, items 4, 5 and 10) against simulated vLLM servers
(`trainingrun.engines.simulated`: the same HTTP API, a KV cache that queues and preempts, a prefix cache, vLLM's
/metrics, injectable engine errors):

  * the simulated engine's model: KV capacity and queueing, preemption, prefix-cache hits on shared prefixes, the
    metrics under vLLM's names, read back by the vLLM adapter;
  * sticky routing: a request goes to the replica of its affinity's previous request (more prefix-cache hits than
    least-loaded dispatch), follows its episode elsewhere when that replica is out, and at its replica's limit waits
    `sticky_wait` for room, then goes elsewhere;
  * adaptive concurrency: the limit trims below the start where the KV cache is the limit, grows where there is room,
    and a fixed limit never moves;
  * the per-engine counts (prefix hits, requests in flight, limit) through a generated rollout to its stats and the
    rollout's Prometheus metrics;
  * engine errors: the same error from every replica ends the call within seconds (DeterministicEngineError naming
    the engines and the error), one healthy replica serves everything, one replica failing the same way each time it
    comes back ends it after FAULT_REPEATS; the rollout exits 78 with the engine's message;
  * the launcher's side: a server that is up but no longer serves is killed and reported with its log's error, and a
    replica that fails with the same error after its restart ends the run (exit 78) naming it.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.integration.test_local_launcher import FAKE_VLLM_HEALTH
from tests.simengine import SimProcess, publish_disk_version
from trainingrun.contract.engine import DeterministicEngineError, GroupRequest, Sampling
from trainingrun.engines import pool as pool_mod
from trainingrun.engines.simulated import SimConfig, SimulatedServer
from trainingrun.engines.vllm.client import VLLMClient
from trainingrun.engines.vllm.engine import VLLMEngine, VLLMReplica, make_clients
from trainingrun.store import open_store

ROOT = Path(__file__).resolve().parents[2]
SAMPLING = Sampling(temperature=1.0, max_new_tokens=64, stop_token_ids=(2,), seed=1)


@pytest.fixture
def store(tmp_path: Path):
    s = open_store(f"file://{tmp_path / 'store'}")
    publish_disk_version(s, tmp_path / "weights", 0)
    yield s
    s.close()


def make_pool(urls, store, **kw) -> VLLMEngine:
    kw.setdefault("concurrency", 8)
    kw.setdefault("restart_timeout", 60)
    pool = VLLMEngine(make_clients(urls, timeout=60), fetch=lambda v: store.read_weights(v)[1], seeded=True,
                      say=kw.pop("say", lambda m: None), **kw)
    pool.load_weights(0)
    return pool


def stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/sim_stats", timeout=10) as r:
        return json.loads(r.read())


def servers(count: int, **cfg) -> list[SimulatedServer]:
    return [SimulatedServer(SimConfig(**{"token_seconds": 0.002, "median_tokens": 12, "vocab": 64, **cfg})).start()
            for _ in range(count)]


# ------------------------------------------------------------------------------------------------ the simulated engine
def test_the_simulated_engine_queues_what_its_kv_cache_cannot_hold_and_preempts_when_it_overflows():
    """KV capacity 600 tokens; 12 requests of a 100-token prompt and 60 new tokens each (1 sample): at most 5 fit
    their prompts at once, the rest wait (vllm:num_requests_waiting), and growing sequences preempt the newest."""
    with SimulatedServer(SimConfig(token_seconds=0.01, median_tokens=60, length_sigma=0.0, kv_tokens=600,
                                   vocab=64)) as server:
        client = VLLMClient(server.url, timeout=60)
        seen: list = []
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                seen.append(VLLMReplica(client).signals(timeout=5))
                time.sleep(0.02)

        t = threading.Thread(target=watch)
        t.start()
        threads = [threading.Thread(target=client.complete, args=([3 + i] * 100,),
                                    kwargs=dict(n=1, max_tokens=60, seed=i)) for i in range(12)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        stop.set()
        t.join()
        st = stats(server.url)
    assert st["served"] == 12 and st["generated_tokens"] >= 12 * 60
    assert st["max_busy"] <= 5, st  # 6 × 100 prompt tokens + a token each would not fit 600
    assert st["preemptions"] >= 1, st  # 5 × (100 + growing) overflows 600 before they finish
    assert max(s.waiting for s in seen) >= 7 and max(s.kv_usage for s in seen) > 0.8
    assert all(s.kv_usage <= 1.0 + 1e-9 for s in seen)


def test_the_prefix_cache_hits_shared_prefixes_and_is_cleared_by_a_reset():
    with SimulatedServer(SimConfig(token_seconds=0.001, median_tokens=4, vocab=64)) as server:
        client = VLLMClient(server.url, timeout=60)
        shared = list(range(3, 3 + 40))  # 2 full blocks of 16 + 8 tokens
        client.complete(shared + [50, 51], n=1, max_tokens=4, seed=1)
        before = VLLMReplica(client).signals(timeout=5)
        client.complete(shared + [60, 61, 62], n=1, max_tokens=4, seed=2)
        after = VLLMReplica(client).signals(timeout=5)
        assert after.prefix_queries - before.prefix_queries == 43
        assert after.prefix_hits - before.prefix_hits == 32  # the two full blocks of the shared prefix
        # a turn that extends the previous one's prompt and completion hits them all (whole blocks)
        first = client.complete(shared, n=1, max_tokens=24, seed=3)[0]
        h0 = VLLMReplica(client).signals(timeout=5).prefix_hits
        client.complete(shared + first.token_ids + [9] * 8, n=1, max_tokens=4, seed=4)
        assert VLLMReplica(client).signals(timeout=5).prefix_hits - h0 == 16 * ((40 + len(first.token_ids)) // 16)
        client.reset_prefix_cache()
        h1 = VLLMReplica(client).signals(timeout=5).prefix_hits
        client.complete(shared, n=1, max_tokens=4, seed=5)
        assert VLLMReplica(client).signals(timeout=5).prefix_hits == h1
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total"):
        assert f'{name}{{engine="0",model_name="simulated"}}' in text, name


# ------------------------------------------------------------------------------------------------ sticky routing
# the episodes running at each turn: they end at different turns, so the running set changes (least-loaded dispatch
# then hands an episode to another replica as often as not)
RUNNING = [[i for i in range(12) if i % 3], [i for i in range(12) if i % 3 and i != 1],
           [i for i in range(12) if i % 3 and i not in (1, 4)], [i for i in range(12) if i % 3 == 2]]


def turns(pool, contexts: list[list[int]], keys, seed: int) -> None:
    """A turn of the episodes of RUNNING[t] each: its prompt is its context so far (completion and 20 more tokens
    appended after each turn)."""
    for t, running in enumerate(RUNNING):
        out = pool.generate([contexts[i] for i in running], 1,
                            Sampling(temperature=1.0, max_new_tokens=24, stop_token_ids=(2,), seed=seed + t),
                            affinities=[keys[i] for i in running] if keys else None)
        for i, (c,) in zip(running, out):
            contexts[i] = contexts[i] + [int(x) for x in c.tokens] + [5 + (i + t) % 50] * 20


def hit_rate(pool, before) -> float:
    after = pool.engine_counts()
    q = sum(after[k].prefix_queries - before[k].prefix_queries for k in after)
    return sum(after[k].prefix_hits - before[k].prefix_hits for k in after) / q


def test_sticky_requests_go_to_the_replica_of_their_previous_request(store):
    sims = servers(2)
    try:
        pool = make_pool([s.url for s in sims], store, concurrency=8)
        keys = [f"ep-{i}" for i in range(12)]
        contexts = [[3 + i] * 30 for i in range(12)]
        pool.generate(contexts, 1, SAMPLING, affinities=keys)
        homes = {k: pool.affinity.get(k) for k in keys}
        assert set(homes.values()) == {"engine-0", "engine-1"}
        served = [stats(s.url)["served"] for s in sims]
        before = pool.engine_counts()
        turns(pool, contexts, keys, seed=10)
        assert {k: pool.affinity.get(k) for k in keys} == homes  # every episode stayed on its replica
        per = collections_count(homes[keys[i]] for t in RUNNING for i in t)
        assert [stats(s.url)["served"] - n for s, n in zip(sims, served)] == [per["engine-0"], per["engine-1"]]
        sticky_rate = hit_rate(pool, before)
        pool.release(keys)
        assert len(pool.affinity) == 0
        # the same turns without affinities (fresh caches): least-loaded, so the conversations land where their cache
        # is not as often as not
        for s in sims:
            s.engine.reset_prefix_cache()
        pool.generate(contexts2 := [[3 + i] * 30 for i in range(12)], 1, SAMPLING)
        before = pool.engine_counts()
        turns(pool, contexts2, None, seed=10)
        spread_rate = hit_rate(pool, before)
        # a turn's prompt is its context so far (cached in whole blocks where it was served) and 20 new tokens
        print(f"prefix-cache hit rate: sticky {sticky_rate:.3f}, least-loaded {spread_rate:.3f}")
        assert sticky_rate > 0.55 and sticky_rate > spread_rate + 0.1, (sticky_rate, spread_rate)
        pool.close()
    finally:
        for s in sims:
            s.close()


def collections_count(items) -> dict[str, int]:
    out = {"engine-0": 0, "engine-1": 0}
    for x in items:
        out[x] += 1
    return out


def test_a_sticky_request_follows_its_episode_elsewhere_when_its_replica_is_out(store):
    sims = [SimProcess(token_seconds=0.002, median_tokens=8, vocab=64) for _ in range(2)]
    try:
        pool = make_pool([s.url for s in sims], store, concurrency=4, restart_timeout=30)
        keys = [f"ep-{i}" for i in range(6)]
        pool.generate([[3 + i] * 20 for i in range(6)], 1, SAMPLING, affinities=keys)
        on1 = [k for k in keys if pool.affinity.get(k) == "engine-1"]
        assert on1
        sims[1].kill()  # engine-1 is gone: its episodes continue on engine-0
        out = pool.generate([[3 + i] * 20 for i in range(6)], 1, SAMPLING, affinities=keys)
        assert all(len(g) == 1 and g[0].finished for g in out)
        assert all(pool.affinity.get(k) == "engine-0" for k in keys)
        pool.close()
    finally:
        for s in sims:
            s.close()


@pytest.mark.parametrize("wait,where", [(0.2, "elsewhere"), (30.0, "home")])
def test_at_its_limit_a_sticky_request_waits_for_room_then_goes_elsewhere(store, wait, where):
    """Limit 1 per replica; two requests of one episode in one call: the second finds the episode's replica busy
    with the first (~0.8 s), waits `sticky_wait` for room there, then goes to the other replica."""
    sims = servers(2, token_seconds=0.01, median_tokens=80, length_sigma=0.0)
    try:
        pool = make_pool([s.url for s in sims], store, concurrency=1, sticky_wait=wait)
        served = [stats(s.url)["served"] for s in sims]
        t0 = time.monotonic()
        out = pool.generate_groups([GroupRequest(prompt=[3, 4, 5], n=1, seed=1, affinity="ep"),
                                    GroupRequest(prompt=[3, 4, 6], n=1, seed=2, affinity="ep")],
                                   Sampling(max_new_tokens=80, stop_token_ids=(2,), seed=1))
        wall = time.monotonic() - t0
        assert all(g[0].finished for g in out)
        delta = [stats(s.url)["served"] - n for s, n in zip(sims, served)]
        if where == "home":  # both on the first request's replica, one after the other
            assert sorted(delta) == [0, 2] and wall >= 1.5, (delta, wall)
        else:
            assert delta == [1, 1] and wall < 1.5, (delta, wall)
        pool.close()
    finally:
        for s in sims:
            s.close()


# ------------------------------------------------------------------------------------------------ adaptive concurrency
def test_auto_trims_where_the_kv_cache_is_the_limit_and_grows_where_there_is_room(store):
    many = [GroupRequest(prompt=[3 + i % 50] * 48, n=1, seed=i) for i in range(240)]
    sampling = Sampling(max_new_tokens=40, stop_token_ids=(2,), seed=1)
    # KV for ~12 sequences of 48 + 40 tokens: the engine queues most of 64 requests
    with SimulatedServer(SimConfig(token_seconds=0.005, median_tokens=40, length_sigma=0.3, kv_tokens=1100,
                                   vocab=64)) as small:
        pool = make_pool([small.url], store, concurrency="auto")
        assert pool.engine_counts()["engine-0"].concurrency == pool_mod.DEFAULT_CONCURRENCY
        pool.generate_groups(many[:120], sampling)
        limit = pool.engine_counts()["engine-0"].concurrency
        assert pool_mod.AUTO_LOW <= limit < 40, limit
        pool.close()
    # no KV limit, 512 sequences at once: the limit grows past its start
    with SimulatedServer(SimConfig(token_seconds=0.02, median_tokens=40, length_sigma=0.3, max_batch=512,
                                   vocab=64)) as big:
        pool = make_pool([big.url], store, concurrency="auto")
        pool.generate_groups(many, sampling)
        assert pool.engine_counts()["engine-0"].concurrency > pool_mod.DEFAULT_CONCURRENCY
        assert stats(big.url)["max_busy"] > pool_mod.DEFAULT_CONCURRENCY
        pool.close()
        fixed = make_pool([big.url], store, concurrency=16)
        before = stats(big.url)["max_busy"]
        fixed.generate_groups(many[:64], sampling)
        assert fixed.engine_counts()["engine-0"].concurrency == 16
        fixed.close()
    assert before > 16  # (the fixed pool ran on the same server: its limit is what it kept in flight)


def test_a_fixed_limit_is_what_the_pool_keeps_in_flight(store):
    with SimulatedServer(SimConfig(token_seconds=0.005, median_tokens=20, max_batch=512, vocab=64)) as server:
        pool = make_pool([server.url], store, concurrency=6)
        t0 = time.monotonic()
        pool.generate_groups([GroupRequest(prompt=[3, 4], n=2, seed=i) for i in range(40)],
                             Sampling(max_new_tokens=40, stop_token_ids=(2,)))
        counts = pool.engine_counts()["engine-0"]
        assert stats(server.url)["max_busy"] <= 12 and counts.concurrency == 6
        assert 1.0 < counts.inflight <= 6.0 and counts.seconds <= time.monotonic() - t0 + 0.1
        pool.close()
    with pytest.raises(ValueError, match="concurrency"):
        make_pool(["http://127.0.0.1:1"], None, concurrency=0)


# ------------------------------------------------------------------------------------------------ what travels
def test_each_engines_share_of_a_rollout_reaches_its_stats_and_metrics(store):
    from trainingrun.metrics.rollout import RolloutMetrics
    from trainingrun.rollout.generate import GenerateStats

    sims = servers(2)
    try:
        pool = make_pool([s.url for s in sims], store, concurrency="auto")
        first = pool.engine_counts()
        pool.generate([[3] * 40 + [4 + i] for i in range(16)], 2, SAMPLING, affinities=[f"g{i}" for i in range(16)])
        share = {k: c.minus(first[k]) for k, c in pool.engine_counts().items()}
        assert set(share) == {"engine-0", "engine-1"}
        assert all(c.prefix_queries > 0 and c.seconds > 0 and c.inflight > 0 for c in share.values()), share
        assert sum(c.prefix_hits for c in share.values()) > 0  # the shared 40-token prefix
        metrics = RolloutMetrics("r")
        metrics.observe_generation(GenerateStats(engines=share), [])
        values = {(s.name, s.labels.get("engine")): s.value for m in metrics.registry.collect() for s in m.samples}
        for k, c in share.items():
            assert values[("trainingrun_rollout_engine_prefix_cache_queries_total", k)] == c.prefix_queries
            assert values[("trainingrun_rollout_engine_prefix_cache_hits_total", k)] == c.prefix_hits
            assert values[("trainingrun_rollout_engine_inflight", k)] == pytest.approx(c.inflight)
            assert values[("trainingrun_rollout_engine_concurrency", k)] == c.concurrency
        pool.close()
    finally:
        for s in sims:
            s.close()


# ------------------------------------------------------------------------------------------------ engine errors
BROKEN = "RuntimeError: Unsupported CPU attention configuration: head_dim=16"


def test_every_engine_failing_with_the_same_error_ends_the_call_at_once(store):
    sims = servers(2, fail=BROKEN)
    said: list[str] = []
    try:
        pool = make_pool([s.url for s in sims], store, say=said.append)
        t0 = time.monotonic()
        with pytest.raises(DeterministicEngineError) as err:
            pool.generate_groups([GroupRequest(prompt=[3, 4], n=2, seed=i) for i in range(8)], SAMPLING)
        assert time.monotonic() - t0 < 10
        msg = str(err.value)
        assert "every engine of the pool failed with the same error" in msg and BROKEN in msg
        assert "engine-0" in msg and "engine-1" in msg
        pool.close()
    finally:
        for s in sims:
            s.close()


def test_one_broken_engine_of_two_is_left_out_and_the_healthy_one_serves(store):
    """engine-0 fails every request with the same error and comes back each time (its /health and label answer):
    after FAULT_REPEATS returns it is left out of the pool for good; engine-1 serves everything, the run goes on."""
    healthy, broken = servers(1)[0], servers(1, fail=BROKEN)[0]
    said: list[str] = []
    try:
        pool = make_pool([broken.url, healthy.url], store, restart_timeout=5, say=said.append)
        requests = [GroupRequest(prompt=[3, 4], n=2, seed=i) for i in range(12)]
        calls = 0
        while not pool.replicas[0].broken and calls < 10:  # each call brings engine-0 back (its label is right)
            out = pool.generate_groups(requests, SAMPLING)
            assert all(c.finished for g in out for c in g)
            calls += 1
        assert pool.replicas[0].broken == BROKEN and not pool.replicas[0].live
        failed = stats(broken.url)["failed_requests"]
        assert failed >= pool_mod.FAULT_REPEATS + 1
        out = pool.generate_groups(requests, SAMPLING)  # left out: it gets no request any more
        assert stats(broken.url)["failed_requests"] == failed and stats(broken.url)["served"] == 0
        assert stats(healthy.url)["served"] == 12 * (calls + 1)
        assert any("left out of the pool" in m and BROKEN in m for m in said), said
        pool.load_weights(0)  # a load leaves it out too
        assert not pool.replicas[0].live
        pool.close()
    finally:
        healthy.close()
        broken.close()


def test_one_engine_failing_the_same_way_each_time_it_comes_back_ends_the_call(store):
    server = servers(1, fail=BROKEN)[0]  # answers /health and its label: recovered at once, then fails again
    try:
        pool = make_pool([server.url], store)
        with pytest.raises(DeterministicEngineError, match="each time it came back") as err:
            pool.generate_groups([GroupRequest(prompt=[3, 4], n=1, seed=1)], SAMPLING)
        assert BROKEN in str(err.value)
        assert stats(server.url)["failed_requests"] == pool_mod.FAULT_REPEATS + 1
        pool.close()
    finally:
        server.close()


def test_the_rollout_exits_78_naming_the_engines_error(tmp_path: Path, store, capsys, monkeypatch):
    """The rollout program (`trainingrun rollout`) over two broken engines: exit 78 at once, one line naming the
    engines' error (the failure policy then does not restart it)."""
    from trainingrun.rollout import main as rollout_main

    sims = servers(2, fail=BROKEN, median_tokens=4)
    try:
        spec = _rollout_spec(tmp_path, [s.url for s in sims])
        monkeypatch.setenv("TRAININGRUN_CONFIG", str(spec))
        monkeypatch.setenv("TRAININGRUN_STORE_URL", f"file://{tmp_path / 'store'}")
        t0 = time.monotonic()
        code = rollout_main.run(_args())
        assert code == 78 and time.monotonic() - t0 < 30
        err = capsys.readouterr().err
        assert "every engine of the pool failed with the same error" in err and BROKEN in err, err[-2000:]
    finally:
        for s in sims:
            s.close()


def _args():
    import argparse

    from trainingrun.rollout.main import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--max-wait", "30"])


def _rollout_spec(tmp_path: Path, urls: list[str]) -> Path:
    from tests.integration.test_engine_pool import TINY_LLAMA_CONFIG

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    doc = {"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "broken"},
           "spec": {"model": {"hf": str(model), "seqLength": 64},
                    "trainer": {"replicas": 1, "maxTokensPerGPU": 1024, "lossType": "ppo"},
                    "rollout": {"source": {"type": "generate", "generate": {
                        "prompts": {"type": "synthetic", "synthetic": {"task": "copy", "minLength": 2,
                                                                       "maxLength": 2}},
                        "sampling": {"maxNewTokens": 4}, "reward": {"type": "token_match"}}},
                        "engine": {"type": "vllm", "url": ",".join(urls)}, "samplesPerRollout": 8, "groupSize": 4,
                        "numRollouts": 1},
                    "weightSync": {"type": "disk"}, "metrics": {"enabled": False}}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


# ------------------------------------------------------------------------------------------------ the launcher's side
class _Server:
    """A stand-in of the launcher's engine server: a real process; /health scripted; a log with the engine's error."""

    def __init__(self, log_path: Path, health: list[bool]):
        self.url, self.log_path, self.health, self.starts = "http://127.0.0.1:1", log_path, health, 0
        self.proc = None
        self.killed = False

    @property
    def pid(self):
        return None if self.proc is None else self.proc.pid

    def start(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.starts += 1

    def healthy(self):
        return self.health.pop(0) if len(self.health) > 1 else self.health[0]

    def error(self):
        from trainingrun.engines.vllm.server import log_error

        return log_error(self.log_path.read_text())

    def kill(self):
        self.killed = True
        self.proc.kill()
        self.proc.wait()

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


def test_a_server_that_is_up_but_no_longer_serves_is_killed_and_reported_with_its_error(tmp_path, monkeypatch):
    from trainingrun.local import engine as local_engine
    from trainingrun.plan import EngineRole

    monkeypatch.setattr(local_engine, "LIVENESS_PERIOD", 0.0)
    monkeypatch.setattr(local_engine, "LIVENESS_SECONDS", 0.3)
    log = tmp_path / "engine-0.log"
    log.write_text("INFO starting\n(Worker pid=1) ERROR 12-03 [x.py:1] " + BROKEN + "\nINFO Waiting for background "
                   "tasks to complete.\n")
    server = _Server(log, [False, True, False])  # starting, then healthy, then never again

    class Kind:
        title = "vLLM"

        @staticmethod
        def local(spec, *, log_path, port):
            return server

    replica = local_engine.LocalEngine(None, tmp_path, EngineRole(type="vllm", replica=0), Kind)
    replica.start()
    try:
        assert replica.check() is None  # not healthy yet: still starting, not a failure
        assert replica.check() is None  # healthy
        t0 = time.monotonic()
        failure = None
        while failure is None and time.monotonic() - t0 < 10:
            failure = replica.check()
            time.sleep(0.05)
        assert failure is not None and server.killed and failure.role == "engine" and failure.rank == 0
        assert "stopped serving" in failure.description and BROKEN in failure.description
        assert replica.errors == [BROKEN] and replica.failed_again() == ""
        replica.restart_after(0)
        replica.check()  # started again
        server.health[:] = [True, False]
        assert replica.check() is None
        while (failure := replica.check()) is None:
            time.sleep(0.05)
        assert replica.failed_again() == BROKEN  # the same error after its restart: deterministic
    finally:
        server.close()


FAKE_VLLM = FAKE_VLLM_HEALTH + r'''

def engine_error():
    print("(Worker pid=1) ERROR 12-03 23:26:04 [multiproc_executor.py:1063] Traceback (most recent call last):",
          flush=True)
    print("(Worker pid=1) ERROR 12-03 23:26:04 [multiproc_executor.py:1063] RuntimeError: Unsupported CPU "
          "attention configuration: head_dim=16 isa=2 kv_cache_idx=0", flush=True)
    print("(EngineCore pid=2) ERROR 12-03 23:26:04 [core.py:1512] EngineCore encountered a fatal error.", flush=True)


stays = os.environ.get("FAKE_VLLM_STAYS")  # logs the error before it is healthy, then goes on answering /health
if stays:
    engine_error()
serve()
if stays:
    time.sleep(600)
time.sleep(1.0)
engine_error()
os._exit(0)
'''


def launch_with_fake_engine(tmp_path: Path, mode: str, failure_policy: dict, **env):
    """`trainingrun run` with stand-in rollout and trainers (test_local_launcher's FAKE_CHILD, `mode`) and a
    stand-in vLLM server (FAKE_VLLM) as the run's own engine."""
    from tests.integration.test_local_launcher import FAKE_CHILD, finish, vllm_run

    fake = tmp_path / "fake_child.py"
    fake.write_text(FAKE_CHILD)
    path, engine = vllm_run(tmp_path, FAKE_VLLM, failure_policy)
    out = tmp_path / "run"
    env = {**__import__("os").environ, "TRAININGRUN_CHILD_COMMAND": shlex.join([sys.executable, str(fake)]),
           "FAKE_MODE": mode, "TRAININGRUN_VLLM_PYTHON": str(engine), **env}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "trainingrun", "run", str(path), "--out", str(out),
                             "--grace-seconds", "1", "--progress-interval", "0.2", "--no-plot"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    code, stdout, stderr = finish(proc, timeout=120)
    return code, stdout + stderr, json.loads((out / "summary.json").read_text()), time.monotonic() - t0


def test_a_replica_failing_with_the_same_error_after_its_restart_ends_the_run_naming_it(tmp_path):
    """The run's own engine (a stand-in that logs vLLM's head-dim error and exits 0 a second after each start): the
    launcher restarts it once, sees the same error again and ends the run with exit 78 naming it, although the
    engine role's budget would allow more restarts."""
    code, log, summary, wall = launch_with_fake_engine(
        tmp_path, "sleep", {"maxRestarts": 0, "backoffSeconds": 0, "roles": {"engine": {"maxRestarts": 5}}})
    assert code == 78 and wall < 60, log[-4000:]
    reason = summary["failure"]["reason"]
    assert "engine-0 failed with the same error again after its restart" in reason, summary["failure"]
    assert "RuntimeError: Unsupported CPU attention configuration: head_dim=16" in reason
    assert summary["role_restarts"] == {"engine": 1}


def test_a_failed_rollout_is_reported_with_the_engines_own_error(tmp_path):
    """The rollout fails (as it does when its pool saw every engine fail: the engines' HTTP answers name no cause)
    while the run's own engine logged its error: the run's failure names the engine's error from its log."""
    code, log, summary, _ = launch_with_fake_engine(
        tmp_path, "rollout-always", {"maxRestarts": 0, "backoffSeconds": 0, "roles": {"rollout": {"maxRestarts": 0}}},
        FAKE_VLLM_STAYS="1")
    assert code == 1, log[-4000:]
    failure = summary["failure"]
    assert failure["process"] == "rollout", failure
    assert ("engine error (engine-0: RuntimeError: Unsupported CPU attention configuration: head_dim=16"
            in failure["reason"]), failure
