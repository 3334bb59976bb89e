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
