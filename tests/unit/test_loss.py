"""The contract loss and the packed attention, in plain torch (no Megatron in this process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainingrun.modeling.attention import PackedSDPAttention, block_causal_mask
from trainingrun.trainer.loss import (
    STAT_NAMES, LossInputs, LossSettings, StepTotals, megatron_loss_factor, micro_batch_objective, token_logprobs,
)


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
    obj, stats = micro_batch_objective(logits, _inputs(seqs, masks, adv), LossSettings(loss_type, norm),
                                       StepTotals(global_batch_size=gbs, loss_tokens=loss_tokens))
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
    obj, stats = micro_batch_objective(logits, empty, LossSettings("sft", "sample"),
                                       StepTotals(global_batch_size=4, loss_tokens=9))
    assert float(obj.detach()) == 0.0 and stats.abs().sum() == 0
    (g,) = torch.autograd.grad(obj, logits)
    assert torch.count_nonzero(g) == 0


def test_token_nll_shift_and_bad_arguments() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.5, 0.5]]))
    nll = -token_logprobs(logits, torch.tensor([0, 1, 0]))[0]
    assert torch.allclose(nll, torch.tensor([0.0, -np.log(0.9), -np.log(0.8)], dtype=torch.float32))
    with pytest.raises(ValueError, match="loss_type"):
        micro_batch_objective(logits, _inputs([[0, 1, 0]], [[0, 1, 1]], [1.0]), LossSettings("dpo", "sample"),
                              StepTotals(global_batch_size=1, loss_tokens=1))
    with pytest.raises(ValueError, match="lossNormalization"):
        micro_batch_objective(logits, _inputs([[0, 1, 0]], [[0, 1, 1]], [1.0]), LossSettings("sft", "batch"),
                              StepTotals(global_batch_size=1, loss_tokens=1))
    assert megatron_loss_factor(3, 5) == 15.0


# ------------------------------------------------------------------------------------------------------ ppo
def _with_old(inputs: LossInputs, old: torch.Tensor) -> LossInputs:
    return LossInputs(inputs.tokens, inputs.target_mask, inputs.sample_of, inputs.advantages, inputs.rewards,
                      inputs.lengths, engine_logprobs=old)


@pytest.mark.parametrize("norm", ["sample", "token"])
@pytest.mark.parametrize("temperature,kl", [(1.0, 0.0), (0.7, 0.0), (1.0, 0.3)])
def test_ppo_objective_is_the_clipped_formula(norm: str, temperature: float, kl: float) -> None:
    """Per target token: max(-A r, -A clip(r, 1-0.2, 1+0.28)) (+ kl · k3 to the reference), r = exp(log pi - old)
    with log pi of softmax(logits / T); normalised by the step's GBS or loss tokens as the other loss types."""
    from trainingrun.trainer.loss import PolicySettings

    torch.manual_seed(2)
    seqs = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    masks = [[0, 0, 1, 1], [0, 1], [0, 1, 1]]
    adv = [0.5, -2.0, 3.0]
    logits = torch.randn(9, 10, requires_grad=True)
    ref_logits = torch.randn(9, 10)
    old = torch.randn(9) * 0.3 - 2.0  # some ratios fall outside the clip range, both ways
    pol = PolicySettings(temperature=temperature, clip_low=0.2, clip_high=0.28, kl_coef=kl)
    gbs, loss_tokens = 5, 8
    inputs = _with_old(_inputs(seqs, masks, adv), old)
    obj, stats = micro_batch_objective(logits, inputs, LossSettings("ppo", norm, pol),
                                       StepTotals(global_batch_size=gbs, loss_tokens=loss_tokens),
                                       ref_logits=ref_logits if kl else None)
    expected, start, clipped, n_tok, diffs = 0.0, 0, 0, 0, 0.0
    for s, m, a in zip(seqs, masks, adv):
        lp = torch.log_softmax(logits[start:start + len(s)] / temperature, -1)
        rlp = torch.log_softmax(ref_logits[start:start + len(s)] / temperature, -1)
        terms = []
        for t in range(1, len(s)):
            if not m[t]:
                continue
            logp = lp[t - 1, s[t]]
            r = torch.exp(logp - old[start + t])
            unclipped, clip = -a * r, -a * torch.clamp(r, 0.8, 1.28)
            term = torch.maximum(unclipped, clip)
            q = rlp[t - 1, s[t]] - logp
            term = term + kl * (torch.exp(q) - q - 1)
            terms.append(term)
            clipped += int(clip > unclipped)
            n_tok += 1
            diffs += float((logp - old[start + t]).abs().detach())
        expected = expected + (sum(terms) / len(terms) / gbs if norm == "sample" else sum(terms) / loss_tokens)
        start += len(s)
    assert torch.allclose(obj, expected, rtol=1e-5)
    g1 = torch.autograd.grad(obj, logits, retain_graph=True)[0]
    g2 = torch.autograd.grad(expected, logits)[0]
    assert torch.allclose(g1, g2, rtol=1e-4, atol=1e-7)
    row = dict(zip(STAT_NAMES, stats.tolist()))
    assert row["clip_fraction"] == [clipped, n_tok] and 0 < clipped < n_tok
    assert row["logprob_abs_diff"][0] == pytest.approx(diffs, rel=1e-5) and row["logprob_abs_diff"][1] == n_tok
    assert row["response_length"] == [n_tok, 3]
    assert (row["kl_ref"][1] == n_tok) == (kl > 0)


