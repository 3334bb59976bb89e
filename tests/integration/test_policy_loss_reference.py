"""Acceptance (issue 18): the policy objectives through the real trainer path — Megatron's forward/backward schedule,
DDP, the vocabulary-parallel loss and the forward-only pi_old pass — against an independent float64 reference, at
data-parallel sizes 3, 2 and 1 (uneven ranks, an empty micro-batch, a sample without targets) and at tensor
parallelism 2.

Combinations: loss type (ppo, policy_gradient) × policyLoss.oldLogprobs (engine, trainer) × rolloutCorrection (none,
tis and mask at token and sequence level) × ratioLevel (token, sequence: ppo) × lossNormalization (sample, token);
ppo with oldLogprobs engine takes no correction (the spec refuses it). Along them the entropy bonus, the KL penalty
and the sampling temperature alternate (each is on in half of the combinations), and the dual clip's c between the
spec's default (clipRatioC 3: the settings are built without it) and 1.5 (where it acts on these ratios).

The reference is written here from the formulas of docs/rl.md, not with the project's loss code: each sample run
alone through a copy of the model with the vocabulary gathered (`runtime_gather_output`), log-softmax in float64,
the objective summed sample by sample, gradients by `torch.autograd.grad`; pi_old is the float64 log-softmax of the
same model at the weights before the update. The trainer side sees the "update" as a perturbation of the weights
between its pi_old pass and its step, so ratios, clips, truncations and masks all act.

One launch of three processes (this file as a script) runs every phase: world 3 (DP 3), then ranks 0-1 re-join as
world 2 (DP 2, then TP 2), then rank 0 alone (DP 1).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import pytest

from tests.services import rank_group, rendezvous_port

SIZES = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=40, seq_length=64,
             precision="fp32")
N_SAMPLES = 10
NO_TARGET_SAMPLE = 7
# phase -> (world size, tensor-parallel size, rank -> micro-batches of sample indices); every rank of a phase runs
# the same number of micro-batches, one of them empty somewhere
SPLITS = {
    "dp3": (3, 1, {0: [[0, 1], [2], [3, 4]], 1: [[5], [], [6]], 2: [[7, 8], [9], []]}),
    "dp2": (2, 1, {0: [[0, 1], [2], [3, 4, 5]], 1: [[6], [], [7, 8, 9]]}),
    "tp2": (2, 2, {0: [[0, 1, 2, 3], [], [4, 5, 6, 7, 8, 9]], 1: [[0, 1, 2, 3], [], [4, 5, 6, 7, 8, 9]]}),
    "dp1": (1, 1, {0: [[0, 1, 2, 3], [], [4, 5, 6, 7, 8, 9]]}),
}
TIS_THRESHOLD = 1.1
MASK_BOUNDS = (0.92, 1.1)
DUAL_CLIP_DEFAULT = 3.0  # spec.trainer.policyLoss.clipRatioC's default (verl's)
STAT_CHECKS = ("logprob_abs_diff", "importance_ratio", "clip_fraction", "dual_clip_fraction", "approx_kl", "entropy",
               "kl_ref",
               "mismatch_kl", "correction_weight", "masked_fraction", "seq_clip_fraction", "entropy_bonus",
               "correction_weight_max")


def combos() -> list[dict]:
    out = []
    for loss in ("ppo", "policy_gradient"):
        for old in ("engine", "trainer"):
            for corr in ("none", "tis/token", "tis/sequence", "mask/token", "mask/sequence"):
                if loss == "ppo" and old == "engine" and corr != "none":
                    continue
                for ratio in (("token", "sequence") if loss == "ppo" else ("token",)):
                    for norm in ("sample", "token"):
                        out.append(dict(loss=loss, old=old, corr=corr, ratio=ratio, norm=norm))
    for i, c in enumerate(out):
        c["temperature"] = (1.0, 0.7)[i % 2]
        c["entropy_coef"] = (0.0, 0.03)[(i // 2) % 2]
        c["clip_ratio_c"] = ("default", 1.5)[(i // 4) % 2] if c["loss"] == "ppo" else "default"
        c["kl_coef"] = (0.0, 0.2)[(i // 3) % 2] if c["loss"] == "ppo" else 0.0
    return out


def name(c: dict) -> str:
    return f"{c['loss']}/{c['old']}/{c['corr']}/{c['ratio']}/{c['norm']}"


@pytest.mark.megatron
def test_policy_objectives_match_a_float64_reference_at_dp_1_2_3_and_tp_2(tmp_path: Path) -> None:
    port = rendezvous_port(2)  # the second group (TP 2) rendezvouses on the next port
    rank_group([sys.executable, __file__, str(tmp_path)], 3, timeout=600,
               env={"MASTER_PORT": str(port), "SECOND_PORT": str(port + 1)})
    wanted = {name(c) for c in combos()}
    acted = {"clipped": 0, "truncated": 0, "masked": 0, "seq_clipped": 0, "dual": 0}
    for phase in SPLITS:
        result = json.loads((tmp_path / f"{phase}.json").read_text())
        worst = {k: max(max(abs(g - r) / max(1.0, abs(r)) for g, r in v["stats"].values()) if k == "stats" else
                        v["grad_rel_err"] for v in result["combos"].values()) for k in ("grad", "stats")}
        print(f"{phase}: {len(result['combos'])} combinations, worst gradient rel. error {worst['grad']:.2e}, worst "
              f"statistic error {worst['stats']:.2e}, pi_old error {result['old_logprob_max_abs_err']:.2e}, "
              f"{result['seconds']:.1f}s")
        assert set(result["combos"]) == wanted, phase
        # pi_old of the forward-only pass, against the float64 log-softmax at the same weights
        assert result["old_logprob_max_abs_err"] <= 1e-5, phase
        for combo, r in result["combos"].items():
            where = f"{phase} {combo}"
            assert r["grad_norm_ref"] > 1e-4, where
            assert r["grad_rel_err"] <= 1e-5, (where, r)
            assert abs(r["objective"] - r["objective_ref"]) <= 1e-5 * max(1.0, abs(r["objective_ref"])), (where, r)
            for stat, (got, ref) in r["stats"].items():
                assert math.isfinite(got) and abs(got - ref) <= 1e-5 * max(1.0, abs(ref)), (where, stat, got, ref)
            acted["clipped"] += r["stats"]["clip_fraction"][1] > 0
            acted["truncated"] += "tis" in combo and r["stats"]["correction_weight_max"][1] >= TIS_THRESHOLD - 1e-9
            acted["masked"] += r["stats"]["masked_fraction"][1] > 0
            acted["seq_clipped"] += r["stats"]["seq_clip_fraction"][1] > 0
            acted["dual"] += r["dual_clipped"]
    # every mechanism really acted somewhere (a test of formulas that never bite would prove nothing)
    assert all(n > 0 for n in acted.values()), acted


# ---------------------------------------------------------------------------------------------- subprocess worker
def _reference_logits(model, samples, idx):
    """Per sample: its full-vocabulary logits [L, V] from the model run on the sample alone, in float64."""
    import torch

    out = []
    for i in idx:
        toks = torch.as_tensor(samples.tokens[i], dtype=torch.long)
        logits = model(input_ids=toks[None], position_ids=torch.arange(len(toks))[None], attention_mask=None,
                       runtime_gather_output=True)[0]
        out.append(logits.double())
    return out


def _reference(c, samples, idx, cur, old_w0, engine, gbs, loss_tokens):
    """The objective J_s and its statistics, written out from docs/rl.md in float64 (see the module docstring).
    cur: per sample the current logits [L, V] (differentiable); old_w0: per sample the logits before the update;
    engine: per sample the engine's log-probabilities [L] (0 on the prompt)."""
    import torch

    t = c["temperature"]
    total = 0.0
    acc = {k: [0.0, 0.0] for k in STAT_CHECKS}
    corr_max, dual = 0.0, 0
    corr_type, corr_level = c["corr"].split("/") if c["corr"] != "none" else ("none", "token")
    dual_c = DUAL_CLIP_DEFAULT if c["clip_ratio_c"] == "default" else c["clip_ratio_c"]
    for j, i in enumerate(idx):
        toks = torch.as_tensor(samples.tokens[i], dtype=torch.long)
        m = torch.as_tensor(samples.loss_masks[i][1:], dtype=torch.float64)  # targets 1..L-1
        n = float(m.sum())
        adv = float(samples.advantages[i])
        logp_all = torch.log_softmax(cur[j][:-1] / t, dim=-1)
        lp = logp_all.gather(1, toks[1:, None]).squeeze(1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        w0 = torch.log_softmax(old_w0[j][:-1] / t, dim=-1)
        lp_w0 = w0.gather(1, toks[1:, None]).squeeze(1)
        eng = torch.as_tensor(engine[i][1:], dtype=torch.float64)
        old = lp_w0 if c["old"] == "trainer" else eng
        log_r = (lp - old).clamp(-20, 20)
        if c["ratio"] == "sequence":
            seq = (log_r * m).sum() / max(n, 1.0)
            ratio = torch.exp(seq).expand_as(lp)
        else:
            ratio = torch.exp(log_r)
        lo, hi = 0.8, 1.2
        unclipped, clipped = -adv * ratio, -adv * ratio.clamp(lo, hi)
        if c["loss"] == "ppo":
            term = torch.maximum(unclipped, clipped)
            if adv < 0:  # the dual clip: a negative advantage's term at most −A·c
                dual += int(((term > -adv * dual_c).double() * m).sum() > 0)
                term = torch.minimum(term, torch.full_like(term, -adv * dual_c))
            if c["kl_coef"] > 0:
                q = lp_w0 - lp  # the reference policy is the initial weights
                k3 = torch.exp(q) - q - 1
                term = term + c["kl_coef"] * k3
                acc["kl_ref"][0] += float((k3 * m).sum())
                acc["kl_ref"][1] += n
        else:
            term = -adv * lp
        weight = torch.ones_like(lp)
        if corr_type != "none":
            trainer_lp = lp.detach() if (c["old"] == "engine" and c["loss"] == "policy_gradient") else old
            log_rho = (trainer_lp - eng).detach()
            if corr_level == "sequence":
                log_rho = ((log_rho * m).sum() / max(n, 1.0)).expand_as(lp)
            rho = torch.exp(log_rho)
            if corr_type == "tis":
                weight = rho.clamp(max=TIS_THRESHOLD)
            else:
                weight = ((rho >= MASK_BOUNDS[0]) & (rho <= MASK_BOUNDS[1])).double()
            acc["correction_weight"][0] += float((weight * m).sum())
            acc["correction_weight"][1] += n
            acc["masked_fraction"][0] += float(((weight == 0).double() * m).sum())
            acc["masked_fraction"][1] += n
            if n:
                corr_max = max(corr_max, float(weight[m > 0].max()))
        ell = weight * term - c["entropy_coef"] * ent
        if c["norm"] == "sample":
            if n:
                total = total + (ell * m).sum() / n / gbs
        else:
            total = total + (ell * m).sum() / loss_tokens
        # statistics (token-weighted over the loss tokens; seq_clip_fraction per sample with targets)
        with torch.no_grad():
            lpd = lp.detach()
            tok_log_r = (lpd - old).clamp(-20, 20)
            mism = (old if c["old"] == "trainer" else lpd) - eng
            for key, val in (("logprob_abs_diff", (lpd - eng).abs()), ("importance_ratio", torch.exp(tok_log_r)),
                             ("clip_fraction", (clipped > unclipped).double()),
                             # where the dual clip caps the ppo term (counted for every loss type, as the clip)
                             ("dual_clip_fraction", ((torch.maximum(unclipped, clipped) > -adv * dual_c) & (adv < 0))
                              .double()),
                             ("approx_kl", torch.exp(tok_log_r) - 1 - tok_log_r), ("entropy", ent.detach()),
                             ("mismatch_kl", torch.exp(mism) - 1 - mism)):
                acc[key][0] += float((val * m).sum())
                acc[key][1] += n
            if c["entropy_coef"] > 0:
                acc["entropy_bonus"][0] += c["entropy_coef"] * float((ent.detach() * m).sum())
                acc["entropy_bonus"][1] += n
            if c["ratio"] == "sequence" and n:
                acc["seq_clip_fraction"][0] += float(bool(((clipped > unclipped).double() * m).sum() > 0))
                acc["seq_clip_fraction"][1] += 1
    stats = {k: (v[0] / v[1] if v[1] else 0.0) for k, v in acc.items()}
    stats["correction_weight_max"] = corr_max
    return total, stats, dual


def _settings(c):
    from trainingrun.trainer.loss import LossSettings, PolicySettings, RolloutCorrection

    corr = RolloutCorrection()
    if c["corr"] != "none":
        kind, level = c["corr"].split("/")
        corr = RolloutCorrection(type=kind, level=level, threshold=TIS_THRESHOLD if kind == "tis" else MASK_BOUNDS[1],
                                 lower_threshold=MASK_BOUNDS[0] if kind == "mask" else None)
    dual = {} if c["clip_ratio_c"] == "default" else {"clip_ratio_c": c["clip_ratio_c"]}  # default: the spec's
    return LossSettings(c["loss"], c["norm"], PolicySettings(
        temperature=c["temperature"], clip_low=0.2, clip_high=0.2, kl_coef=c["kl_coef"], old_logprobs=c["old"],
        correction=corr, ratio_level=c["ratio"], entropy_coef=c["entropy_coef"], **dual))


def _phase(phase: str, out_dir: Path) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from tests.synthetic import loss_tokens_of, make_samples
    from trainingrun.contract.published import rank_payload
    from trainingrun.metrics.reduce import allreduce_max, allreduce_pairs
    from trainingrun.modeling import convert
    from trainingrun.modeling.architecture import resolve
    from trainingrun.modeling.model import build_model, set_seed
    from trainingrun.trainer.batch import pack
    from trainingrun.trainer.loss import MAX_STATS, STAT_NAMES, StepTotals
    from trainingrun.trainer.optim import wrap_ddp
    from trainingrun.trainer.step import forward_backward, payload_old_logprobs

    _, _, split = SPLITS[phase]
    rank = dist.get_rank()
    device = torch.device("cpu")
    arch = resolve(**SIZES)
    set_seed(11)
    model = build_model(arch, device)
    ddp = wrap_ddp(model)
    w0 = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    # the "update" between the pi_old pass and the step: a seeded perturbation of every weight, the same on every
    # rank for a replicated tensor, per tensor-parallel rank for a split one
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    w1 = {}
    for i, (k, v) in enumerate(sorted(w0.items())):
        is_split = convert.tp_layout(k, arch)[0] is not None
        gen = torch.Generator().manual_seed(1000 * i + (tp_rank if is_split else 0))
        w1[k] = v + 0.03 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
    ref0, ref1 = build_model(arch, device), build_model(arch, device)  # pi_old / pi_ref; the current policy
    ref0.load_state_dict(w0)
    ref1.load_state_dict(w1)
    for prm in ref0.parameters():
        prm.requires_grad_(False)
    ref0.eval()

    samples = make_samples(N_SAMPLES, vocab=SIZES["vocab_size"], seed=5, min_len=2, max_len=9, group_size=3)
    samples.loss_masks[NO_TARGET_SAMPLE][:] = 0
    samples.advantages[:] = np.random.default_rng(3).normal(0, 1.5, N_SAMPLES).astype(np.float32)
    all_idx = list(range(N_SAMPLES))
    gbs, loss_tokens = N_SAMPLES, loss_tokens_of(samples, all_idx)
    with torch.no_grad():
        old_logits = _reference_logits(ref0, samples, all_idx)
    cur_logits = _reference_logits(ref1, samples, all_idx)  # one forward, graph kept for every combination
    params = list(ref1.parameters())

    # the engine's log-probabilities: pi_old at the sampling temperature, off by noise (a bf16 engine, say)
    rng = np.random.default_rng(7)
    noise = [rng.normal(0, 0.12, len(samples.tokens[i])) for i in all_idx]
    engine = {}
    for t in (1.0, 0.7):
        per = []
        for i in all_idx:
            lsm = torch.log_softmax(old_logits[i][:-1] / t, -1)
            lp = torch.cat([lsm.new_zeros(1), lsm.gather(1, torch.as_tensor(samples.tokens[i][1:], dtype=torch.long)
                                                         [:, None]).squeeze(1)]).numpy()
            m = samples.loss_masks[i].astype(np.float64)
            m[0] = 0
            per.append(((lp + noise[i]) * m).astype(np.float32))
        engine[t] = per

    mine = [i for mb in split.get(rank, []) for i in mb]
    positions, p = [], 0
    for mb in split[rank]:
        positions.append(list(range(p, p + len(mb))))
        p += len(mb)
    dp_group = parallel_state.get_data_parallel_group()
    world = dist.get_world_size()

    # pi_old by the trainer's forward-only pass at w0, per temperature (checked against the float64 reference)
    model.load_state_dict(w0)
    old_pass, old_err = {}, 0.0
    for t in (1.0, 0.7):
        samples.logprobs = engine[t]
        payload = rank_payload(samples, mine)
        old_pass[t] = payload_old_logprobs(ddp, payload, [positions], _settings(dict(
            combos()[0], temperature=t)), device)
        for j, i in enumerate(mine):
            a, b = int(payload["offsets"][j]), int(payload["offsets"][j + 1])
            lsm = torch.log_softmax(old_logits[i][:-1] / t, -1)
            ref = lsm.gather(1, torch.as_tensor(samples.tokens[i][1:], dtype=torch.long)[:, None]).squeeze(1)
            old_err = max(old_err, float((torch.as_tensor(old_pass[t][a + 1:b], dtype=torch.float64) - ref)
                                         .abs().max()) if b - a > 1 else 0.0)
    model.load_state_dict(w1)

    result = {"combos": {}, "old_logprob_max_abs_err": old_err}
    t0 = time.perf_counter()
    for c in combos():
        loss = _settings(c)
        samples.logprobs = engine[c["temperature"]]
        payload = rank_payload(samples, mine)
        payload["old_logprobs"] = old_pass[c["temperature"]]
        mbs = [pack(payload, pos, device) for pos in positions]
        ddp.zero_grad_buffer()
        local = forward_backward(ddp, mbs, loss, StepTotals(global_batch_size=gbs, loss_tokens=loss_tokens),
                                 dp_size=parallel_state.get_data_parallel_world_size(),
                                 ref_model=ref0 if c["kl_coef"] > 0 else None)
        stats = allreduce_pairs(local, group=dp_group)
        rows = [STAT_NAMES.index(s) for s in MAX_STATS]
        stats[rows, 0] = allreduce_max(local[rows, 0], group=dp_group)
        grads = torch.cat([prm.main_grad.detach().flatten().double() for prm in model.parameters()])

        objective, ref_stats, dual = _reference(c, samples, all_idx, cur_logits, old_logits, engine[c["temperature"]],
                                                gbs, loss_tokens)
        ref_grads = torch.autograd.grad(objective, params, retain_graph=True, allow_unused=True)
        g_ref = torch.cat([(g if g is not None else torch.zeros_like(q)).flatten().double()
                           for g, q in zip(ref_grads, params)])
        norms = torch.tensor([float((grads - g_ref).norm() ** 2), float(g_ref.norm() ** 2)], dtype=torch.float64)
        dist.all_reduce(norms)  # over the whole world: TP ranks hold different shards (DP replicas count alike)
        got = {s: (stats[STAT_NAMES.index(s), 0] / stats[STAT_NAMES.index(s), 1]).item()
               if stats[STAT_NAMES.index(s), 1] > 0 else 0.0 for s in STAT_CHECKS}
        got["correction_weight_max"] = float(stats[STAT_NAMES.index("correction_weight_max"), 0])
        result["combos"][name(c)] = {
            "grad_rel_err": math.sqrt(float(norms[0]) / float(norms[1])),
            "grad_norm_ref": math.sqrt(float(norms[1]) / world),
            "objective": float(stats[0, 0]), "objective_ref": float(objective),
            "stats": {s: (got[s], ref_stats[s]) for s in STAT_CHECKS}, "dual_clipped": dual,
        }
    result["seconds"] = time.perf_counter() - t0
    if rank == 0:
        (out_dir / f"{phase}.json").write_text(json.dumps(result, indent=1))
    dist.barrier()


def _worker(out_dir: str) -> None:
    import datetime

    from trainingrun.modeling.model import init_distributed, prepare_device

    device = prepare_device(0)
    import torch.distributed as dist
    from megatron.core import parallel_state

    rank = int(os.environ["RANK"])
    out = Path(out_dir)
    init_distributed(device, tp=1)
    _phase("dp3", out)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if rank > 1:
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['SECOND_PORT']}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=300))
    for phase, tp in (("dp2", 1), ("tp2", 2)):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        _phase(phase, out)
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if rank > 0:
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    _phase("dp1", out)


if __name__ == "__main__":
    _worker(sys.argv[1])
