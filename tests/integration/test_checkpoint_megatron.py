"""Checkpoints through Megatron's distributed checkpointing reshard: written at one data-/tensor-parallel layout,
resumed at others, training continues as if uninterrupted; a damaged newest checkpoint falls back to the previous.

The model is Llama-shaped (RMSNorm, SwiGLU, grouped-query attention: 4 heads, 2 KV groups), so the gated MLP and
the grouped QKV layout are resharded too. Megatron runs in subprocesses (this file as a script, gloo on CPU), one
group per layout, in this order:
  save   TP1 DP2: 6 steps, checkpoints after steps 2 and 4 (keep 2); the per-step losses are the reference
  dp3    TP1 DP3 resumes step 4 → steps 5-6 match the reference
  tp2    TP2 DP1 resumes step 4, saves it again elsewhere (TP 2 shards: every tensor, model and Adam moments, equals
         the TP1 checkpoint's exactly), then trains steps 5-6 → match the reference
  tp2to1 TP1 DP1 resumes that TP2 checkpoint → steps 5-6 match the reference
  dp1    after step 4's shard is truncated (COMPLETE still there): falls back to step 2, names the path and why,
         trains steps 3-6 to the reference
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.services import rank_group

MODEL = {"architecture": "llama", "numLayers": 2, "hiddenSize": 32, "numAttentionHeads": 4, "numQueryGroups": 2,
         "ffnHiddenSize": 64, "vocabSize": 40, "seqLength": 64,
         "precision": os.environ.get("CKPT_TEST_PRECISION", "fp32")}
STEPS = 6
SAMPLES = 12


def _group(tmp: Path, world: int, *args: str, precision: str = "fp32") -> list[str]:
    return rank_group([sys.executable, __file__, *args], world, timeout=300, cwd=tmp,
                      env={"CKPT_TEST_PRECISION": precision}, what=str(args))


@pytest.mark.megatron
def test_checkpoints_reshard_and_fall_back(tmp_path: Path) -> None:
    from trainingrun.trainer import checkpoint as ckpt

    root, root_tp2 = tmp_path / "ckpt", tmp_path / "ckpt_tp2"
    _group(tmp_path, 2, "save", str(root), "1")
    ref = json.loads((tmp_path / "losses-save.json").read_text())
    assert sorted(ref) == [str(s) for s in range(1, STEPS + 1)]
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000002", "step_00000004"]
    meta = ckpt.read_meta(root / "step_00000004")
    assert (meta["dp_size"], meta["tp_size"], meta["model"]["num_query_groups"]) == (2, 1, 2)

    def same_losses(name: str, steps: range, rel: float = 1e-6) -> None:
        got = json.loads((tmp_path / f"losses-{name}.json").read_text())
        assert sorted(got, key=int) == [str(s) for s in steps], name
        for s in steps:  # only the summation order differs between layouts
            assert got[str(s)] == pytest.approx(ref[str(s)], rel=rel), (name, s, got[str(s)], ref[str(s)])

    outs = _group(tmp_path, 3, "dp3", str(root), "1")
    same_losses("dp3", range(5, STEPS + 1))
    assert ("resharded step_00000004: written at data-parallel 2 / tensor-parallel 1 / pipeline-parallel 1, "
            "loaded at 3 / 1 / 1") in outs[0]

    _group(tmp_path, 2, "tp2", str(root), "2", str(root_tp2))
    a, b = ckpt.read_tensors(root / "step_00000004"), ckpt.read_tensors(root_tp2 / "step_00000004")
    assert ckpt.read_meta(root_tp2 / "step_00000004")["tp_size"] == 2
    assert sorted(a) == sorted(b) and any(k.startswith("optimizer.state.exp_avg_sq.") for k in a)
    for key in a:
        assert a[key].shape == b[key].shape and bool((a[key] == b[key]).all()), key
    same_losses("tp2", range(5, STEPS + 1), rel=1e-5)  # tensor-parallel matmuls sum in another order

    _group(tmp_path, 1, "tp2to1", str(root_tp2), "1")
    same_losses("tp2to1", range(5, STEPS + 1))

    shard = next((root / "step_00000004" / "dist").glob("__*.distcp"))
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    outs = _group(tmp_path, 1, "dp1", str(root), "1")
    same_losses("dp1", range(3, STEPS + 1))
    rel = shard.relative_to(root / "step_00000004")
    assert (f"checkpoint {root / 'step_00000004'} cannot be loaded: {rel} has {size // 2} bytes, {size} were "
            "written (truncated or replaced); trying the previous one") in outs[0]
    assert (root / "step_00000004.unloadable-a0").is_dir()
    model = ckpt.model_tensors(root / "step_00000002")
    assert model["decoder.layers.1.mlp.linear_fc1.weight"].shape == (128, 32)  # [gate; up]
    assert model["decoder.layers.1.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 8, 32)


@pytest.mark.megatron
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_checkpoints_save_and_resume_exactly(tmp_path: Path, precision: str) -> None:
    """bf16/fp16 models checkpoint (the optimizer's fp32 main parameters and moments included) and resume to the
    uninterrupted run's losses. Regression: the local spec's norms stayed fp32 in a half-precision model, and
    Megatron's optimizer could not map them ("Param id ... does not match any model sharded param"): no half-precision
    run could write a checkpoint (seen first on an H200, then here)."""
    from trainingrun.trainer import checkpoint as ckpt

    root = tmp_path / "ckpt"
    _group(tmp_path, 1, "save", str(root), "1", precision=precision)
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000002", "step_00000004"]
    ref = json.loads((tmp_path / "losses-save.json").read_text())
    _group(tmp_path, 1, "dp1", str(root), "1", precision=precision)
    got = json.loads((tmp_path / "losses-dp1.json").read_text())
    assert sorted(got, key=int) == ["5", "6"]
    for s in ("5", "6"):  # same layout, same fp32 main parameters: the very same numbers
        assert got[s] == ref[s], (s, got, ref)


# ---------------------------------------------------------------------------------------------- subprocess worker
def _batch(step: int, dp: int, dp_rank: int, device):
    """Step `step`'s micro-batches of this rank: 12 seeded samples, scheduled over `dp` ranks."""
    import numpy as np

    from trainingrun.schedule import build_dp_schedule
    from trainingrun.trainer.batch import pack

    rng = np.random.default_rng(step)
    toks, masks = [], []
    for _ in range(SAMPLES):
        n = int(rng.integers(4, 20))
        toks.append(rng.integers(2, MODEL["vocabSize"], n).astype(np.int32))
        masks.append((np.arange(n) >= n // 2).astype(np.uint8))
    sched = build_dp_schedule([len(t) for t in toks], dp_size=dp, max_tokens_per_gpu=48)
    part = sched.partitions[dp_rank]
    payload = {
        "tokens": np.concatenate([toks[i] for i in part]), "loss_mask": np.concatenate([masks[i] for i in part]),
        "offsets": np.concatenate([[0], np.cumsum([len(toks[i]) for i in part])]).astype(np.int64),
        "advantages": np.ones(len(part), np.float32), "rewards": np.ones(len(part), np.float32),
        "sample_ids": np.asarray(part, np.int64),
    }
    pos = {i: p for p, i in enumerate(part)}
    mbs = [pack(payload, [pos[i] for i in mb], device) for mb in sched.step_microbatches(dp_rank, 0)]
    loss_tokens = sum(int(m[1:].sum()) for m in masks)
    return mbs, loss_tokens


def _worker(mode: str, root: str, tp: int, out_root: str | None) -> None:
    from trainingrun.api.spec.model import ModelSpec
    from trainingrun.modeling.model import build_model, init_distributed, prepare_device, set_seed
    from trainingrun.trainer.optim import OptimSettings, build_optimizer, wrap_ddp

    device = prepare_device(0)
    init_distributed(device, tp=tp)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from trainingrun.trainer.checkpoint import TrainingProgress
    from trainingrun.trainer.checkpoint_megatron import TrainerCheckpoints
    from trainingrun.trainer.loss import LossSettings, StepTotals
    from trainingrun.trainer.step import train_step

    set_seed(11)
    sizes = ModelSpec.model_validate(MODEL).resolved()
    model = build_model(sizes, device)
    ddp = wrap_ddp(model)
    opt = OptimSettings(lr=3e-3, min_lr=3e-4, warmup_samples=12, decay_samples=100, decay_style="cosine",
                        weight_decay=0.01, clip_grad=1.0, beta1=0.9, beta2=0.95)
    optimizer, scheduler = build_optimizer(ddp, opt, MODEL["precision"])
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    meta = {"run": "t", "dp_size": dp, "tp_size": tp, "model": sizes.to_dict()}

    def checkpoints(where: str) -> TrainerCheckpoints:
        return TrainerCheckpoints(Path(where), ddp.module, optimizer, scheduler, attempt=0, meta=meta, keep=2,
                                  log=lambda m: print(f"[rank {dist.get_rank()}] {m}", flush=True))

    progress = TrainingProgress()
    if mode != "save":
        resumed = checkpoints(root).resume()
        assert resumed is not None
        progress = resumed.progress
    if mode == "tp2":
        checkpoints(out_root).save(progress)
    losses = {}
    while progress.global_step < STEPS:
        step = progress.global_step + 1
        mbs, loss_tokens = _batch(step, dp, dp_rank, device)
        res = train_step(ddp, optimizer, scheduler, mbs, LossSettings("sft", "token"),
                         StepTotals(global_batch_size=SAMPLES, loss_tokens=loss_tokens), dp_size=dp,
                         dp_group=ps.get_data_parallel_group())
        progress.global_step = step
        progress.rollout = step
        progress.samples_consumed += SAMPLES
        losses[step] = res.loss
        if mode == "save" and step in (2, 4):
            checkpoints(root).save(progress)
    if dist.get_rank() == 0:
        Path(f"losses-{mode}.json").write_text(json.dumps(losses))
    dist.barrier()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
    from trainingrun.modeling.model import end_distributed  # deferred: torch, the CPU shim

    end_distributed()  # as Trainer.close: no gloo group left to the interpreter's finalisation