def test_ppo_at_ratio_one_is_the_policy_gradient() -> None:
    """On-policy (generator logprobs = the trainer's), the ppo gradient equals policy_gradient's: the first step of
    a rollout at maxPolicyLag 0 is plain GRPO."""
    from trainingrun.trainer.loss import PolicySettings, token_logprobs

    torch.manual_seed(3)
    seqs, masks, adv = [[1, 2, 3, 4], [5, 6, 7]], [[0, 0, 1, 1], [0, 1, 1]], [1.5, -0.5]
    logits = torch.randn(7, 10, requires_grad=True)
    inputs = _inputs(seqs, masks, adv)
    old, _ = token_logprobs(logits.detach(), inputs.tokens)
    totals = StepTotals(global_batch_size=2, loss_tokens=4)
    ppo, stats = micro_batch_objective(logits, _with_old(inputs, old), LossSettings("ppo", "token", PolicySettings()),
                                       totals)
    pg, _ = micro_batch_objective(logits, inputs, LossSettings("policy_gradient", "token"), totals)
    g_ppo = torch.autograd.grad(ppo, logits)[0]
    g_pg = torch.autograd.grad(pg, logits)[0]
    assert torch.allclose(g_ppo, g_pg, atol=1e-6)
    row = dict(zip(STAT_NAMES, stats.tolist()))
    assert row["logprob_abs_diff"][0] < 1e-6 and row["importance_ratio"] == pytest.approx([4.0, 4])
    assert row["clip_fraction"][0] == 0 and row["approx_kl"][0] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="no generator log-probabilities"):
        micro_batch_objective(logits, inputs, LossSettings("ppo", "token"), totals)


def test_sampling_temperature_top_p_and_greedy() -> None:
    from trainingrun.contract.engine import Sampling
    from trainingrun.rollout.megatron_engine import sample_next

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]]).repeat(20000, 1)
    gen = torch.Generator().manual_seed(0)
    tok, logp = sample_next(logits, Sampling(temperature=0.5), gen)
    p = torch.softmax(logits[0] / 0.5, -1)
    freq = torch.bincount(tok, minlength=5).float() / len(tok)
    assert torch.allclose(freq, p, atol=0.01)
    assert torch.allclose(logp, torch.log(p)[tok], atol=1e-6)  # the tempered distribution's log-probability
    tok, logp = sample_next(logits, Sampling(temperature=1.0, top_p=0.7), gen)
    assert set(tok.tolist()) <= {0, 1}  # the smallest set of most likely tokens reaching 0.7: p = 0.61, 0.22
    # the log-probability of the distribution the token was drawn from: the top-p set renormalised, as vLLM's
    # processed_logprobs (before: the untruncated one, so the two engines recorded different numbers)
    p1 = torch.softmax(logits[0], -1)
    assert torch.allclose(logp, torch.log(p1[tok] / p1[:2].sum()), atol=1e-6)
    tok, _ = sample_next(logits[:3], Sampling(temperature=0.0), gen)
    assert tok.tolist() == [0, 0, 0]
