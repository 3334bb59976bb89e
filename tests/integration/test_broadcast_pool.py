"""The broadcast weight sync to a pool (issue 28 item 2): one transfer for the pool's engines, each bucket sent once by
trainer rank 0 (a chain through the engines' workers, gloo); a member killed mid-transfer is dropped and the others
load the version (those after it in the chain in transfers of their own); an engine that asks late is served alone
without holding up the others. A real `BroadcastSender` (TCPStore + gloo groups on 127.0.0.1), real pools
(`VLLMEngine`) of simulated vLLM servers whose `trainingrun_receive_weights` is the worker extension's own `receive`.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.simengine import SimProcess
from trainingrun.engines.simulated import SimConfig, SimulatedServer
from trainingrun.engines.vllm.broadcast import BroadcastSender, ShardServer, new_group_name
from trainingrun.engines.vllm.client import VLLMClient
from trainingrun.engines.vllm.engine import VLLMEngine, make_clients
from trainingrun.engines.vllm.publish import commit_version
from trainingrun.engines.vllm.worker_ext import receive
from trainingrun.store import open_store


@pytest.fixture
def store(tmp_path: Path):
    s = open_store(f"file://{tmp_path / 'store'}")
    yield s
    s.close()


def _named(elements: int, parts: int = 4) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(f"layer{i}.weight", torch.randn(elements // parts, generator=g)) for i in range(parts)]


def _publish(store, sender: BroadcastSender, version: int, named) -> int:
    snap = sender.set_weights(version, named)
    commit_version(store, version, {"method": "broadcast", "host": "127.0.0.1", "port": sender.port,
                                    "backend": "gloo", "bytes": snap.nbytes, "dtype": "float32"})
    return snap.nbytes


def _served(sender: BroadcastSender, count: int) -> None:
    """Wait (bounded) until the sender counted `count` transfers served or failed: it counts after the last answer."""
    t0 = time.monotonic()
    while sender.transfers + sender.failures < count and time.monotonic() - t0 < 30:
        time.sleep(0.02)


def _pool(urls, store, said: list[str]) -> VLLMEngine:
    return VLLMEngine(make_clients(urls, timeout=60), fetch=lambda v: store.read_weights(v)[1], seeded=True,
                      concurrency=4, restart_timeout=60, load_timeout=60, say=said.append)


@pytest.mark.parametrize("engines", [1, 4])
def test_one_transfer_for_the_pool_sends_each_bucket_once(store, engines):
    sender = BroadcastSender(0, host="127.0.0.1", timeout=60, dtype=None, bucket_bytes=1 << 20,
                             chunk_bytes=256 << 10).start()
    servers = [SimulatedServer(SimConfig(load_seconds=0.0)).start() for _ in range(engines)]
    try:
        nbytes = _publish(store, sender, 0, _named(1 << 20))  # 4 MiB of fp32 in 4 buckets
        pool = _pool([s.url for s in servers], store, [])
        pool.load_weights(0)
        assert [VLLMClient(s.url).weight_version() for s in servers] == ["v0"] * engines
        transfers = {s.engine.loads[-1]["transfer"] for s in servers}
        assert len(transfers) == 1, transfers  # one group for the whole pool
        _served(sender, 1)
        assert sender.transfers == 1 and sender.last["engines"] == engines and not sender.last["dropped"]
        assert sender.bytes_sent == nbytes, (sender.bytes_sent, nbytes)  # each bucket once, whatever the pool
        pool.close()
    finally:
        for s in servers:
            s.close()
        sender.close()


def test_a_member_killed_mid_transfer_is_dropped_and_the_others_load_the_version(store):
    sender = BroadcastSender(0, host="127.0.0.1", timeout=60, dtype=None, bucket_bytes=8 << 20,
                             chunk_bytes=32 << 10).start()
    procs = [SimProcess(load_seconds=0.0) for _ in range(3)]
    said: list[str] = []
    try:
        _publish(store, sender, 0, _named(12 << 20))  # 48 MiB: ~1,500 chunks through the chain
        pool = _pool([p.url for p in procs], store, said)
        done = threading.Event()
        loader = threading.Thread(target=lambda: (pool.load_weights(0), done.set()), daemon=True)
        loader.start()
        t0 = time.monotonic()
        while (sender.sending is None or sender.sending.bytes < (4 << 20)) and time.monotonic() - t0 < 60:
            time.sleep(0.002)
        assert sender.sending is not None and sender.sending.bytes < 48 << 20, "the transfer never started"
        procs[1].kill()  # mid-transfer
        loader.join(120)
        assert done.is_set(), "load_weights did not return"
        assert pool.weight_version == 0
        _served(sender, 1)
        for i in (0, 2):
            assert VLLMClient(procs[i].url).weight_version() == "v0"
            loads = procs[i].stats()["loads"]
            assert loads[-1]["version"] == 0
        # the pool's transfer lost a member: it was dropped (and the members after it loaded in transfers of their own)
        assert sender.dropped >= 1, (sender.dropped, said)
        assert any("engine-1" in m for m in said), said  # taken out of the pool, recovered in the background
        pool.close()
    finally:
        for p in procs:
            p.close()
        sender.close()


def _request(sender: BroadcastSender, joint: dict) -> dict:
    return {"host": "127.0.0.1", "port": sender.port, "group": new_group_name(), "world_size": 2, "backend": "gloo",
            "timeout": 30, "connect_timeout": 10, "version": 3, "joint": joint}


def test_an_engine_that_asks_late_catches_up_alone_without_stalling_the_others():
    sender = BroadcastSender(0, host="127.0.0.1", timeout=30, dtype=None, bucket_bytes=1 << 20,
                             join_window=1.0).start()
    try:
        named = _named(1 << 18)
        nbytes = sender.set_weights(3, named).nbytes
        joint = {"id": "sync-3", "members": 3}  # the pool announced 3; the third asks only after the others loaded
        got: dict[str, tuple] = {}

        def engine(name: str) -> None:
            t0 = time.monotonic()
            manifest, tensors, st = receive(_request(sender, joint), rank=1, device="cpu")
            st.set(manifest["done_key"], "ok")
            got[name] = (manifest["transfer"]["group"], time.monotonic() - t0, tensors)

        first = [threading.Thread(target=engine, args=(f"e{i}",)) for i in range(2)]
        for t in first:
            t.start()
        for t in first:
            t.join(30)
        engine("late")
        assert set(got) == {"e0", "e1", "late"}
        assert got["e0"][0] == got["e1"][0] != got["late"][0]  # the two together, the late one alone
        assert max(got["e0"][1], got["e1"][1]) < 1.0 + 10  # held up at most the join window (+ a loaded machine)
        for _, _, tensors in got.values():
            assert all(torch.equal(t, want) for (_, t), (_, want) in zip(tensors, named))
        _served(sender, 2)
        assert sender.transfers == 2 and sender.bytes_sent == 2 * nbytes
        assert json.dumps(sender.last["engines"]) == "1"
    finally:
        sender.close()


@pytest.mark.parametrize("split", ["halves", "owner1-empty", "owner0-empty"])
def test_a_sharded_version_is_sent_by_its_owners_and_arrives_whole(split):
    """Item 3: two owner ranks each hold part of the buckets in host memory (rank 0's `BroadcastSender`, owner 1's
    `ShardServer`, as the TP ranks or the pipeline stages of replica 0 do); one transfer to two engines: each owner
    sends only its own buckets, every engine gets the whole model bit-exact. Also when one owner holds no bucket at
    all (a TP rank of a stage with a single bucket): it joins the transfer and sends nothing."""
    named = _named(1 << 20, parts=8)  # 4 MiB of fp32, 8 tensors of 512 KiB: a bucket each
    halves = {"halves": [named[0::2], named[1::2]], "owner1-empty": [named, []], "owner0-empty": [[], named]}[split]
    sender = BroadcastSender(0, host="127.0.0.1", timeout=60, dtype=None, bucket_bytes=512 << 10, owners=2).start()
    owner = ShardServer("127.0.0.1", sender.port, owner=1, owners=2, timeout=60, dtype=None,
                        bucket_bytes=512 << 10).start()
    try:
        parts = [sender.set_weights(4, halves[0]), owner.set_weights(4, halves[1])]
        held = [sum(t.numel() * t.element_size() for _, t in h) for h in halves]
        assert [p.nbytes for p in parts] == held  # each owner holds its own part, not the whole model
        assert sum(p["bytes"] for p in sender.parts(4)) == 4 << 20
        joint = {"id": "sync-4", "members": 2}
        got: dict[str, list] = {}

        def engine(name: str) -> None:
            req = dict(_request(sender, joint), version=4)
            manifest, tensors, st = receive(req, rank=1, device="cpu")
            st.set(manifest["done_key"], "ok")
            got[name] = tensors

        threads = [threading.Thread(target=engine, args=(f"e{i}",)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        _served(sender, 1)
        want = dict(named)
        for tensors in got.values():
            assert sorted(n for n, _ in tensors) == sorted(want)
            assert all(torch.equal(t, want[n]) for n, t in tensors)
        assert len(got) == 2 and sender.transfers == 1 and sender.last["engines"] == 2
        assert [sender.bytes_sent, owner.bytes_sent] == held  # each its own part, once
    finally:
        owner.close()
        sender.close()


@pytest.mark.parametrize("released", ["packed-next", "while-served"])
def test_an_owner_that_no_longer_holds_the_version_fails_the_transfer_at_once(released):
    """An owner that already let the requested version go (a pipeline stage or TP rank that packed the next version
    before rank 0 did, while a late engine asks for the one before) fails the transfer at once, naming the owner,
    and the next version loads. Before, rank 0 — serving one transfer at a time — and the engine waited: for the
    released part to appear (`assemble`: up to the timeout, 60 s at most), or, where the owner let it go after rank
    0 assembled the manifest ("while-served"), for the group's whole timeout (the owner answered only in its "done"
    key and never joined the group)."""
    named = _named(1 << 18, parts=4)
    kw = dict(timeout=15, dtype=None, bucket_bytes=256 << 10)
    sender = BroadcastSender(0, host="127.0.0.1", owners=2, **kw).start()
    owner = ShardServer("127.0.0.1", sender.port, owner=1, owners=2, **kw).start()
    try:
        sender.set_weights(4, named[:2])
        owner.set_weights(4, named[2:])
        assert len(sender.parts(4)) == 2
        if released == "packed-next":
            owner.set_weights(5, named[2:])  # owner 1 packed version 5 first: 4 is let go (keep_versions 1)
        else:  # gone from owner 1's memory, its part's manifest not yet removed from rank 0's store
            with owner._lock:
                del owner._snapshots[4]
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"version 4\b.*trainer owners\W+1\b"):
            receive(dict(_request(sender, None), version=4), rank=1, device="cpu")
        assert time.monotonic() - t0 < 8, "the engine waited for a timeout"
        _served(sender, 1)
        assert sender.failures == 1 and owner.failures == (released == "while-served") and sender.transfers == 0
        if 5 not in owner.versions:
            owner.set_weights(5, named[2:])
        sender.set_weights(5, named[:2])
        manifest, tensors, st = receive(dict(_request(sender, None), version=5), rank=1, device="cpu")
        st.set(manifest["done_key"], "ok")
        want = dict(named)
        assert sorted(n for n, _ in tensors) == sorted(want) and all(torch.equal(t, want[n]) for n, t in tensors)
    finally:
        owner.close()
        sender.close()
