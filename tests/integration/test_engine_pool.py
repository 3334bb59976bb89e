"""The engine pool (`trainingrun.engines.pool`) of vLLM engines (`trainingrun.engines.vllm.engine.VLLMEngine`) against
simulated vLLM servers (`trainingrun.engines.simulated`: the same HTTP API and client path, a per-token latency,
long-tailed lengths, no model):
dispatch within the per-engine cap, the per-request ledger when an engine dies, restarts or stalls (every prompt
answered exactly once, seeded answers a function of the prompt and not of the engine), the version barrier (a
restarted engine loads the current version before it gets a request), abort with the tokens so far and their
continuation, weight sync to every engine, and the faults of the engine path (issue 20, item 7): a refused or
same-size-corrupted disk version, a load that takes long, a broadcast whose sender is gone, a stalled engine.

Servers that a test kills or stops run as processes of their own (`tests.simengine.SimProcess`); the others in a
thread of the test process. The real vLLM pool is tests/integration/test_vllm_pool.py.
"""

from __future__ import annotations

import collections
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.simengine import SimProcess, publish_disk_version, weights_file
from trainingrun.contract.engine import ABORTED, GroupRequest, Sampling
from trainingrun.store import open_store
from trainingrun.contract.engine import WeightsRefused
from trainingrun.engines import pool as engine_mod
from trainingrun.engines.vllm.client import VLLMClient
from trainingrun.engines.vllm.engine import VLLMEngine, make_clients
from trainingrun.engines.simulated import SimConfig, SimulatedServer

# the tiny test Llama's config.json (tests/tiny_llama.py): what the rollout resolves the model from
TINY_LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
                     "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "num_hidden_layers": 2, "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 2048,
                     "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
                     "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
SAMPLING = Sampling(temperature=1.0, max_new_tokens=200, stop_token_ids=(2,), seed=1)


@pytest.fixture
def store(tmp_path: Path):
    s = open_store(f"file://{tmp_path / 'store'}")
    yield s
    s.close()


@pytest.fixture
def versions(store, tmp_path: Path):
    """Publishes weight versions the way the disk publisher does; returns a publish(version) function."""
    return lambda v: publish_disk_version(store, tmp_path / "weights", v)


def make_pool(urls, store, said: list[str] | None = None, **kw) -> VLLMEngine:
    kw.setdefault("concurrency", 4)
    kw.setdefault("restart_timeout", 60)
    return VLLMEngine(make_clients(urls, timeout=60), fetch=lambda v: store.read_weights(v)[1], seeded=True,
                      say=(said.append if said is not None else lambda m: None), **kw)


def requests(count: int, n: int = 2) -> list[GroupRequest]:
    return [GroupRequest(prompt=[5, 6, 7, 3 + i % 500], n=n, seed=1000 + i) for i in range(count)]


def tokens_of(groups) -> list[list[list[int]]]:
    return [[c.tokens.tolist() for c in g] for g in groups]


def test_dispatch_uses_every_engine_within_its_cap(store, versions):
    versions(0)
    servers = [SimulatedServer(SimConfig(token_seconds=0.002, median_tokens=30)).start() for _ in range(2)]
    try:
        pool = make_pool([s.url for s in servers], store, concurrency=3)
        pool.load_weights(0)
        out = pool.generate_groups(requests(40, n=2), SAMPLING)
        assert len(out) == 40 and all(len(g) == 2 and all(c.finished for c in g) for g in out)
        served = [s.engine.served for s in servers]
        assert sum(served) == 40 and min(served) >= 10, served  # least outstanding: both engines kept busy
        assert all(s.engine.max_busy <= 3 * 2 for s in servers)  # at most `concurrency` requests (of n=2) each
        assert pool.served() == {"engine-0": served[0], "engine-1": served[1]}
        assert all(set(s.engine.served_by_label) == {"v0"} for s in servers)
        pool.close()
    finally:
        for s in servers:
            s.close()


