"""modeling/stream.py on real Megatron code (gloo, CPU): the streamed, bucketed gather gives exactly the tensors
`gather_live_state` gives, at TP 2 and at PP 2, with buckets small enough that most hold one or a few tensors (and
every bucket within the bound unless it is a single larger tensor). Megatron runs in subprocesses (this file as a
script)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.services import rank_group

ARCH = dict(architecture="llama", num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
            head_dim=8, ffn_hidden_size=48, vocab_size=64, seq_length=64, normalization="RMSNorm", norm_epsilon=1e-5,
            activation="swiglu", rope_base=10000.0, rope_scaling_factor=None, tie_embeddings=False,
            add_bias_linear=False, add_qkv_bias=False, kv_channels=8, transformer_impl="local", hf=None,
            precision="fp32")
LIMIT = 6000  # bytes: a few tensors per bucket, the embedding (64 × 32 fp32 = 8 KiB) alone


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_streamed_buckets_equal_the_whole_gather(tmp_path, tp, pp):
    rank_group([sys.executable, __file__, str(tmp_path), str(tp), str(pp)], tp * pp, timeout=300, what=f"tp{tp}pp{pp}")
    import torch

    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    buckets = torch.load(tmp_path / "buckets.pt", weights_only=True)
    assert len(buckets) > 3
    streamed: dict = {}
    for b in buckets:
        assert not set(b) & set(streamed), "a tensor in two buckets"
        streamed.update(b)
        nbytes = sum(t.numel() * t.element_size() for t in b.values())
        assert nbytes <= LIMIT or len(b) == 1
    assert set(streamed) == set(whole)
    for name, t in whole.items():
        assert streamed[name].dtype == t.dtype and torch.equal(streamed[name], t), name


def _worker(tmp: str, tp: int, pp: int) -> None:
    from trainingrun.modeling.model import init_distributed, prepare_device

    device = prepare_device(0)
    init_distributed(device, tp=tp, pp=pp)
    import torch
    import torch.distributed as dist

    from trainingrun.modeling.architecture import Architecture
    from trainingrun.modeling.model import build_model, set_seed
    from trainingrun.modeling.state import gather_live_state, live_layout
    from trainingrun.modeling.stream import iter_live_buckets

    arch = Architecture.from_dict(ARCH)
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
    dist.barrier()


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
