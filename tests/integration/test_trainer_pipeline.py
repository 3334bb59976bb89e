"""Pipeline parallelism on real Megatron code (gloo, CPU): PP 2 trains exactly what PP 1 trains, and checkpoints move
between the two.

The model is Llama-shaped with tied embeddings (the last stage's copy of the embedding is kept equal to the first's
through Megatron's embedding group), 4 layers. The data has the variable global batch of a real run: three steps of
6, 3 and 9 samples over 2 data-parallel ranks, scheduled as the rollout schedules them (token cap 40,
microbatchMultiple 2) — uneven ranks, 2 to 4 packed micro-batches per step, each of another length (the stages
exchange the shape first), one of them empty. Megatron runs in subprocesses (this file as a script), one group per
layout, in this order:

  pp1     PP 1 × DP 2 (2 ranks): the reference — step-1 gradients, 3 steps' losses, a checkpoint after step 2
  pp2     PP 2 × DP 2 (4 ranks), from pp1's initial weights: the same gradients and losses; its checkpoint after step 2
          holds the same tensors under the same keys; the stages gathered (`gather_live_state`) are pp1's model
  pp2to1  PP 1 × DP 2 resumes pp2's checkpoint: step 3 is pp1's step 3
  pp1to2  PP 2 × DP 1 (2 ranks) resumes pp1's checkpoint: step 3 is pp1's step 3
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.services import rank_group

ARCH = dict(architecture="llama", num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
            head_dim=8, ffn_hidden_size=48, vocab_size=64, seq_length=64, normalization="RMSNorm", norm_epsilon=1e-5,
            activation="swiglu", rope_base=10000.0, rope_scaling_factor=None, tie_embeddings=True,
            add_bias_linear=False, add_qkv_bias=False, kv_channels=8, transformer_impl="local", hf=None,
            precision="fp32")
STEP_SAMPLES = (6, 3, 9)  # samples of steps 1, 2, 3: the global batch varies
SAVE_AFTER = 2


def _group(tmp: Path, world: int, mode: str, pp: int, timeout: float = 420) -> list[str]:
    return rank_group([sys.executable, __file__, str(tmp), mode, str(pp)], world, timeout=timeout, what=mode)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, list[str]]]:
    tmp = tmp_path_factory.mktemp("pipeline")
    outs = {"pp1": _group(tmp, 2, "pp1", 1), "pp2": _group(tmp, 4, "pp2", 2)}
    outs["pp2to1"] = _group(tmp, 2, "pp2to1", 1)
    outs["pp1to2"] = _group(tmp, 2, "pp1to2", 2)
    return tmp, outs


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.megatron
def test_pp2_gives_the_pp1_gradients_and_losses(runs) -> None:
    import torch

    tmp, _ = runs
    ref, got = ({k: v for part in sorted(tmp.glob(f"{mode}-grads-rank*.pt"))  # data-parallel rank 0 of each stage
                 for k, v in torch.load(part, weights_only=True).items()} for mode in ("pp1", "pp2"))
    assert sorted(got) == sorted(ref)  # every tensor once: the last stage's tied copy is not a tensor of its own
    worst = max(_rel(got[k], ref[k]) for k in ref if ref[k].norm() > 0)
    a = json.loads((tmp / "pp1-record.json").read_text())
    b = json.loads((tmp / "pp2-record.json").read_text())
    print(f"PP2 vs PP1: gradient rel err {worst:.2e}; losses {b['losses']} vs {a['losses']}")
    assert worst <= 1e-5, worst
    assert [a["gbs"], b["gbs"]] == [list(STEP_SAMPLES)] * 2
    assert b["empty_microbatches"] >= 1 and b["microbatches"] == a["microbatches"]  # what the stages exchanged
    for x, y in zip(b["losses"], a["losses"], strict=True):
        assert abs(x - y) <= 1e-5 * abs(y), (b["losses"], a["losses"])
    for x, y in zip(b["grad_norms"], a["grad_norms"], strict=True):
        assert abs(x - y) <= 1e-5 * abs(y), (b["grad_norms"], a["grad_norms"])
    assert a["losses"][-1] < a["losses"][0]  # it trained


@pytest.mark.megatron
def test_the_stages_gathered_are_the_whole_model(runs) -> None:
    import torch

    tmp, _ = runs
    whole = torch.load(tmp / "pp1-state.pt", weights_only=True)
    gathered = torch.load(tmp / "pp2-state.pt", weights_only=True)  # written by PP rank 0 of DP replica 0 only
    assert sorted(gathered) == sorted(whole)
    assert max(_rel(gathered[k], whole[k]) for k in whole) <= 1e-5


@pytest.mark.megatron
def test_a_pp2_checkpoint_holds_the_pp1_tensors_and_each_resumes_at_the_other_size(runs) -> None:
    from trainingrun.trainer import checkpoint as ckpt

    tmp, outs = runs
    step = ckpt.step_name(SAVE_AFTER)
    a, b = ckpt.read_tensors(tmp / "ckpt-pp1" / step), ckpt.read_tensors(tmp / "ckpt-pp2" / step)
    assert sorted(a) == sorted(b) and any(k.startswith("optimizer.state.exp_avg.") for k in a)
    for key in a:  # same keys and global shapes whatever the layout; values up to summation order
        assert a[key].shape == b[key].shape, key
        if a[key].norm() > 0:
            assert _rel(b[key], a[key]) <= 1e-4, key
    assert ckpt.read_meta(tmp / "ckpt-pp2" / step)["pp_size"] == 2
    ref = json.loads((tmp / "pp1-record.json").read_text())["losses"]
    for mode, sizes in (("pp2to1", "data-parallel 2 / tensor-parallel 1 / pipeline-parallel 2, loaded at 2 / 1 / 1"),
                        ("pp1to2", "data-parallel 2 / tensor-parallel 1 / pipeline-parallel 1, loaded at 1 / 1 / 2")):
        got = json.loads((tmp / f"{mode}-record.json").read_text())["losses"]
        assert len(got) == len(STEP_SAMPLES) - SAVE_AFTER
        assert abs(got[0] - ref[SAVE_AFTER]) <= 1e-5 * abs(ref[SAVE_AFTER]), (mode, got, ref)
        assert f"resharded {step}: written at {sizes}" in outs[mode][0]


# ---------------------------------------------------------------------------------------------- subprocess worker
def _steps(dp: int):
    from tests.synthetic import make_samples
    from trainingrun.contract.published import build_published

    out = []
    for k, n in enumerate(STEP_SAMPLES):
        samples = make_samples(n, vocab=ARCH["vocab_size"], seed=k, group_size=1, id_base=100 * k)
        published, payloads, _ = build_published(k, samples, dp_size=dp, groups_per_step=None, max_tokens_per_gpu=40,
                                                  micro_batch_size=None, microbatch_multiple=2, step_offset=k,
                                                  samples_offset=0)
        out.append((published, payloads))
    return out


def _worker(tmp: str, mode: str, pp: int) -> None:
    from trainingrun.modeling.model import init_distributed, prepare_device

    device = prepare_device(0)
    init_distributed(device, pp=pp)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from trainingrun.modeling import pipeline
    from trainingrun.modeling.architecture import Architecture
    from trainingrun.modeling.convert import canonical_names
    from trainingrun.modeling.model import build_model, load_canonical_state, set_seed
    from trainingrun.modeling.state import gather_live_state
    from trainingrun.trainer.batch import step_microbatches
    from trainingrun.trainer.checkpoint import TrainingProgress
    from trainingrun.trainer.checkpoint_megatron import TrainerCheckpoints
    from trainingrun.trainer.loss import LossSettings, StepTotals
    from trainingrun.trainer.optim import OptimSettings, build_optimizer, wrap_ddp
    from trainingrun.trainer.step import forward_backward, train_step

    out = Path(tmp)
    arch = Architecture.from_dict(ARCH)
    dp, dp_rank, pp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), \
        ps.get_pipeline_model_parallel_rank()
    set_seed(7)
    model = build_model(arch, device)
    if mode == "pp1":
        if dist.get_rank() == 0:
            torch.save(canonical_names(model.state_dict()), out / "start.pt")
    else:  # the reference's initial weights (a checkpoint replaces them when resuming)
        load_canonical_state(model, pipeline.to_stage(torch.load(out / "start.pt", weights_only=True), arch,
                                                      pp_rank, pp))
    ddp = wrap_ddp(model)
    opt = OptimSettings(lr=3e-3, min_lr=3e-4, warmup_samples=4, decay_samples=100, decay_style="cosine",
                        weight_decay=0.01, clip_grad=1.0, beta1=0.9, beta2=0.95)
    optimizer, scheduler = build_optimizer(ddp, opt, "fp32")
    meta = {"run": "t", "dp_size": dp, "tp_size": 1, "pp_size": pp, "model": arch.to_dict()}

    def checkpoints(where: str) -> TrainerCheckpoints:
        return TrainerCheckpoints(out / where, ddp.module, optimizer, scheduler, attempt=0, meta=meta, keep=2,
                                  log=lambda m: print(f"[rank {dist.get_rank()}] {m}", flush=True))

    progress = TrainingProgress()
    if mode in ("pp2to1", "pp1to2"):
        resumed = checkpoints("ckpt-pp2" if mode == "pp2to1" else "ckpt-pp1").resume()
        assert resumed is not None
        progress = resumed.progress
    loss = LossSettings("sft", "sample")
    record = {"losses": [], "grad_norms": [], "gbs": [], "microbatches": [], "empty_microbatches": 0}
    for k, (published, payloads) in enumerate(_steps(dp)):
        if k < progress.global_step:
            continue
        step = published.steps()[0]
        mbs = step_microbatches(payloads[dp_rank], published.microbatch_positions(dp_rank, step), device)
        totals = StepTotals(global_batch_size=step.global_batch_size, loss_tokens=step.loss_tokens)
        if k == 0 and mode in ("pp1", "pp2"):  # the step's gradient, before any update
            ddp.zero_grad_buffer()
            forward_backward(ddp, mbs, loss, totals, dp_size=dp)
            names = {id(p): n for n, p in model.named_parameters()}
            grads = canonical_names({names[id(p)]: p.main_grad.detach().clone() for p in model.parameters()})
            if dp_rank == 0:
                torch.save(pipeline.to_whole(grads, arch, pp_rank, pp), out / f"{mode}-grads-rank{dist.get_rank()}.pt")
        res = train_step(ddp, optimizer, scheduler, mbs, loss, totals, dp_size=dp, dp_group=ps.get_data_parallel_group())
        record["losses"].append(res.loss)
        record["grad_norms"].append(res.grad_norm)
        record["gbs"].append(res.samples)
        record["microbatches"].append(step.num_microbatches)
        record["empty_microbatches"] += sum(1 for mb in mbs if not mb.loss.num_samples)
        progress.global_step = progress.rollout = k + 1
        progress.samples_consumed += step.global_batch_size
        if progress.global_step == SAVE_AFTER and mode in ("pp1", "pp2"):
            checkpoints(f"ckpt-{mode}").save(progress)
    state = gather_live_state(model, arch, pp_group=ps.get_pipeline_model_parallel_group(), pp_size=pp,
                              pp_rank=pp_rank)
    empties = torch.tensor([float(record["empty_microbatches"])])
    dist.all_reduce(empties)
    record["empty_microbatches"] = int(empties.item())
    assert (state is not None) == (pp_rank == 0)  # on the first stage of each data-parallel replica
    if dist.get_rank() == 0:
        torch.save(state, out / f"{mode}-state.pt")
        (out / f"{mode}-record.json").write_text(json.dumps(record))
    dist.barrier()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    from trainingrun.modeling.model import end_distributed  # deferred: torch, the CPU shim

    end_distributed()  # as Trainer.close: no gloo group left to the interpreter's finalisation