def test_a_dead_engine_is_replaced_by_the_others_and_restarted_it_loads_the_version_before_it_serves(
        store, versions, tmp_path: Path):
    """engine-1 is killed mid-call and started again on its port (as the launcher does): exactly its unanswered
    requests go to engine-0, every request is answered once, the answers are those a single engine gives for the
    same seeds, and the restarted engine gets requests only after it loaded the pool's version."""
    versions(0)
    cfg = dict(token_seconds=0.01, median_tokens=40, length_sigma=0.5)
    reference_server = SimulatedServer(SimConfig(**cfg)).start()
    sims = [SimProcess(**cfg), SimProcess(**cfg)]
    said: list[str] = []
    try:
        ref = make_pool([reference_server.url], store)
        ref.load_weights(0)
        want = ref.generate_groups(requests(32), SAMPLING)
        expected = tokens_of(want)
        pool = make_pool([s.url for s in sims], store, said)
        pool.load_weights(0)
        reported = collections.Counter()

        def on_group(i, comps):
            reported[i] += 1
            if sum(reported.values()) == 4:
                sims[1].kill()
                sims[1].start()  # back on the same port, with vLLM's initial label and no weights of ours
            return False

        out = pool.generate_groups(requests(32), SAMPLING, on_group=on_group)
        assert sorted(reported) == list(range(32)) and set(reported.values()) == {1}, reported
        assert tokens_of(out) == expected, "a re-sent request must answer as it would have on any engine"
        assert pool.stats["retried_prompts"] >= 1 and pool.stats["recoveries"] >= 1
        # the version barrier: no answer of the restarted engine's initial weights is kept (a request it answered
        # before the pool saw the restart, as in CI once, is sent again: its log-probabilities are those of v0)
        for got, ref_group in zip(out, want):
            for a, b in zip(got, ref_group):
                assert np.array_equal(a.logprobs, b.logprobs), (sims[1].stats(), said)
        after = sims[1].stats()
        assert after["label"] == "v0" and after["loads"], after
        assert any("engine-1" in m and "taken out of the pool" in m for m in said), said
        assert any("engine-1" in m and "back in the pool" in m for m in said), said
        pool.close()
    finally:
        reference_server.close()
        for s in sims:
            s.close()


def test_answers_of_an_engine_that_restarted_between_two_probes_are_sent_again(store, versions):
    """Regression (issue 20): an engine back on its port with vLLM's initial weights between two probes (no request
    failed: a simulated server restarts in milliseconds) had its answers kept until the probe a second later, or the
    call raised at its end. Now an answer counts only once a probe sent after it finds the call's label: every answer
    engine-1 gave under the wrong weights is sent again, and the call returns exactly what one engine holding the
    version gives (tokens and log-probabilities)."""
    versions(0)
    versions(1)
    cfg = SimConfig(token_seconds=0.002, median_tokens=20, length_sigma=0.5)
    servers = [SimulatedServer(cfg).start() for _ in range(3)]
    said: list[str] = []
    try:
        ref = make_pool([servers[2].url], store)
        ref.load_weights(0)
        ref.load_weights(1)
        expected = ref.generate_groups(requests(40), SAMPLING)
        pool = make_pool(
            [s.url for s in servers[:2]], store, said, concurrency=2)
        pool.load_weights(0)
        pool.load_weights(1)
        reported = collections.Counter()
        engine1 = servers[1].engine

        class RestartAtNextAdmission(collections.deque):
            """engine-1's queue: once armed, the restart (initial label, initial weights) happens as the next request
            is admitted, under the engine's lock, so that request is answered under the wrong weights whatever the
            probes' timing (before, under load, a probe could see the restart before engine-1 admitted anything)."""
            armed = False

            def append(self, req):
                if self.armed:
                    self.armed = False
                    engine1.label, engine1.version_loaded = "default", 0
                    req.label = "default"
                super().append(req)

        with engine1.cond:
            engine1.waiting = RestartAtNextAdmission(engine1.waiting)

        def on_group(i, comps):
            reported[i] += 1
            if sum(reported.values()) == 4:  # a restart the pool does not see, at engine-1's next admission
                with engine1.cond:
                    engine1.waiting.armed = True
            return False

        out = pool.generate_groups(requests(40), SAMPLING, on_group=on_group)
        assert engine1.served_by_label.get("default", 0) >= 1, "the test must have engine-1 answer with wrong weights"
        assert sorted(reported) == list(range(40)) and set(reported.values()) == {1}, reported
        assert tokens_of(out) == tokens_of(expected)
        for got, want in zip(out, expected):
            for a, b in zip(got, want):
                assert np.array_equal(a.logprobs, b.logprobs), "an answer generated under the wrong weights was kept"
                assert a.versions.tolist() == [1] * len(a.tokens)
        assert any("engine-1" in m and "'default'" in m for m in said), said
        pool.close()
    finally:
        for s in servers:
            s.close()


