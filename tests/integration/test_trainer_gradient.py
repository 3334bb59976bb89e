"""Acceptance: the gradient after Megatron's forward/backward schedule and DDP reduction equals the gradient of the
contract formula computed directly in one process — for one step split unevenly over 2 ranks and several
micro-batches (one of them empty, one sample without loss tokens), both loss types and both normalisations.

Megatron runs in two subprocesses (this file run as a script, gloo on CPU). Rank 0 also computes the reference: a
plain GPTModel with the same weights, each sample run on its own (unpacked, causal SDPA), the contract written out
with `torch.nn.functional.cross_entropy`, gradients by `torch.autograd.grad`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.services import rank_group

COMBOS = [("sft", "sample"), ("sft", "token"), ("policy_gradient", "sample"), ("policy_gradient", "token")]
# rank -> micro-batches of global sample indices (uneven: 6 vs 3 samples, rank 1 has an empty micro-batch)
SPLIT = {0: [[0, 1], [2], [3, 4, 5]], 1: [[6], [], [7, 8]]}
NO_TARGET_SAMPLE = 7
SIZES = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=40, seq_length=64,
             precision="fp32")


@pytest.mark.megatron
def test_megatron_gradient_equals_contract_gradient(tmp_path: Path) -> None:
    rank_group([sys.executable, __file__, str(tmp_path / "result.json")], 2, timeout=240)
    result = json.loads((tmp_path / "result.json").read_text())
    assert set(result) == {f"{a}/{b}" for a, b in COMBOS}
    for combo, r in result.items():
        # fp32 throughout; packing vs one-sample-at-a-time only changes summation order (~1e-7 relative).
        assert r["grad_norm_ref"] > 0, combo
        assert r["rel_err"] <= 1e-6, (combo, r)
        assert abs(r["objective"] - r["objective_ref"]) <= 1e-6 * max(1.0, abs(r["objective_ref"])), (combo, r)
    # the two normalisations really differ (the test would not notice a swapped denominator otherwise)
    assert abs(result["sft/sample"]["objective_ref"] - result["sft/token"]["objective_ref"]) > 1e-3


# ---------------------------------------------------------------------------------------------- subprocess worker
def _reference(model, samples, idx, loss_type, normalization, gbs, loss_tokens):
    """The contract objective J_s, written out sample by sample (no packing, no Megatron schedule)."""
    import torch
    import torch.nn.functional as F

    total = 0.0
    for i in idx:
        toks = torch.as_tensor(samples.tokens[i], dtype=torch.long)
        mask = torch.as_tensor(samples.loss_masks[i], dtype=torch.float32)
        logits = model(input_ids=toks[None], position_ids=torch.arange(len(toks))[None], attention_mask=None)[0]
        nll = F.cross_entropy(logits[:-1].float(), toks[1:], reduction="none")  # predicts tokens 1..L-1
        m = mask[1:]
        loss = nll if loss_type == "sft" else float(samples.advantages[i]) * nll
        if normalization == "sample":
            n = m.sum()
            total = total + ((loss * m).sum() / n if n > 0 else loss.sum() * 0.0) / gbs
        else:
            total = total + (loss * m).sum() / loss_tokens
    return total


def _worker(out_path: str) -> None:
    from trainingrun.modeling.architecture import resolve
    from trainingrun.modeling.model import build_model, init_distributed, prepare_device, set_seed
    from trainingrun.trainer.optim import wrap_ddp

    device = prepare_device(0)
    init_distributed(device)
    import torch
    import torch.distributed as dist

    from trainingrun.contract.published import rank_payload
    from trainingrun.trainer.batch import pack
    from trainingrun.trainer.loss import LossSettings, StepTotals
    from trainingrun.trainer.step import forward_backward
    from tests.synthetic import loss_tokens_of, make_samples

    rank = dist.get_rank()
    set_seed(11)
    model = build_model(resolve(**SIZES), device)
    ddp = wrap_ddp(model)
    samples = make_samples(9, vocab=SIZES["vocab_size"], seed=5, min_len=2, max_len=9, group_size=3)
    samples.loss_masks[NO_TARGET_SAMPLE][:] = 0
    all_idx = sorted(i for mbs in SPLIT.values() for mb in mbs for i in mb)
    gbs, loss_tokens = len(all_idx), loss_tokens_of(samples, all_idx)
    mine = [i for mb in SPLIT[rank] for i in mb]
    payload = rank_payload(samples, mine)
    positions, p = [], 0
    for mb in SPLIT[rank]:
        positions.append(list(range(p, p + len(mb))))
        p += len(mb)
    result = {}
    for loss_type, norm in COMBOS:
        ddp.zero_grad_buffer()
        mbs = [pack(payload, pos, device) for pos in positions]
        stats = forward_backward(ddp, mbs, LossSettings(loss_type, norm),
                                 StepTotals(global_batch_size=gbs, loss_tokens=loss_tokens), dp_size=2)
        dist.all_reduce(stats)
        grads = torch.cat([prm.main_grad.detach().flatten().double() for prm in model.parameters()])
        if rank == 0:
            ref = build_model(resolve(**SIZES), device)
            ref.load_state_dict(model.state_dict())
            params = list(ref.parameters())
            objective = _reference(ref, samples, all_idx, loss_type, norm, gbs, loss_tokens)
            ref_grads = torch.autograd.grad(objective, params, allow_unused=True)
            g_ref = torch.cat([(g if g is not None else torch.zeros_like(q)).flatten().double()
                               for g, q in zip(ref_grads, params)])
            result[f"{loss_type}/{norm}"] = {
                "rel_err": float((grads - g_ref).norm() / g_ref.norm()),
                "grad_norm_ref": float(g_ref.norm()),
                "objective": float(stats[0, 0]),
                "objective_ref": float(objective),
            }
    if rank == 0:
        Path(out_path).write_text(json.dumps(result, indent=1))
    dist.barrier()


if __name__ == "__main__":
    _worker(sys.argv[1])
    from trainingrun.modeling.model import end_distributed  # deferred: torch, the CPU shim

    end_distributed()  # as Trainer.close: no gloo group left to the interpreter's finalisation
