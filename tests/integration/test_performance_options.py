"""Megatron's performance options (`spec.trainer.performance`, `trainer.optimizer.distributed`) train on CPU with
the real Megatron code (gloo, 2 data-parallel ranks, subprocesses): each one changes how the step runs — evidence
read off the model (core-attention calls, gradient-buffer type, optimizer shards, overlap hooks) — and not what it
computes: the losses of every fp32 option equal the plain run's, the bf16 ones are within bf16's rounding. The
distributed optimizer's checkpoints (with both overlaps on) resume at data-parallel 2 and 3 to the uninterrupted
run's losses; a run with the plain optimizer is refused before anything loads (and one at another tensor-parallel
size: tests/unit/test_attention_backends.py). The one option Megatron cannot run on CPU (gradient-accumulation
fusion) is refused by name: tests/unit/test_attention_backends.py. Through `trainingrun run`: the options from a
manifest reach the trainer, and a named attention backend the CPU lacks stops the run at start-up with exit 78."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.localrun import finish, records, start
from tests.services import rank_group

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[2]
MODEL = {"architecture": "llama", "numLayers": 2, "hiddenSize": 32, "numAttentionHeads": 4, "numQueryGroups": 2,
         "ffnHiddenSize": 64, "vocabSize": 40, "seqLength": 64}
STEPS = 3
OVERLAPS = {"distributed": True, "overlapGradReduce": True, "overlapParamGather": True}
# name -> (precision, performance options; "distributed" is trainer.optimizer.distributed)
CONFIGS = {
    "plain": ("fp32", {}),
    "distributed": ("fp32", {"distributed": True}),
    "overlap-grad": ("fp32", {"overlapGradReduce": True}),
    "distributed-overlaps": ("fp32", OVERLAPS),
    "selective": ("fp32", {"recompute": {"granularity": "selective"}}),
    "full-uniform": ("fp32", {"recompute": {"granularity": "full"}}),
    "full-block": ("fp32", {"recompute": {"granularity": "full", "method": "block", "numLayers": 1}}),
    "bf16": ("bf16", {}),
    "bf16-reduce": ("bf16", {"gradReduceDtype": "bf16"}),
    "bf16-all": ("bf16", {**OVERLAPS, "gradReduceDtype": "bf16", "recompute": {"granularity": "full"}}),
}


def _group(tmp: Path, world: int, *args: str) -> list[str]:
    return rank_group([sys.executable, __file__, *args], world, timeout=400, cwd=tmp, what=str(args))


def test_every_cpu_option_trains_and_computes_the_same_step(tmp_path: Path) -> None:
    _group(tmp_path, 2, "options")
    res = {r: json.loads((tmp_path / f"options-{r}.json").read_text()) for r in (0, 1)}
    got = res[0]
    assert sorted(got) == sorted(CONFIGS)
    for name, (precision, _) in CONFIGS.items():
        base = got["bf16" if precision == "bf16" else "plain"]
        tol = 2e-2 if name.startswith("bf16-") else 1e-6  # bf16 gradient rounding; fp32: only the order may differ
        for step, (loss, ref) in enumerate(zip(got[name]["losses"], base["losses"]), start=1):
            assert loss == pytest.approx(ref, rel=tol), (name, step, loss, ref)
        for gn, ref in zip(got[name]["grad_norms"][:1], base["grad_norms"][:1]):  # the first step's gradient
            assert gn == pytest.approx(ref, rel=5e-2 if precision == "bf16" else 1e-5), (name, gn, ref)
    # what each option changed. Core attention per micro-batch: 2 layers forward; recomputed in backward by
    # selective (both layers' attention), full uniform (every layer), full block with numLayers 1 (the first)
    calls = {n: got[n]["core_calls_per_microbatch"] for n in CONFIGS}
    assert calls["plain"] == calls["distributed"] == calls["overlap-grad"] == 2
    assert (calls["selective"], calls["full-uniform"], calls["full-block"], calls["bf16-all"]) == (4, 4, 3, 4)
    # the distributed optimizer keeps 1/DP of the main parameters and moments on each rank
    n = got["plain"]["main_numel"]
    assert res[0]["plain"]["main_numel"] == res[1]["plain"]["main_numel"] == n
    for name in ("distributed", "distributed-overlaps", "bf16-all"):
        shards = [res[r][name]["main_numel"] for r in (0, 1)]
        assert sum(shards) == n and max(shards) < n, (name, shards)
    # gradients reduced bucket by bucket during backward; parameters gathered in the forward's pre-hooks
    for name in CONFIGS:
        overlapped = "overlapGradReduce" in CONFIGS[name][1]
        assert (got[name]["grads_ready_during_backward"] > 0) == overlapped, name
        assert (got[name]["param_gathers_in_forward"] > 0) == ("overlapParamGather" in CONFIGS[name][1]), name
    assert {got[n]["grad_dtype"] for n in CONFIGS if "gradReduceDtype" not in CONFIGS[n][1]} == {"torch.float32"}
    assert got["bf16-reduce"]["grad_dtype"] == got["bf16-all"]["grad_dtype"] == "torch.bfloat16"


def test_distributed_optimizer_checkpoints_resume_at_any_data_parallel_size(tmp_path: Path) -> None:
    from trainingrun.trainer import checkpoint as ckpt

    root = tmp_path / "ckpt"
    _group(tmp_path, 2, "save", str(root))  # 4 steps, a checkpoint after step 2, then resumed from it in-process
    ref = json.loads((tmp_path / "losses-save.json").read_text())
    assert sorted(ref, key=int) == ["1", "2", "3", "4"]
    assert ckpt.read_meta(root / "step_00000002")["optimizer"] == "distributed"
    same = json.loads((tmp_path / "losses-resume2.json").read_text())
    assert same == {s: ref[s] for s in ("3", "4")}  # same layout: the very same numbers
    _group(tmp_path, 3, "resume", str(root))  # resharded over three ranks
    got = json.loads((tmp_path / "losses-resume.json").read_text())
    assert sorted(got, key=int) == ["3", "4"]
    for s in ("3", "4"):
        assert got[s] == pytest.approx(ref[s], rel=1e-6), (s, got[s], ref[s])
    outs = _group(tmp_path, 1, "resume-plain", str(root))
    assert (f"checkpoint {root / 'step_00000002'} holds the distributed optimizer's state and this run uses the "
            "plain one (trainer.optimizer.distributed false)") in outs[0]
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000002"]  # nothing set aside


# ---------------------------------------------------------------------------------- through `trainingrun run`
def _spec(path: Path, *, model: dict | None = None, trainer: dict | None = None) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["spec"]["model"] = {"preset": "tiny-llama", **(model or {})}
    doc["spec"]["rollout"].update(numRollouts=4, samplesPerRollout=32)
    doc["spec"]["trainer"]["checkpoint"]["interval"] = 2
    doc["spec"]["trainer"].update(trainer or {})
    doc["spec"]["metrics"] = {"enabled": False}
    doc["spec"]["failurePolicy"] = {"maxRestarts": 0}
    path.write_text(yaml.safe_dump(doc))
    return path


def test_options_from_the_manifest_reach_the_trainer(tmp_path: Path) -> None:
    plain, fast = tmp_path / "plain", tmp_path / "fast"
    code, log = finish(start(_spec(tmp_path / "plain.yaml"), plain))
    assert code == 0, log[-3000:]
    options = {"optimizer": {"lr": 0.003, "minLr": 0.0003, "warmupSamples": 64, "decaySamples": 2000,
                             "decayStyle": "cosine", "clipGrad": 1.0, "distributed": True},
               "performance": {"overlapGradReduce": True, "overlapParamGather": True,
                               "recompute": {"granularity": "full"}}}
    code, log = finish(start(_spec(tmp_path / "fast.yaml", model={"attentionBackend": "sdpa"}, trainer=options),
                             fast))
    assert code == 0, log[-3000:]
    a, b = records(plain), records(fast)
    assert [r["step"] for r in a] == [r["step"] for r in b] and len(a) >= 3
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (x["step"], x["loss"], y["loss"])
    trainer_log = (fast / "logs" / "trainer-0.log").read_text()
    assert "attention: sdpa (named)" in trainer_log
    assert "attention: sdpa (auto: te not taken (TransformerEngine runs on CUDA only (device cpu))" in \
        (plain / "logs" / "trainer-0.log").read_text()
    from trainingrun.trainer import checkpoint as ckpt

    newest = ckpt.complete_checkpoints(fast / "checkpoints")[-1]
    assert ckpt.read_meta(newest)["optimizer"] == "distributed"


def test_a_named_backend_this_cpu_lacks_stops_the_run_at_start_up(tmp_path: Path) -> None:
    out = tmp_path / "flash"
    code, log = finish(start(_spec(tmp_path / "flash.yaml", model={"attentionBackend": "flash", "precision": "bf16"}),
                             out))
    assert code == 78, log[-3000:]
    trainer_log = (out / "logs" / "trainer-0.log").read_text()
    assert ("model.attentionBackend: flash is not available here: it runs on CUDA only (device cpu); allowed here: "
            "sdpa or auto") in trainer_log
    assert "Traceback" not in trainer_log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 0 and len(summary["attempts"]) == 1


# ---------------------------------------------------------------------------------------------- subprocess worker
def _build(precision: str, options: dict, device, *, tp: int = 1):
    """Model, DDP, optimizer and scheduler as the trainer builds them, from a TrainerSpec with `options`."""
    from trainingrun.api.spec.model import ModelSpec
    from trainingrun.api.spec.trainer import TrainerSpec
    from trainingrun.modeling.model import attention_choice, build_model, set_seed
    from trainingrun.trainer.optim import OptimSettings, build_optimizer, performance_settings, wrap_ddp

    perf = dict(options)
    spec = TrainerSpec(max_tokens_per_gpu=48, replicas=int(os.environ["WORLD_SIZE"]), tensor_parallel_size=tp,
                       optimizer={"distributed": perf.pop("distributed", False)}, performance=perf)
    arch = ModelSpec.model_validate({**MODEL, "precision": precision}).resolved()
    model_options, ddp_settings = performance_settings(spec, arch, device, attention_choice(arch, device))
    set_seed(11)
    ddp = wrap_ddp(build_model(arch, device, options=model_options), ddp_settings)
    opt = OptimSettings(lr=3e-3, min_lr=3e-4, warmup_samples=12, decay_samples=100, decay_style="cosine",
                        weight_decay=0.01, clip_grad=1.0, beta1=0.9, beta2=0.95)
    optimizer, scheduler = build_optimizer(ddp, opt, precision)
    return arch, ddp, optimizer, scheduler


def _step(ddp, optimizer, scheduler, step: int, device):
    from megatron.core import parallel_state as ps

    from tests.integration.test_checkpoint_megatron import SAMPLES, _batch
    from trainingrun.trainer.loss import LossSettings, StepTotals
    from trainingrun.trainer.step import train_step

    dp = ps.get_data_parallel_world_size()
    mbs, loss_tokens = _batch(step, dp, ps.get_data_parallel_rank(), device)
    res = train_step(ddp, optimizer, scheduler, mbs, LossSettings("sft", "token"),
                     StepTotals(global_batch_size=SAMPLES, loss_tokens=loss_tokens), dp_size=dp,
                     dp_group=ps.get_data_parallel_group())
    return res, len(mbs)


def _options_worker() -> None:
    import torch.distributed as dist

    from trainingrun.modeling.attention import PackedSDPAttention
    from trainingrun.modeling.model import init_distributed, prepare_device

    device = prepare_device(0)
    init_distributed(device)
    out = {}
    for name, (precision, options) in CONFIGS.items():
        _, ddp, optimizer, scheduler = _build(precision, options, device)
        counts = {"core": 0, "ready": 0, "gather": 0}

        def count(key):
            def hook(*_a, **_k):
                counts[key] += 1
            return hook

        for module in ddp.module.modules():
            if isinstance(module, PackedSDPAttention):
                module.register_forward_hook(count("core"))
        for group in ddp.bucket_groups:
            for method, key in (("register_grad_ready", "ready"), ("finish_param_sync", "gather")):
                original = getattr(group, method)
                setattr(group, method, lambda *a, _o=original, _c=count(key), **k: (_c(), _o(*a, **k))[1])
        losses, norms, core_per_mb = [], [], None
        for step in range(1, STEPS + 1):
            before = counts["core"]
            res, m = _step(ddp, optimizer, scheduler, step, device)
            core_per_mb = core_per_mb or (counts["core"] - before) // m
            losses.append(res.loss)
            norms.append(res.grad_norm)
        inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
        main = [p for o in inner for g in o.param_groups for p in g["params"]]
        out[name] = {"losses": losses, "grad_norms": norms, "core_calls_per_microbatch": core_per_mb,
                     "main_numel": sum(p.numel() for p in main), "grad_dtype": str(ddp.buffers[0].grad_dtype),
                     "grads_ready_during_backward": counts["ready"], "param_gathers_in_forward": counts["gather"]}
    Path(f"options-{dist.get_rank()}.json").write_text(json.dumps(out))
    dist.barrier()


def _checkpoint_worker(mode: str, root: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from trainingrun.modeling.model import init_distributed, prepare_device
    from trainingrun.trainer.checkpoint import CheckpointError, TrainingProgress
    from trainingrun.trainer.checkpoint_megatron import TrainerCheckpoints
    from trainingrun.trainer.optim import params_current

    device = prepare_device(0)
    init_distributed(device)

    def run(name: str, options: dict, *, resume: bool) -> None:
        arch, ddp, optimizer, scheduler = _build("fp32", options, device)
        meta = {"run": "t", "dp_size": ps.get_data_parallel_world_size(), "tp_size": 1, "model": arch.to_dict()}
        checkpoints = TrainerCheckpoints(Path(root), ddp.module, optimizer, scheduler, attempt=0, meta=meta, keep=2,
                                         log=lambda m: print(f"[rank {dist.get_rank()}] {m}", flush=True))
        progress = TrainingProgress()
        if resume:
            try:
                progress = checkpoints.resume().progress
            except CheckpointError as exc:
                print(f"refused: {exc}", flush=True)
                return
        losses = {}
        while progress.global_step < 4:
            step = progress.global_step + 1
            res, _ = _step(ddp, optimizer, scheduler, step, device)
            progress.global_step = progress.rollout = step
            progress.samples_consumed += 12
            losses[step] = res.loss
            if name == "save" and step == 2:
                params_current(ddp)  # as Trainer.save_checkpoint: the gathered parameters, not the next forward's
                checkpoints.save(progress)
        if dist.get_rank() == 0:
            Path(f"losses-{name}.json").write_text(json.dumps(losses))
        dist.barrier()

    if mode == "save":
        run("save", OVERLAPS, resume=False)
        run("resume2", OVERLAPS, resume=True)
    else:
        run(mode, {} if mode == "resume-plain" else OVERLAPS, resume=True)


if __name__ == "__main__":
    if sys.argv[1] == "options":
        _options_worker()
    else:
        _checkpoint_worker(sys.argv[1], sys.argv[2])
    from trainingrun.modeling.model import end_distributed  # deferred: torch, the CPU shim

    end_distributed()  # as Trainer.close: no gloo group left to the interpreter's finalisation