def test_an_engine_that_dies_during_a_weight_load_does_not_hold_up_the_others(store, versions):
    """Regression (found in the 2-server vLLM acceptance run): engine-1 killed between two rollouts made the pool's
    load of the next version wait for engine-1's restart (176 s there) before anything was generated. Now the
    others load and serve; engine-1 is recovered in the background and comes back holding the pool's version."""
    versions(0)
    versions(1)
    cfg = dict(token_seconds=0.002, median_tokens=20)
    sims = [SimProcess(**cfg), SimProcess(**cfg)]
    said: list[str] = []
    try:
        pool = make_pool([s.url for s in sims], store, said)
        pool.load_weights(0)
        sims[1].kill()
        threading.Timer(6.0, sims[1].start).start()  # the launcher restarts it, after a while
        t0 = time.monotonic()
        pool.load_weights(1)
        out = pool.generate_groups(requests(8), SAMPLING)
        assert time.monotonic() - t0 < 5, "the load and the rollout went on without engine-1"
        assert pool.weight_version == 1 and all(c.finished for g in out for c in g)
        assert pool.served()["engine-1"] == 0
        deadline = time.monotonic() + 60
        while not any("engine-1" in m and "back in the pool" in m for m in said) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sims[1].stats()["label"] == "v1", said  # the version barrier: back with the pool's version
        pool.generate_groups(requests(16), SAMPLING)
        assert pool.served()["engine-1"] > 0
        pool.close()
    finally:
        for s in sims:
            s.close()


def test_a_stalled_engine_is_reported_and_its_requests_go_to_the_others(store, versions):
    """Regression (issue 20, item 7): a SIGSTOPped server cost up to the client's 600 s timeout per request and
    nothing was logged. Now the pool says which engine has not answered for stallSeconds and sends its requests to
    the others; its late answers (after SIGCONT) are dropped."""
    versions(0)
    sims = [SimProcess(token_seconds=0.01, median_tokens=30, length_sigma=0.3) for _ in range(2)]
    said: list[str] = []
    try:
        pool = make_pool([s.url for s in sims], store, said, stall_seconds=2)
        pool.load_weights(0)
        reported = collections.Counter()

        def on_group(i, comps):
            reported[i] += 1
            if sum(reported.values()) == 3:
                sims[1].pause()
            return False

        t0 = time.monotonic()
        out = pool.generate_groups(requests(24), SAMPLING, on_group=on_group)
        elapsed = time.monotonic() - t0
        assert elapsed < 30, elapsed
        assert sorted(reported) == list(range(24)) and set(reported.values()) == {1}
        assert all(c.finished for g in out for c in g)
        stalled = [m for m in said if "has not answered for" in m]
        assert stalled and "engine-1" in stalled[0] and sims[1].url in stalled[0], said
        assert pool.stats["stalls"] >= 1
        pool.close()
    finally:
        for s in sims:
            s.cont()
            s.close()


