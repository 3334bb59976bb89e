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


def test_a_worker_whose_transfer_group_cannot_form_answers_failed():
    """Regression (issue 28 item 2): a worker whose transfer group could not form (seen: gloo's connectFullMesh,
    "Connection closed by peer") raised without answering, so the sender would wait for its answer the transfer's
    whole timeout. It answers "failed" now, as for a transfer cut later, and the engine loads again."""
    from datetime import timedelta

    import torch.distributed as dist

    from trainingrun.engines.vllm.worker_ext import DONE_KEY, MANIFEST_KEY

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    group = new_group_name()
    # a sender that announced a transfer to itself and this worker, and never joins the group
    master.set(MANIFEST_KEY.format(group=group), json.dumps(
        {"version": 0, "tensors": [["w", "float32", [4], 0]], "buckets": [["float32", 4]], "bytes": 16}))
    request = {"host": "127.0.0.1", "port": master.port, "group": group, "world_size": 2, "backend": "gloo",
               "timeout": 3, "connect_timeout": 3, "version": 0}
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        receive(request, rank=1, device="cpu")
    assert time.monotonic() - t0 < 30
    done = DONE_KEY.format(group=group, rank=1)
    assert master.check([done]) and master.get(done) == b"failed"


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


def _llama_like(layers: int = 2, hidden: int = 64, vocab: int = 200) -> list[tuple[str, torch.Tensor]]:
    """HF-named tensors of a small Llama (4 heads, 2 KV heads, vocabulary 200: padded to 256 by vLLM)."""
    g = torch.Generator().manual_seed(11)
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "self_attn.q_proj.weight": (hidden, hidden),
                       p + "self_attn.k_proj.weight": (hidden // 2, hidden),
                       p + "self_attn.v_proj.weight": (hidden // 2, hidden),
                       p + "self_attn.o_proj.weight": (hidden, hidden),
                       p + "post_attention_layernorm.weight": (hidden,),
                       p + "mlp.gate_proj.weight": (2 * hidden, hidden), p + "mlp.up_proj.weight": (2 * hidden, hidden),
                       p + "mlp.down_proj.weight": (hidden, 2 * hidden)})
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    return [(n, torch.randn(s, generator=g)) for n, s in shapes.items()]


