"""The broadcast weight sync's transfer, faults on the wire (issue 28 item 11): a bucket corrupted in flight is
refused by the receiver, naming the bucket and its tensors, and nothing of it is loaded; the sender's wait for that
receiver ends at once. A real `BroadcastSender` (TCPStore + gloo group on 127.0.0.1) and the worker extension's own
`receive`, in one process (the sender serves from its thread)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from trainingrun.engines.vllm.broadcast import BroadcastSender, Snapshot, new_group_name
from trainingrun.engines.vllm.worker_ext import DONE_KEY, receive


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [("a.weight", torch.randn(8, 4, generator=g)), ("b.bias", torch.randn(16, generator=g)),
            ("c.weight", torch.randn(4, 4, generator=g))]


class CorruptsBucketOne(BroadcastSender):
    """Sends bucket 1 with one element changed (what a damaged link or a bad NIC does), the manifest unchanged."""

    def _send(self, snap: Snapshot, reqs: list[dict]):
        damaged = [b.clone() for b in snap.buckets]
        damaged[1][3] += 1.0
        return super()._send(dataclasses.replace(snap, buckets=damaged), reqs)


def _request(sender: BroadcastSender, version: int) -> dict:
    return {"host": "127.0.0.1", "port": sender.port, "group": new_group_name(), "world_size": 2, "backend": "gloo",
            "timeout": 30, "connect_timeout": 10, "version": version}


@pytest.mark.parametrize("corrupt", [False, True], ids=["clean", "corrupted"])
def test_a_bucket_corrupted_in_flight_is_refused_naming_it(corrupt):
    cls = CorruptsBucketOne if corrupt else BroadcastSender
    sender = cls(0, host="127.0.0.1", timeout=30, dtype=None, bucket_bytes=64).start()  # a bucket per tensor
    try:
        named = _named()
        snap = sender.set_weights(5, named)
        assert len(snap.buckets) == 3 and len(snap.manifest["checksums"]) == 3
        if corrupt:
            with pytest.raises(RuntimeError, match=r"bucket 1 of 3 \(tensors \['b.bias'\]\) arrived corrupted: "
                                                   r"checksum \d+, the sender's \d+; nothing was loaded"):
                receive(_request(sender, 5), rank=1, device="cpu")
        else:
            req = _request(sender, 5)
            manifest, got, store = receive(req, rank=1, device="cpu")
            store.set(DONE_KEY.format(group=req["group"], rank=1), "ok")  # applied, as the extension says
            assert manifest["checksum"] == "crc32"
            assert [n for n, _ in got] == [n for n, _ in named]
            assert all(torch.equal(t, want) for (_, t), (_, want) in zip(got, named))
        deadline = 10.0  # the sender saw this receiver's answer ("corrupt" or "ok") and is free for the next
        t0 = time.monotonic()
        while sender.transfers + sender.failures == 0 and time.monotonic() - t0 < deadline:
            time.sleep(0.05)
        assert sender.transfers == 1, (sender.transfers, sender.failures)
    finally:
        sender.close()


def test_a_slice_corrupted_in_flight_is_refused_naming_its_tensors(monkeypatch):
    """A sliced transfer (an engine of TP 2, item 6): the checksums travel with the slices (computed by the sender
    on each slice it cuts); a slice that arrives damaged at worker 0 is refused there, naming its tensors, while
    worker 1's slices arrive whole; the sender drops the engine (it loads again)."""
    import threading

    from trainingrun.engines.vllm import worker_ext

    real = worker_ext.transfer_buckets

    def damaging(pg, buffers, entries, **kw):  # the receivers' side only (the sender imported its own name)
        out = real(pg, buffers, entries, **kw)
        if kw["me"] == 1:  # worker 0 of the engine: its first slice has one element changed after the wire
            next(b for b in buffers if b is not None)[3] += 1.0
        return out

    monkeypatch.setattr(worker_ext, "transfer_buckets", damaging)
    sender = BroadcastSender(0, host="127.0.0.1", timeout=30, dtype=None, bucket_bytes=1 << 20).start()
    try:
        named = [("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 4)),
                 ("model.layers.0.input_layernorm.weight", torch.randn(4))]
        sender.set_weights(6, named)
        req = dict(_request(sender, 6), world_size=3)
        got: dict[int, object] = {}

        def worker(rank: int) -> None:
            tp = {"size": 2, "rank": rank, "kv_heads": 2, "vocab_pad": 64}
            try:
                manifest, tensors, store = receive(req, rank=1 + rank, device="cpu", tp=tp)
                store.set(manifest["done_key"], "ok")
                got[rank] = tensors
            except RuntimeError as exc:
                got[rank] = exc

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert isinstance(got[0], RuntimeError)
        assert "(tensors ['model.layers.0.self_attn.q_proj.weight', 'model.layers.0.input_layernorm.weight']) " \
               "arrived corrupted" in str(got[0]), got[0]
        assert [(n, t.shape) for n, t in got[1]] == [(named[0][0], torch.Size([4, 4])), (named[1][0], (4,))]
        assert torch.equal(got[1][0][1], named[0][1][4:]) and torch.equal(got[1][1][1], named[1][1])
        t0 = time.monotonic()
        while sender.transfers + sender.failures == 0 and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert sender.last["dropped"] == [req["group"]], sender.last  # worker 0 said "corrupt": not loaded
    finally:
        sender.close()