def test_abort_cuts_what_runs_keeps_the_tokens_so_far_and_continues_them(store, versions):
    versions(0)
    versions(1)
    server = SimulatedServer(SimConfig(token_seconds=0.002, median_tokens=60, length_sigma=1.2)).start()
    try:
        pool = make_pool([server.url], store, concurrency=64)
        pool.load_weights(0)
        reqs = requests(24, n=4)
        finished: list[int] = []
        t0 = time.monotonic()
        out = pool.generate_groups(reqs, Sampling(max_new_tokens=1000, stop_token_ids=(2,)),
                                   on_group=lambda i, c: finished.append(i) or len(finished) >= 8)
        assert time.monotonic() - t0 < 10
        cut = [i for i, g in enumerate(out) if any(c.finish_reason == ABORTED for c in g)]
        assert len(finished) == 8 and cut and not set(cut) & set(finished)
        assert any(len(c.tokens) > 0 for i in cut for c in out[i] if c.finish_reason == ABORTED), \
            "an abort keeps the tokens generated so far"
        assert server.engine.busy == 0 and not server.engine.paused  # nothing left running, resumed
        pool.load_weights(1)
        cont = pool.generate_groups([GroupRequest(reqs[i].prompt, 4, seed=reqs[i].seed, prefixes=tuple(out[i]))
                                     for i in cut], Sampling(max_new_tokens=1000, stop_token_ids=(2,)))
        for i, g in zip(cut, cont):
            for old, new in zip(out[i], g):
                assert new.finished and np.array_equal(new.tokens[: len(old.tokens)], old.tokens)
                assert np.array_equal(new.logprobs[: len(old.tokens)], old.logprobs)
                cont_version = 1 if old.finish_reason == ABORTED else 0
                assert new.versions.tolist() == [0] * len(old.tokens) + [cont_version] * (len(new.tokens)
                                                                                         - len(old.tokens))
        pool.close()
    finally:
        server.close()


def test_every_engine_loads_each_version_and_its_seconds_are_recorded(store, versions):
    servers = [SimulatedServer(SimConfig(load_seconds=0.05)).start() for _ in range(3)]
    try:
        pool = make_pool([s.url for s in servers], store)
        for v in (0, 1):
            meta = versions(v)
            pool.load_weights(v)
            assert pool.weight_version == v
            assert [VLLMClient(s.url).weight_version() for s in servers] == [f"v{v}"] * 3
            assert all(s.engine.loads[-1]["path"] == meta["path"] for s in servers)
            assert set(pool.last_sync) == {"engine-0", "engine-1", "engine-2"}
            assert all(x >= 0.05 for x in pool.last_sync.values()), pool.last_sync
        pool.close()
    finally:
        for s in servers:
            s.close()


def test_a_version_that_does_not_fit_the_engine_is_refused_before_the_pause(store, versions, tmp_path):
    """Issue 28 item 11: a committed version whose tensors are not the engine's model (here one shape differs) is
    refused, naming the tensor, by the check of the files' headers the engine makes BEFORE it is labelled "loading"
    and paused: the engines keep their version and generate on."""
    versions(0)
    meta = versions(1)
    weights_file(Path(meta["path"]), seed=1, shapes=((8, 4), (5,)))  # a layer of another size, same names
    servers = [SimulatedServer().start() for _ in range(2)]
    try:
        pool = make_pool([s.url for s in servers], store)
        pool.load_weights(0)
        labels = [VLLMClient(s.url).weight_version() for s in servers]
        with pytest.raises(WeightsRefused) as err:
            pool.load_weights(1)
        assert meta["path"] in str(err.value) and "model.layers.1.weight" in err.value.reason, err.value.reason
        assert [VLLMClient(s.url).weight_version() for s in servers] == labels  # never "loading:": never paused
        assert all(len(s.engine.loads) == 1 for s in servers)
        assert pool.weight_version == 0
        out = pool.generate_groups(requests(4), SAMPLING)
        assert all(c.finished for g in out for c in g)
        pool.close()
    finally:
        for s in servers:
            s.close()


