"""The contract loss and the packed attention, in plain torch (no Megatron in this process)."""

from __future__ import annotations

from typing import get_args
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainingrun.api.spec import trainer as api
from trainingrun.modeling.attention import PackedSDPAttention, block_causal_mask
from trainingrun.trainer import loss as loss_module
from trainingrun.trainer.loss import (
    LOSS_KINDS, STAT_NAMES, LossInputs, LossSettings, StepTotals, megatron_loss_factor, micro_batch_objective,
    token_logprobs,
)


ROOT = Path(__file__).resolve().parents[2]


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


def test_the_logits_gradient_reaches_the_output_layer_in_the_logits_own_storage() -> None:
    """Regression (issue 28, found by the memory plan's CPU measurements): the trainer handed the loss `logits[0]`,
    whose backward allocated a second zero-filled [1, T, V] tensor for the gradient the loss had written in place of
    the logits; `step.logit_rows` is a view both ways, so no [T, V] tensor is added in the backward."""
    from trainingrun.trainer.step import logit_rows

    seqs, masks = [[1, 2, 3, 4], [5, 6]], [[0, 1, 1, 1], [0, 1]]
    received = []
    for rows in (logit_rows, lambda x: x[0]):
        torch.manual_seed(3)
        leaf = torch.randn(1, 6, 10, requires_grad=True)
        logits = leaf * 1.0  # the output layer's result [1, T, V]
        logits.register_hook(received.append)
        obj, _ = micro_batch_objective(rows(logits), _inputs(seqs, masks, [1.0, 1.0]), LossSettings("sft", "sample"),
                                       StepTotals(global_batch_size=2, loss_tokens=4), overwrite_logits=True)
        obj.backward()
        received.append(logits.data_ptr())
    (grad, ptr), (grad_indexed, ptr_indexed) = received[:2], received[2:]
    assert grad.data_ptr() == ptr  # the loss's in-place gradient, handed on as it is
    assert grad_indexed.data_ptr() != ptr_indexed  # what `logits[0]` did: a new tensor
    assert torch.equal(grad, grad_indexed)  # the same gradient either way


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
    expected, start, clipped, dual, n_tok, diffs = 0.0, 0, 0, 0, 0, 0.0
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
            if a < 0:  # the dual clip, on by default (clipRatioC 3)
                dual += int(term > -a * 3.0)
                term = torch.minimum(term, torch.tensor(-a * 3.0))
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
    assert row["dual_clip_fraction"] == [dual, n_tok]
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
    from trainingrun.engines.megatron import sample_next

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


