"""LoRA vs full training of the same model on CPU (one rank, real Megatron-core): prints one JSON object per line,
asserts nothing.

For each mode (`full`: every parameter trained; `lora`: the base frozen, adapters of rank R on the four dense
targets) a fresh process builds the same llama-family model (seeded), trains `--steps` optimizer steps on the same
synthetic SFT micro-batches and writes one checkpoint through the trainer's own checkpointing
(`trainer.checkpoint_megatron.TrainerCheckpoints`). Its line:

  mode, params, trainable        parameter counts (all / with a gradient)
  step_seconds                   median wall time of one optimizer step (after one warm-up step)
  state_mb                       MiB of parameters + gradients + optimizer state (Adam moments, fp32 masters)
  peak_rss_mb                    MiB, the process's peak resident memory (ru_maxrss: torch, Megatron and everything)
  checkpoint_mb                  MiB, the checkpoint's size on disk (a LoRA one: the adapters and their state only)

Run: `.venv/bin/python benchmarks/lora.py [--hidden 512 --layers 4 --vocab 8192 --rank 16 --steps 6 --rounds 2]`
(the modes alternate, one process each, `--rounds` times); the figures of docs/trainer.md ("LoRA") come from the
defaults. `--mode full|lora` runs one mode in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the hand-built samples of the tests (tests/synthetic.py)

from trainingrun.local.procs import free_port  # noqa: E402 - after the path


def _state_bytes(model, optimizer) -> int:
    import torch

    seen, total = set(), 0

    def add(t) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    for p in model.parameters():
        add(p)
        add(getattr(p, "main_grad", None))
        add(p.grad)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for state in inner.state.values():
            for v in state.values():
                add(v)
    return total


def run_mode(args: argparse.Namespace) -> dict:
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    from trainingrun.modeling.architecture import resolve
    from trainingrun.modeling.lora_base import base_reference
    from trainingrun.modeling.model import build_model, init_distributed, prepare_device, set_seed

    device = prepare_device(0)
    init_distributed(device)
    import torch

    from tests.synthetic import loss_tokens_of, make_samples
    from trainingrun.contract.published import rank_payload
    from trainingrun.modeling.lora import apply_lora
    from trainingrun.modeling.lora_targets import LoRASettings
    from trainingrun.schedule import build_dp_schedule
    from trainingrun.trainer.batch import step_microbatches
    from trainingrun.trainer.checkpoint import TrainingProgress
    from trainingrun.trainer.checkpoint_megatron import TrainerCheckpoints
    from trainingrun.trainer.loss import LossSettings, StepTotals
    from trainingrun.trainer.optim import OptimSettings, build_optimizer, wrap_ddp
    from trainingrun.trainer.step import train_step

    torch.set_num_threads(1)
    set_seed(0)
    arch = resolve(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8, num_query_groups=4,
                   architecture="llama", vocab_size=args.vocab, seq_length=256, precision="fp32")
    model = build_model(arch, device, seed=0)
    if args.mode == "lora":
        apply_lora(model, arch, LoRASettings(rank=args.rank, alpha=2.0 * args.rank), seed=0)
    ddp = wrap_ddp(model)
    opt, sched = build_optimizer(ddp, OptimSettings(1e-4, 1e-4, 0, None, "constant", 0.0, 1.0, 0.9, 0.999))
    pool = make_samples(args.samples, vocab=args.vocab, seed=1, min_len=16, max_len=100, group_size=1)
    idx = list(range(args.samples))
    lens = [len(pool.tokens[i]) for i in idx]
    s = build_dp_schedule(lens, dp_size=1, max_tokens_per_gpu=args.max_tokens).to_dict()
    payload = rank_payload(pool, [idx[p] for p in s["partitions"][0]])
    mbs = step_microbatches(payload, s["micro_batch_indices"][0], device)
    totals = StepTotals(global_batch_size=args.samples, loss_tokens=loss_tokens_of(pool, idx))
    times = []
    for _ in range(args.steps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        train_step(ddp, opt, sched, mbs, LossSettings("sft", "sample"), totals, dp_size=1)
        times.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as root:
        ckpts = TrainerCheckpoints(Path(root), model, opt, sched, attempt=0, keep=1, log=lambda _m: None,
                                   meta={"run": "bench", "dp_size": 1, "tp_size": 1, "pp_size": 1,
                                         "model": arch.to_dict()},
                                   base=(lambda: base_reference(arch, 0)) if args.mode == "lora" else None)
        saved = ckpts.save(TrainingProgress(global_step=args.steps + 1))
    return {"mode": args.mode, "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
            "rank": args.rank if args.mode == "lora" else None, "tokens_per_step": int(sum(lens)),
            "params": sum(p.numel() for p in model.parameters()),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "step_seconds": round(statistics.median(times[1:]), 4),
            "state_mb": round(_state_bytes(model, opt) / 2**20, 2),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "checkpoint_mb": round(saved.bytes / 2**20, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["full", "lora"], default=None, help="one mode in this process")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=512, help="maxTokensPerGPU of the micro-batches")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2,
                    help="full, lora, full, lora, ...: on a shared machine compare the rounds, not one pair")
    args = ap.parse_args()
    if args.mode is not None:
        print(json.dumps(run_mode(args)), flush=True)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for mode in ("full", "lora") * args.rounds:  # each in its own process: its peak memory is its own
        argv = [sys.executable, __file__, "--mode", mode] + [f"--{k.replace('_', '-')}={v}" for k, v in
                                                             vars(args).items() if k not in ("mode", "rounds")]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            sys.exit(f"{mode}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