@pytest.mark.parametrize("damage", ["truncated", "same-size corruption"])
def test_a_damaged_published_version_is_refused_naming_it(store, versions, damage):
    """Regression (issue 20, item 7): a truncated model.safetensors in a committed version was refused by the
    engine, but as a transient EngineUnavailable (retried, the group restarted in vain); a same-size corruption
    (zeroed bytes, names and shapes intact) loaded silently. Published versions carry their files' sizes and SHA-256
    (checked before anything is read as weights) and a refusal is `WeightsRefused` naming the directory and why."""
    versions(0)
    meta = versions(1)
    f = Path(meta["path"]) / "model.safetensors"
    data = bytearray(f.read_bytes())
    if damage == "truncated":
        f.write_bytes(bytes(data[: len(data) - 16]))
    else:
        data[-16:] = bytes(16)  # the last tensor's bytes zeroed: same size, same header
        f.write_bytes(bytes(data))
    servers = [SimulatedServer().start() for _ in range(2)]
    try:
        pool = make_pool([s.url for s in servers], store)
        pool.load_weights(0)
        with pytest.raises(WeightsRefused) as err:
            pool.load_weights(1)
        assert meta["path"] in str(err.value) and "engine-" in str(err.value)
        assert ("bytes" if damage == "truncated" else "SHA-256") in err.value.reason, err.value.reason
        assert pool.weight_version == 0
        assert all(not VLLMClient(s.url).weight_version().startswith("v1") for s in servers)
        assert all(len(s.engine.loads) == 1 for s in servers)  # nothing of version 1 was loaded
        pool.close()
    finally:
        for s in servers:
            s.close()


def test_a_long_load_says_the_engine_is_busy_loading(store, versions, monkeypatch):
    """The rollout no longer waits silently behind a load: it names the engine and since when it is loading."""
    versions(0)
    monkeypatch.setattr(engine_mod, "LOAD_REPORT_SECONDS", 0.5)
    server = SimulatedServer(SimConfig(load_seconds=1.5)).start()
    said: list[str] = []
    try:
        pool = make_pool([server.url], store, said)
        pool.load_weights(0)
        busy = [m for m in said if "busy loading weights since" in m]
        assert busy and busy[0].startswith("engine-0 (" + server.url), said
        pool.close()
    finally:
        server.close()


def test_a_broadcast_receiver_gives_up_on_a_dead_sender_within_its_connect_timeout():
    """Regression (issue 20, item 7): trainer 0 killed right after /pause, before the engine's worker connected: the
    worker's connect used the transfer's whole timeout (300-600 s, c10d retrying), and /weight_info, /pause and
    generation blocked behind it. The connect has a short timeout of its own now."""
    pytest.importorskip("torch")
    from trainingrun.engines.vllm.worker_ext import receive

    with socket.socket() as s:  # a port nobody listens on: the sender is gone
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    request = {"host": "127.0.0.1", "port": port, "group": "tr-x", "world_size": 2, "backend": "gloo",
               "timeout": 300, "connect_timeout": 3, "version": 1}
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="unreachable"):
        receive(request, rank=1, device="cpu")
    assert time.monotonic() - t0 < 30


def test_the_rollout_stops_at_once_naming_a_refused_version(tmp_path: Path, store, versions, capsys, monkeypatch):
    """`trainingrun rollout`: a refused version ends the rollout with exit 78 (no restart can help: a committed
    version never changes) and one line naming the directory and the reason — before, an uncaught
    EngineUnavailable (exit 1), and the group restarts spent the budget in seconds."""
    import argparse
    import json

    import yaml

    from trainingrun.contract.errors import EXIT_CONFIG_ERROR
    from trainingrun.rollout import main as rollout_main

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    meta = versions(0)
    f = Path(meta["path"]) / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-8])
    server = SimulatedServer().start()
    try:
        doc = {"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "r"},
               "spec": {"model": {"hf": str(model), "seqLength": 64},
                        "trainer": {"replicas": 1, "maxTokensPerGPU": 256, "lossType": "ppo"},
                        "rollout": {"source": {"type": "generate", "generate": {
                            "prompts": {"synthetic": {"task": "copy", "minLength": 1, "maxLength": 2}},
                            "sampling": {"maxNewTokens": 4}}},
                            "engine": {"type": "vllm", "url": server.url}, "samplesPerRollout": 8, "groupSize": 4},
                        "weightSync": {"type": "disk"}}}
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump(doc))
        monkeypatch.delenv("TRAININGRUN_ENGINE_URL", raising=False)
        code = rollout_main.run(argparse.Namespace(config=str(config), store=store.url, metrics_port=0, max_wait=30))
    finally:
        server.close()
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG_ERROR, err
    line = [x for x in err.splitlines() if "refused" in x]
    assert len(line) == 1 and meta["path"] in line[0] and "bytes" in line[0], err