# ------------------------------------------------------------------------------------------- issue 18: log π, H
@pytest.mark.parametrize("chunk", [1, 3, None])
@pytest.mark.parametrize("scale", [1.0, 1 / 0.7])
def test_token_logprobs_and_entropy_match_log_softmax_and_its_gradients(chunk, scale) -> None:
    """The one place every loss takes log π and H from: per chunk of rows, against a float64 log-softmax; gradients
    of any combination of the two outputs; `overwrite` writes the same gradient into the logits."""
    torch.manual_seed(4)
    z = torch.randn(9, 13, dtype=torch.float64, requires_grad=True)
    tok = torch.randint(0, 13, (9,))
    lp, ent = token_logprobs(z, tok, scale, entropy=True, chunk_rows=chunk)
    ref = torch.log_softmax(z * scale, -1)[:-1]
    ref_lp = torch.cat([ref.new_zeros(1), ref.gather(-1, tok[1:, None]).squeeze(-1)])
    ref_ent = torch.cat([ref.new_zeros(1), -(ref.exp() * ref).sum(-1)])
    assert torch.allclose(lp, ref_lp, atol=1e-12) and torch.allclose(ent, ref_ent, atol=1e-12)
    a, b = torch.randn(9, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    (g,) = torch.autograd.grad((a * lp + b * ent).sum(), z)
    (g_ref,) = torch.autograd.grad((a * ref_lp + b * ref_ent).sum(), z)
    assert torch.allclose(g, g_ref, atol=1e-12)
    buf = z.detach().float().clone().requires_grad_(True)
    view = buf * 1.0  # a non-leaf, as the model's output
    lp32, ent32 = token_logprobs(view, tok, scale, entropy=True, chunk_rows=chunk, overwrite=True)
    (g32,) = torch.autograd.grad((a.float() * lp32 + b.float() * ent32).sum(), buf)
    assert torch.allclose(g32.double(), g_ref, atol=1e-5)


def test_far_off_tokens_give_finite_ratios_losses_and_gradients() -> None:
    """Log-ratios are clamped at ±20 before exp: a generator log-probability 200 nats off gives a finite ratio (e^20),
    loss and gradient, never inf/NaN."""
    from trainingrun.trainer.loss import LOG_RATIO_CLAMP, PolicySettings

    logits = torch.randn(4, 10, requires_grad=True)
    inputs = _with_old(_inputs([[1, 2, 3, 4]], [[0, 1, 1, 1]], [-1.0]), torch.tensor([0.0, -200.0, -1.0, 150.0]))
    obj, stats = micro_batch_objective(logits, inputs, LossSettings("ppo", "token", PolicySettings()),
                                       StepTotals(global_batch_size=1, loss_tokens=3))
    (g,) = torch.autograd.grad(obj, logits)
    row = dict(zip(STAT_NAMES, stats.tolist()))
    assert torch.isfinite(obj) and torch.isfinite(g).all()
    assert all(np.isfinite(v).all() for v in row.values())
    assert row["importance_ratio"][0] <= 3 * np.exp(LOG_RATIO_CLAMP)


def test_a_token_near_the_clamp_with_a_negative_advantage_is_dual_clipped_by_default() -> None:
    """Regression: with dual clip off (the default before), one token whose log-ratio is just below the ±20 clamp
    (ratio e^19.9 ≈ 4e8) with advantage −1 put a loss of ~4e8, and a gradient as large, into the step, while one just
    above the clamp contributed no gradient. The spec's default clipRatioC 3 (verl's) caps its term at −A·3 = 3: a
    constant, so no gradient, and the step counts it in dual_clip_fraction."""
    import yaml

    from trainingrun.api.models import parse_trainingrun
    from trainingrun.trainer.loss import LOG_RATIO_CLAMP, PolicySettings, loss_settings, token_logprobs

    doc = yaml.safe_load((ROOT / "examples" / "rl.yaml").read_text())
    assert "clipRatioC" not in doc["spec"]["trainer"]["policyLoss"]  # the spec's default applies
    settings = loss_settings(parse_trainingrun(doc).spec)
    assert settings.loss_type == "ppo" and settings.policy.clip_ratio_c == 3.0 == PolicySettings().clip_ratio_c
    torch.manual_seed(5)
    logits = torch.randn(4, 10, requires_grad=True)
    base = _inputs([[1, 2, 3, 4]], [[0, 1, 1, 1]], [-1.0])
    logp, _ = token_logprobs(logits.detach(), base.tokens, settings.policy.logit_scale)
    log_r = torch.tensor([0.0, LOG_RATIO_CLAMP - 0.1, 0.0, 0.0])  # token 1 just below the clamp, the others at 1
    inputs = _with_old(base, logp - log_r)
    loss = LossSettings("ppo", "token", PolicySettings(temperature=settings.policy.temperature))
    obj, stats = micro_batch_objective(logits, inputs, loss, StepTotals(global_batch_size=1, loss_tokens=3))
    (g,) = torch.autograd.grad(obj, logits)
    # token 1's term is −A·3 = 3 (the cap), tokens 2 and 3 at ratio 1 give −A·1 = 1 each: (3 + 1 + 1) / 3
    assert float(obj.detach()) == pytest.approx(5.0 / 3.0, rel=1e-5)
    assert float(g.abs().max()) < 1.0  # before: ~4e8 / 3 on token 1's logits
    row = dict(zip(STAT_NAMES, stats.tolist()))
    assert row["dual_clip_fraction"] == [1.0, 3.0]
    # dual clip off (only through PolicySettings now): the loss the default used to give
    off = LossSettings("ppo", "token", PolicySettings(temperature=settings.policy.temperature, clip_ratio_c=None))
    obj_off, stats_off = micro_batch_objective(logits, inputs, off, StepTotals(global_batch_size=1, loss_tokens=3))
    assert float(obj_off.detach()) > 1e8 and dict(zip(STAT_NAMES, stats_off.tolist()))["dual_clip_fraction"] == [0.0, 3.0]


@pytest.mark.parametrize("log_r", [1e-5, 1e-3, 0.5, -0.5])
def test_approx_kl_is_schulmans_k3_in_float64(log_r) -> None:
    """approx_kl = r − 1 − log r with r = π/π_old (k3 of KL(π_old‖π)), exact near r = 1. Before: e^q − q − 1 with
    q = −log r in float32 — another function (at log r = 0.5: 0.107 instead of 0.149) and 0 or negative below
    |log r| ~1e-4."""
    from trainingrun.trainer.loss import PolicySettings

    seq, tok = [1, 2, 3], torch.tensor([1, 2, 3])
    logits = torch.randn(3, 10, dtype=torch.float64)
    logp, _ = token_logprobs(logits, tok)
    old = logp - log_r
    inputs = _with_old(_inputs([seq], [[0, 1, 1]], [1.0]), old.float())
    inputs.tokens = tok
    # float64 logits: the log-ratio reaches the statistic without float32 rounding
    _, stats = micro_batch_objective(logits, LossInputs(inputs.tokens, inputs.target_mask, inputs.sample_of,
                                                        inputs.advantages, inputs.rewards, inputs.lengths,
                                                        engine_logprobs=old),
                                     LossSettings("ppo", "token", PolicySettings()), StepTotals(1, 2))
    s, c = dict(zip(STAT_NAMES, stats.tolist()))["approx_kl"]
    x = (logp - old.float().double())[1:].numpy()  # the log-ratios the loss sees (π_old travels as float32)
    assert np.allclose(x, log_r, rtol=0.05)
    assert c == 2 and s == pytest.approx(float((np.expm1(x) - x).sum()), rel=1e-9)


def test_policy_gradient_uses_the_sampling_temperature() -> None:
    """On-policy at T 0.7 the policy_gradient gradient equals ppo's (the GRPO gradient). Before, policy_gradient took
    log π at temperature 1 (34.5 % off in the audit)."""
    from trainingrun.trainer.loss import PolicySettings

    torch.manual_seed(5)
    seqs, masks, adv = [[1, 2, 3, 4], [5, 6, 7]], [[0, 0, 1, 1], [0, 1, 1]], [1.5, -0.5]
    logits = torch.randn(7, 10, requires_grad=True)
    pol = PolicySettings(temperature=0.7)
    inputs = _inputs(seqs, masks, adv)
    old, _ = token_logprobs(logits.detach(), inputs.tokens, pol.logit_scale)
    totals = StepTotals(global_batch_size=2, loss_tokens=4)
    ppo, _ = micro_batch_objective(logits, _with_old(inputs, old), LossSettings("ppo", "sample", pol), totals)
    pg, _ = micro_batch_objective(logits, _with_old(inputs, old), LossSettings("policy_gradient", "sample", pol),
                                  totals)
    g_ppo, g_pg = (torch.autograd.grad(x, logits)[0] for x in (ppo, pg))
    assert torch.allclose(g_ppo, g_pg, atol=1e-6)


def _corrected(kind: str, level: str, **pol):
    from trainingrun.trainer.loss import PolicySettings, RolloutCorrection

    return PolicySettings(old_logprobs="trainer", correction=RolloutCorrection(
        type=kind, level=level, threshold=1.5, lower_threshold=0.7 if kind == "mask" else None), **pol)


@pytest.mark.parametrize("kind,level", [("tis", "token"), ("tis", "sequence"), ("mask", "token"),
                                        ("mask", "sequence")])
def test_correction_weights_are_exactly_one_when_the_engine_is_the_trainer(kind, level) -> None:
    """Engine log-probabilities equal to the trainer's π_old (engine weights = trainer weights): every tis/mask
    weight is exactly 1, nothing is masked, and the loss and gradient are exactly the uncorrected ones."""
    from trainingrun.trainer.loss import PolicySettings

    torch.manual_seed(6)
    seqs, masks, adv = [[1, 2, 3, 4], [5, 6, 7]], [[0, 0, 1, 1], [0, 1, 1]], [1.5, -0.5]
    logits = torch.randn(7, 10, requires_grad=True)
    inputs = _inputs(seqs, masks, adv)
    old = (token_logprobs(logits.detach(), inputs.tokens)[0] - 0.1).detach()  # a later step: ratio ≠ 1
    both = LossInputs(inputs.tokens, inputs.target_mask, inputs.sample_of, inputs.advantages, inputs.rewards,
                      inputs.lengths, engine_logprobs=old, old_logprobs=old)
    totals = StepTotals(global_batch_size=2, loss_tokens=4)
    obj, stats = micro_batch_objective(logits, both, LossSettings("ppo", "sample", _corrected(kind, level)), totals)
    plain, _ = micro_batch_objective(logits, both, LossSettings("ppo", "sample", PolicySettings(
        old_logprobs="trainer")), totals)
    row = dict(zip(STAT_NAMES, stats.tolist()))
    assert row["correction_weight"] == [4.0, 4] and row["correction_weight_max"][0] == 1.0
    assert row["masked_fraction"] == [0.0, 4] and row["mismatch_kl"][0] == 0.0
    assert float(obj.detach()) == float(plain.detach())
    assert torch.equal(torch.autograd.grad(obj, logits)[0], torch.autograd.grad(plain, logits)[0])


@pytest.mark.parametrize("norm", ["sample", "token"])
def test_masked_tokens_leave_the_numerator_only(norm) -> None:
    """mask: a token whose ρ = π_old/π_engine is outside [lowerThreshold, threshold] adds nothing, but every
    denominator stays the schedule's: GBS_s or T_s, and each sample's n_i (its loss tokens, masked ones included)."""
    from trainingrun.trainer.loss import PolicySettings

    torch.manual_seed(7)
    seqs, masks, adv = [[1, 2, 3, 4], [5, 6, 7]], [[0, 1, 1, 1], [0, 1, 1]], [1.0, -2.0]
    logits = torch.randn(7, 10, requires_grad=True)
    inputs = _inputs(seqs, masks, adv)
    old = token_logprobs(logits.detach(), inputs.tokens)[0].detach()
    eng = old.clone()
    eng[2] -= 1.0  # ρ = e^1 > 1.5: masked
    eng[6] += 1.0  # ρ = e^-1 < 0.7: masked
    li = LossInputs(inputs.tokens, inputs.target_mask, inputs.sample_of, inputs.advantages, inputs.rewards,
                    inputs.lengths, engine_logprobs=eng, old_logprobs=old)
    totals = StepTotals(global_batch_size=5, loss_tokens=11)
    obj, stats = micro_batch_objective(logits, li, LossSettings("ppo", norm, _corrected("mask", "token")), totals)
    # by hand: at ratio 1 each kept token adds −A (ppo at r = 1), n_i = 3 and 2, GBS 5, T 11
    kept = {0: [1, 3], 1: [5]}  # token positions kept per sample
    if norm == "sample":
        expected = (-1.0 * len(kept[0]) / 3 + 2.0 * len(kept[1]) / 2) / 5
    else:
        expected = (-1.0 * len(kept[0]) + 2.0 * len(kept[1])) / 11
    assert float(obj.detach()) == pytest.approx(expected, rel=1e-6)
    row = dict(zip(STAT_NAMES, stats.tolist()))
    assert row["masked_fraction"] == [2.0, 5]


def test_stats_merge_takes_the_maximum_of_max_rows() -> None:
    from trainingrun.trainer.loss import MAX_STATS, merge_stats

    a, b = torch.zeros(len(STAT_NAMES), 2, dtype=torch.float64), torch.zeros(len(STAT_NAMES), 2, dtype=torch.float64)
    i, j = STAT_NAMES.index(MAX_STATS[0]), STAT_NAMES.index("entropy")
    a[i], b[i], a[j], b[j] = torch.tensor([3.0, 2]), torch.tensor([1.5, 4]), torch.tensor([1.0, 2]), torch.tensor([2.0, 3])
    merge_stats(a, b)
    assert a[i].tolist() == [3.0, 6] and a[j].tolist() == [3.0, 5]


def test_loss_kinds_are_the_spec_loss_types_and_the_enums_are_the_spec_literals():
    """A Literal value without a table entry, or an entry without a Literal value, fails; the loss's enum tuples are
    the spec's."""
    assert set(LOSS_KINDS) == set(get_args(api.LossType))
    assert all(kind.doc for kind in LOSS_KINDS.values())
    for name, literal in (("LOSS_TYPES", api.LossType), ("NORMALIZATIONS", api.LossNormalization),
                          ("OLD_LOGPROBS", api.OldLogprobs), ("CORRECTION_TYPES", api.CorrectionType),
                          ("LEVELS", api.Level)):
        assert getattr(loss_module, name) == get_args(literal), name
    spec_types = {name: f.annotation for name, f in api.TrainerSpec.model_fields.items()}
    assert get_args(spec_types["loss_type"]) == get_args(api.LossType)  # the spec field is the named Literal