@pytest.mark.parametrize("nccl", [False, True], ids=["chain", "nccl-path"])
@pytest.mark.parametrize("owners", [1, 2])
def test_tensor_parallel_engines_get_one_slice_per_worker_down_a_chain_per_tp_rank(owners, nccl, monkeypatch):
    """Item 6: two engines of TP 2 (two workers each, the worker extension's own `receive` with the layout a TP-2
    vLLM worker reports) in one pool transfer: slice r of every bucket goes down the chain of the workers of TP rank
    r; each worker receives about half of the model, exactly its slices (a tensor the table does not cut, whole);
    trainer rank 0 (with owner 1: the two owners together) sends about one copy of the model.
    `nccl`: sender, owner and workers told backend "nccl" (the broadcast path, one group per TP rank), their groups
    made as gloo groups here (no GPUs): what crosses each worker's link is still its slices only."""
    made: list[tuple[str, int]] = []  # (backend asked for, group size) of every group made
    if nccl:
        from trainingrun.engines.vllm import worker_ext

        real = worker_ext.make_group

        def gloo_group(store, rank, world, backend, timeout, device=None):
            made.append((backend, world))
            return real(store, rank, world, "gloo", timeout)

        monkeypatch.setattr(worker_ext, "make_group", gloo_group)
    backend = "nccl" if nccl else "gloo"
    named = _llama_like()
    want = dict(named)
    halves = [named[0::2], named[1::2]] if owners == 2 else [named]
    sender = BroadcastSender(0, host="127.0.0.1", timeout=60, dtype=None, bucket_bytes=32 << 10, owners=owners,
                             chunk_bytes=8 << 10, backend=backend).start()
    shard = ShardServer("127.0.0.1", sender.port, owner=1, owners=2, timeout=60, dtype=None, backend=backend,
                        bucket_bytes=32 << 10, chunk_bytes=8 << 10).start() if owners == 2 else None
    try:
        nbytes = sum(h.set_weights(5, part).nbytes for h, part in zip([sender, shard], halves))
        joint = {"id": "sync-5", "members": 2}
        got: dict[tuple[int, int], tuple] = {}

        def worker(engine: int, rank: int, group: str) -> None:
            req = dict(_request(sender, joint), version=5, group=group, world_size=3, backend=backend)
            tp = {"size": 2, "rank": rank, "kv_heads": 2, "vocab_pad": 64, "expert_parallel": False}
            manifest, tensors, st = receive(req, rank=1 + rank, device="cpu", tp=tp)
            st.set(manifest["done_key"], "ok")
            got[engine, rank] = (manifest, tensors)

        groups = [new_group_name(), new_group_name()]
        threads = [threading.Thread(target=worker, args=(e, r, groups[e])) for e in range(2) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        _served(sender, 1)
        assert sender.transfers == 1 and sender.last["engines"] == 2 and sender.last["tp"] == 2, sender.last
        assert len(got) == 4
        per_worker = {}
        for (engine, rank), (manifest, tensors) in got.items():
            slices = dict(zip([e[0] for e in manifest["tensors"]], manifest["slices"]))
            assert sorted(n for n, _ in tensors) == sorted(want)
            for name, part in tensors:
                r = slices[name]
                full = want[name]
                expect = full if r is None else full.narrow(r[0], r[1][rank], r[1][rank + 1] - r[1][rank])
                assert torch.equal(part, expect), (name, rank)
            per_worker[engine, rank] = manifest["received_bytes"]
            assert manifest["transfer"]["chains"] == [[owners, owners + 2], [owners + 1, owners + 3]]
        assert slices["model.embed_tokens.weight"] == [0, [0, 128, 200]]  # vLLM's padded vocabulary partition
        assert slices["model.layers.0.self_attn.k_proj.weight"] == [0, [0, 16, 32]]
        assert slices["model.norm.weight"] is None
        replicated = sum(t.numel() * 4 for n, t in named if slices[n] is None)
        for (engine, rank), b in per_worker.items():  # about half each: its slices plus the small whole tensors
            assert b == sender.last["bytes_per_worker"][rank]
            assert b < 0.55 * nbytes, (b, nbytes)
        assert sum(per_worker[0, r] for r in range(2)) == nbytes + replicated  # one engine: about one copy
        sent = sender.bytes_sent + (shard.bytes_sent if shard else 0)
        assert sent == nbytes + replicated, (sent, nbytes)  # each slice once, whatever the pool's size
        if shard:
            assert 0 < shard.bytes_sent < sent and 0 < sender.bytes_sent < sent
        if nccl:  # one group per TP rank: the owners and 2 workers, made 2 × owners + 4 times; never the whole group
            assert sorted(made) == [("nccl", owners + 2)] * (2 * owners + 4), made
    finally:
        if shard:
            shard.close()
        sender.close()


def test_engines_of_different_layouts_in_one_sync_get_transfers_of_their_own():
    """A TP-2 engine and a TP-1 engine announced in one pool sync: the sender serves each its own transfer (a sliced
    one, a whole one); both load the version exactly."""
    named = _llama_like(layers=1)
    want = dict(named)
    sender = BroadcastSender(0, host="127.0.0.1", timeout=60, dtype=None, bucket_bytes=32 << 10,
                             join_window=1.0).start()
    try:
        nbytes = sender.set_weights(6, named).nbytes
        joint = {"id": "sync-6", "members": 2}
        groups = [new_group_name(), new_group_name()]
        got: dict[tuple[int, int], tuple] = {}

        def worker(engine: int, rank: int, tp: dict | None) -> None:
            size = (tp or {"size": 1})["size"]
            req = dict(_request(sender, joint), version=6, group=groups[engine], world_size=1 + size)
            manifest, tensors, st = receive(req, rank=1 + rank, device="cpu", tp=tp)
            st.set(manifest["done_key"], "ok")
            got[engine, rank] = (manifest, tensors)

        tp2 = {"size": 2, "kv_heads": 2, "vocab_pad": 64}
        threads = [threading.Thread(target=worker, args=(0, r, {**tp2, "rank": r})) for r in range(2)]
        threads.append(threading.Thread(target=worker, args=(1, 0, None)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        _served(sender, 2)
        assert sender.transfers == 2 and [h["engines"] for h in sender.history] == [1, 1]
        assert sorted(h["tp"] for h in sender.history) == [1, 2]
        assert got[1, 0][0].get("slices") is None and got[1, 0][0]["received_bytes"] == nbytes
        assert all(torch.equal(t, want[n]) for n, t in got[1, 0][1])  # the TP-1 engine: every tensor whole
        for rank in range(2):
            manifest, tensors = got[0, rank]
            # about half: rank 0 holds 128 of the 200 vocabulary rows (vLLM pads it to 256 and cuts that in two)
            assert manifest["slice_rank"] == rank and manifest["received_bytes"] < 0.6 * nbytes
            for (name, part), r in zip(tensors, manifest["slices"]):
                full = want[name]
                expect = full if r is None else full.narrow(r[0], r[1][rank], r[1][rank + 1] - r[1][rank])
                assert torch.equal(part, expect), (name, rank)
    finally:
        sender.close()


def test_a_sliced_transfer_by_broadcast_as_on_nccl_gives_each_worker_only_its_slices():
    """The NCCL path of a sliced transfer (`transfer_groups`: one group per slice r, the two owners and the workers of
    TP rank r; `transfer_buckets` with no chain: each slice and its checksum a broadcast in its group), run here on
    gloo: two trainer owners and two engines of TP 2 (ranks 2 … 5) in threads of this process. Each worker receives
    exactly its slices, and only those cross its link (about half the model; before the per-slice groups every
    worker received all t slices); the owners send each slice once."""
    import torch.distributed as dist

    from trainingrun.engines.vllm.broadcast import _buffers, sliced
    from trainingrun.engines.vllm.tp_slice import EngineTP
    from trainingrun.engines.vllm.worker_ext import (ChainCounter, bucket_checksum, bucket_root, split_slices,
                                                     transfer_buckets, transfer_groups)

    named = _llama_like()
    want = dict(named)
    sender = BroadcastSender(0, host="127.0.0.1", timeout=60, dtype=None, bucket_bytes=32 << 10, owners=2)
    shard = ShardServer("127.0.0.1", sender.port, owner=1, owners=2, timeout=60, dtype=None, bucket_bytes=32 << 10)
    try:
        snaps = [h.set_weights(1, part) for h, part in zip((sender, shard), (named[0::2], named[1::2]))]
        views = [h.assemble(snap) for h, snap in zip((sender, shard), snaps)]  # each owner's buffers in place
        nbytes = views[0].nbytes
        members = [{"group": f"e{e}", "offset": 2 + 2 * e, "workers": 2} for e in range(2)]
        manifest, chains, per_rank = sliced(views[0].manifest, EngineTP(size=2, kv_heads=2, vocab_pad=64), members)
        assert chains == [[2, 4], [3, 5]] and {bucket_root(e) for e in manifest["buckets"]} == {0, 1}
        counters = {me: ChainCounter() for me in range(6)}
        got, joined, errors = {}, {}, []

        def member(me: int) -> None:
            try:
                client = dist.TCPStore("127.0.0.1", sender.port, is_master=False)  # one client each, as processes
                pg, groups = transfer_groups(dist.PrefixStore("nccl-like", client), me, 6, "gloo", 30, chains,
                                             broadcast=True)
                joined[me] = (pg, {r: ranks for r, (_g, ranks) in groups.items()})
                common = dict(me=me, chain=None, chains=chains, checksum=manifest["checksum"], groups=groups,
                              counter=counters[me])
                if me < 2:
                    transfer_buckets(pg, _buffers(views[me].buckets, manifest), manifest["buckets"], **common)
                    return
                rank = (me - 2) % 2
                buffers = [torch.empty(int(e[1])) if int(e[3]) == rank else None for e in manifest["buckets"]]
                sums: dict[int, int] = {}
                transfer_buckets(pg, buffers, manifest["buckets"], sums=sums, **common)
                got[me] = (rank, split_slices(manifest, buffers, rank), sums, buffers)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append((me, exc))

        threads = [threading.Thread(target=member, args=(m,)) for m in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and sorted(got) == [2, 3, 4, 5], errors
        for me, (pg, groups) in joined.items():  # an owner is in every slice's group, a worker in its rank's only
            assert pg is None
            assert groups == ({0: [0, 1, 2, 4], 1: [0, 1, 3, 5]} if me < 2 else
                              {(me - 2) % 2: [0, 1] + chains[(me - 2) % 2]}), (me, groups)
        for me, (rank, tensors, sums, buffers) in got.items():
            for (name, part), r in zip(tensors, manifest["slices"]):
                full = want[name]
                expect = full if r is None else full.narrow(r[0], r[1][rank], r[1][rank + 1] - r[1][rank])
                assert torch.equal(part, expect), (name, rank)
            mine = [i for i, b in enumerate(buffers) if b is not None]
            assert mine and all(sums[i] == bucket_checksum(buffers[i], "crc32") for i in mine)
            # what crossed this worker's link: its own slices only (about half the model), not all t of them
            assert counters[me].received == per_rank[rank] < 0.55 * nbytes, (me, counters[me].received, nbytes)
            assert counters[me].received < sum(per_rank)
            assert counters[me].bytes == 0
        sent = counters[0].bytes + counters[1].bytes
        assert sent == sum(per_rank) and counters[0].bytes > 0 and counters[1].bytes > 0  # each slice once
    finally:
        shard.close()
        sender.close()
