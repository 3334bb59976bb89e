"""modeling/stream.py on real Megatron code (gloo, CPU): the streamed, bucketed gather gives exactly the tensors
`gather_live_state` gives, at TP 2, at PP 2 and at EP 2 (a mixture of experts), with buckets small enough that most hold one or a few tensors (and
every bucket within the bound unless it is a single larger tensor); and the two vLLM publishers that stream them
(issue 28 items 1 and 4): the disk publisher's directory (one safetensors file per bucket, and the index) and the
broadcast publisher's snapshot hold exactly the engine-dtype HF tensors of the whole gather. Megatron runs in
subprocesses (this file as a script)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.services import rank_group

ARCH = dict(architecture="llama", num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
            head_dim=8, ffn_hidden_size=48, vocab_size=64, seq_length=64, normalization="RMSNorm", norm_epsilon=1e-5,
            activation="swiglu", rope_base=10000.0, rope_scaling_factor=None, tie_embeddings=False,
            add_bias_linear=False, add_qkv_bias=False, kv_channels=8, transformer_impl="local", hf=None,
            precision="fp32")
MOE_ARCH = dict(ARCH, qk_norm=True, moe=dict(num_experts=4, top_k=2, ffn_hidden_size=24, dense_layers=(0,)))
LIMIT = 6000  # bytes: a few tensors per bucket, the embedding (64 × 32 fp32 = 8 KiB) alone


def _arch(ep: int) -> dict:
    return MOE_ARCH if ep > 1 else ARCH


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["tp2", "pp2", "ep2"])
def test_streamed_buckets_equal_the_whole_gather(tmp_path, tp, pp, ep):
    rank_group([sys.executable, __file__, str(tmp_path), str(tp), str(pp), str(ep)], tp * pp * ep, timeout=300,
               what=f"tp{tp}pp{pp}ep{ep}")
    import torch

    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    buckets = torch.load(tmp_path / "buckets.pt", weights_only=True)
    assert len(buckets) > 3
    streamed: dict = {}
    for b in buckets:
        assert not set(b) & set(streamed), "a tensor in two buckets"
        streamed.update(b)
        nbytes = sum(t.numel() * t.element_size() for t in b.values())
        # over the bound only for one tensor alone — at EP 2 one local expert tensor is two global experts
        assert nbytes <= LIMIT or len({re.sub(r"\d+", "#", n) for n in b}) == 1, sorted(b)
    assert set(streamed) == set(whole)
    for name, t in whole.items():
        assert streamed[name].dtype == t.dtype and torch.equal(streamed[name], t), name

    from trainingrun.modeling import convert
    from trainingrun.modeling.architecture import Architecture
    from trainingrun.modeling.hf_io import HFWeights

    want = {k: v.to(torch.bfloat16) for k, v in convert.megatron_to_hf(whole, Architecture.from_dict(_arch(ep))).items()}
    (directory,) = (tmp_path / "weights").glob("v*")
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    assert len(files) == len(buckets) and (directory / "model.safetensors.index.json").is_file(), files
    # written in parallel (issue 28 item 4): every owner rank wrote files of its own buckets
    written = [int((tmp_path / f"disk-parts-{r}").read_text()) for r in range(tp * pp * ep)]
    assert all(written) and sum(written) == len(files), written
    assert not list(directory.glob(".owner-*")), "the owners' records are not left in the version's directory"
    with HFWeights(directory) as w:
        assert sorted(w.names()) == sorted(want)
        for name, t in want.items():
            assert torch.equal(w.get(name), t), name
    # the broadcast's snapshot is sharded over the owner ranks (issue 28 item 3): each holds only its part, the
    # parts are disjoint, and together they are the whole model, bit-exact
    parts = [torch.load(f, weights_only=True) for f in sorted(tmp_path.glob("snapshot-*.pt"))]
    assert len(parts) == tp * pp * ep, len(parts)
    sent: dict = {}
    for part in parts:
        assert part and len(part) < len(want), len(part)  # a part, never the whole model
        assert not set(part) & set(sent), "a tensor in two owners' snapshots"
        sent.update(part)
    assert sorted(sent) == sorted(want)
    for name, t in want.items():
        assert torch.equal(sent[name], t), name
    assert sorted(torch.load(tmp_path / "assembled.pt", weights_only=True)) == sorted(want)


def _worker(tmp: str, tp: int, pp: int, ep: int) -> None:
    from trainingrun.modeling.model import init_distributed, prepare_device

    device = prepare_device(0)
    init_distributed(device, tp=tp, pp=pp, ep=ep)
    import torch
    import torch.distributed as dist

    from trainingrun.modeling.architecture import Architecture
    from trainingrun.modeling.model import build_model, set_seed
    from trainingrun.modeling.state import gather_live_state, live_layout
    from trainingrun.modeling.stream import iter_live_buckets

    arch = Architecture.from_dict(_arch(ep))
    set_seed(7)
    model = build_model(arch, device)
    layout = live_layout()
    layout.pop("dp_rank")
    whole = gather_live_state(model, arch, **layout)
    buckets = [{k: v.cpu() for k, v in b.items()} for b in iter_live_buckets(model, arch, LIMIT, **layout)]
    if dist.get_rank() == 0:
        torch.save(whole, Path(tmp) / "whole.pt")
        torch.save(buckets, Path(tmp) / "buckets.pt")
    else:
        assert not buckets

    from trainingrun.engines.vllm.publish import BroadcastPublisher, DiskPublisher
    from trainingrun.engines.vllm.worker_ext import split_buckets
    from trainingrun.store import open_store

    store = open_store(f"file://{tmp}/store")
    kw = dict(rank=dist.get_rank(), arch=arch, dtype="bfloat16", max_policy_lag=0, **live_layout())
    disk = DiskPublisher(store, root=Path(tmp) / "weights", assets_dir=None, **kw)
    disk.bucket_bytes = LIMIT  # below weightSync.bucketMiB's least (1 MiB): several files for this small model
    disk.publish(0, model)
    (Path(tmp) / f"disk-parts-{dist.get_rank()}").write_text(str(disk.last_parts))
    # an owner whose files cannot be written: rank 0 names it and commits nothing; no directory is left
    if dist.get_rank() == 1:
        import trainingrun.modeling.hf_io as hf_io

        def full(*_a, **_k):
            raise OSError("No space left on device (test)")

        hf_io.write_part_files = full
    try:
        disk.publish(1, model)
        failed = ""
    except RuntimeError as exc:
        failed = str(exc)
    if dist.get_rank() == 0:
        assert "owner 1's part failed: OSError: No space left on device (test)" in failed, failed
        assert store.latest_weights() == 0 and not list((Path(tmp) / "weights").glob("*v00000001*")), failed
    sender = BroadcastPublisher(open_store(f"file://{tmp}/store2"), host="127.0.0.1", **kw)
    sender.bucket_bytes = LIMIT
    if sender.sender is not None:
        sender.sender.bucket_bytes = LIMIT  # the snapshot's buckets too
    sender.publish(0, model)
    snap = sender.sender._snapshots[0]  # every rank of this one replica owns part of the buckets
    held = [sum(1 for t in snap.manifest["tensors"] if t[3] == i) for i in range(len(snap.buckets))]
    assert len(snap.buckets) >= 2
    assert all(b.numel() * b.element_size() <= LIMIT or n == 1 for b, n in zip(snap.buckets, held))
    torch.save({k: v.clone() for k, v in split_buckets(snap.manifest, snap.buckets)},
               Path(tmp) / f"snapshot-{dist.get_rank()}.pt")
    if dist.get_rank() == 0:  # the transfer's manifest names every owner's tensors
        whole_view = sender.sender.assemble(snap)
        torch.save({t[0]: torch.zeros(1) for t in whole_view.manifest["tensors"]}, Path(tmp) / "assembled.pt")
    dist.barrier()
    sender.close()
    dist.barrier()


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
