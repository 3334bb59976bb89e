"""The contract loss and the packed attention, in plain torch (no Megatron in this process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainingrun.trainer.attention import PackedSDPAttention, block_causal_mask
from trainingrun.trainer.loss import STAT_NAMES, LossInputs, megatron_loss_factor, micro_batch_objective, token_nll


class _Cfg:
    attention_dropout = 0.0
    kv_channels = None
    hidden_size = 32
    num_attention_heads = 4


class _Packed:
    qkv_format = "thd"

    def __init__(self, cu):
        self.cu_seqlens_q = self.cu_seqlens_kv = cu


def test_packed_attention_matches_per_document_attention() -> None:
    torch.manual_seed(0)
    lens = [3, 1, 7, 5]
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    total, heads, dim = sum(lens), 4, 8
    q, k, v = (torch.randn(total, heads, dim) for _ in range(3))
    out = PackedSDPAttention(_Cfg(), layer_number=1)(q, k, v, None, packed_seq_params=_Packed(cu))
    assert out.shape == (total, heads, dim)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qd, kd, vd = (x[a:b].transpose(0, 1) for x in (q, k, v))
        ref = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).transpose(0, 1)
        assert torch.allclose(out[a:b], ref, atol=1e-6), (a, b)


def test_block_causal_mask_never_crosses_documents() -> None:
    cu = torch.tensor([0, 2, 5])
    m = block_causal_mask(cu, 5)
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])
    assert torch.equal(m, expected.bool())


def _inputs(seqs, masks, adv):
    tokens = torch.tensor([t for s in seqs for t in s])
    tm = []
    for m in masks:
        m = list(map(float, m))
        m[0] = 0.0
        tm += m
    return LossInputs(
        tokens=tokens, target_mask=torch.tensor(tm),
        sample_of=torch.tensor([i for i, s in enumerate(seqs) for _ in s]),
        advantages=torch.tensor(adv, dtype=torch.float32), rewards=torch.tensor(adv, dtype=torch.float32) + 1,
        lengths=torch.tensor([float(len(s)) for s in seqs]),
    )


@pytest.mark.parametrize("loss_type", ["sft", "policy_gradient"])
@pytest.mark.parametrize("norm", ["sample", "token"])
def test_objective_is_the_contract_formula(loss_type: str, norm: str) -> None:
    torch.manual_seed(1)
    seqs = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    masks = [[0, 0, 1, 1], [0, 1], [0, 0, 0]]  # the third sample has no targets
    adv = [0.5, -2.0, 3.0]
    logits = torch.randn(9, 10, requires_grad=True)
    gbs, loss_tokens = 7, 11  # the step is bigger than this micro-batch: denominators come from the schedule
    obj, stats = micro_batch_objective(logits, _inputs(seqs, masks, adv), loss_type=loss_type, normalization=norm,
                                       global_batch_size=gbs, loss_tokens=loss_tokens)
    # written out by hand: sample i's targets are its tokens t>=1 with mask 1, predicted from position t-1
    expected, start = 0.0, 0
    for s, m, a in zip(seqs, masks, adv):
        lp = torch.log_softmax(logits[start:start + len(s)], -1)
        terms = [-lp[t - 1, s[t]] * (1.0 if loss_type == "sft" else a) for t in range(1, len(s)) if m[t]]
        if terms:
            expected = expected + (sum(terms) / len(terms) / gbs if norm == "sample" else sum(terms) / loss_tokens)
        start += len(s)
    assert torch.allclose(obj, expected, rtol=1e-6)
    g1 = torch.autograd.grad(obj, logits, retain_graph=True)[0]
    g2 = torch.autograd.grad(expected, logits)[0]
    assert torch.allclose(g1, g2, rtol=1e-5, atol=1e-8)
    row = dict(zip(STAT_NAMES, stats.tolist()))
    assert row["objective"][0] == pytest.approx(float(obj.detach())) and row["objective"][1] == 3
    assert row["token_loss"][1] == 3  # loss tokens counted
    assert row["sample_reward"] == pytest.approx([sum(adv) + 3, 3])
    assert row["sample_tokens"] == [9, 3]


def test_empty_micro_batch_contributes_zero_with_a_gradient_path() -> None:
    logits = torch.randn(1, 10, requires_grad=True)
    empty = LossInputs(torch.zeros(1, dtype=torch.long), torch.zeros(1), torch.zeros(0, dtype=torch.long),
                       torch.zeros(0), torch.zeros(0), torch.zeros(0))
    obj, stats = micro_batch_objective(logits, empty, loss_type="sft", normalization="sample",
                                       global_batch_size=4, loss_tokens=9)
    assert float(obj.detach()) == 0.0 and stats.abs().sum() == 0
    (g,) = torch.autograd.grad(obj, logits)
    assert torch.count_nonzero(g) == 0


def test_token_nll_shift_and_bad_arguments() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.5, 0.5]]))
    nll = token_nll(logits, torch.tensor([0, 1, 0]))
    assert torch.allclose(nll, torch.tensor([0.0, -np.log(0.9), -np.log(0.8)], dtype=torch.float32))
    with pytest.raises(ValueError, match="loss_type"):
        micro_batch_objective(logits, _inputs([[0, 1, 0]], [[0, 1, 1]], [1.0]), loss_type="dpo",
                              normalization="sample", global_batch_size=1, loss_tokens=1)
    with pytest.raises(ValueError, match="lossNormalization"):
        micro_batch_objective(logits, _inputs([[0, 1, 0]], [[0, 1, 1]], [1.0]), loss_type="sft",
                              normalization="batch", global_batch_size=1, loss_tokens=1)
    assert megatron_loss_factor(3, 5) == 15.0
