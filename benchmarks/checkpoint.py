"""Checkpoint benchmark on CPU (real Megatron-core, gloo): prints figures, asserts nothing.

A GPT model (default ~58 M parameters: 8 layers, hidden 512, vocabulary 32000, fp32, Adam) trains one step at
data-parallel size --save-dp, saves a checkpoint (Megatron distributed checkpointing + our manifest), and is
resumed at each size of --load-dps (resharded when it differs). Per layout it prints: the checkpoint's bytes, the
seconds to write the shards and to commit (hashes, fsync, rename), and the seconds to resume (verify every file's
SHA-256, then load and reshard). The first and a second save are printed apart: the first once paid for a spawned
Manager process of megatron-core's writer (trainer/checkpoint_megatron.py; 58 M parameters at DP 2: first save's
shards 4.45 s against 1.85 s for the second, now 2.00 s and 1.97 s).

Run: `.venv/bin/python benchmarks/checkpoint.py [--hidden H] [--layers L] [--vocab V] [--save-dp 2] [--load-dps 1,3]`
(each layout runs as its own group of processes; this script starts them).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world: int, *args: str) -> dict:
    port = _free_port()
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", *args], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs = [p.communicate()[0] for p in procs]
    for p, out in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"worker failed:\n{out[-3000:]}")
    return json.loads(next(line for line in outs[0].splitlines() if line.startswith("{")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--save-dp", type=int, default=2)
    ap.add_argument("--load-dps", default="1,3")
    ap.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        return _worker(args, *args.worker)
    with tempfile.TemporaryDirectory() as tmp:
        root = str(Path(tmp) / "ckpt")
        saved = _run(args.save_dp, "save", root)
        print(f"model: {saved['params'] / 1e6:.1f} M parameters; checkpoint {saved['bytes'] / 2**20:.0f} MiB "
              f"({saved['files']} files); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        for i, s in enumerate(saved["saves"]):
            print(f"save {i + 1} at DP {args.save_dp}: shards {s['shards']:.2f} s, total {s['total']:.2f} s "
                  f"({s['bytes'] / 2**20 / s['total']:.0f} MiB/s)")
        for dp in [int(x) for x in args.load_dps.split(",") if x]:
            got = _run(dp, "load", root)
            print(f"resume at DP {dp} ({'resharded' if dp != args.save_dp else 'same layout'}): "
                  f"{got['resume']:.2f} s (verify + load), loss after resume equal: {got['loss'] == saved['loss']} "
                  f"(rel diff {abs(got['loss'] - saved['loss']) / abs(saved['loss']):.1e})")


def _worker(args, mode: str, root: str) -> None:
    from trainingrun.modeling.architecture import resolve
    from trainingrun.modeling.model import build_model, init_distributed, prepare_device, set_seed
    from trainingrun.trainer.optim import OptimSettings, build_optimizer, wrap_ddp

    device = prepare_device(0)
    init_distributed(device)
    import numpy as np
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from trainingrun.schedule import build_dp_schedule
    from trainingrun.trainer.batch import pack
    from trainingrun.trainer.checkpoint import TrainingProgress
    from trainingrun.trainer.checkpoint_megatron import TrainerCheckpoints
    from trainingrun.trainer.loss import LossSettings, StepTotals
    from trainingrun.trainer.step import train_step

    set_seed(0)
    arch = resolve(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                   ffn_hidden_size=4 * args.hidden, vocab_size=args.vocab, seq_length=128, precision="fp32")
    model = build_model(arch, device)
    ddp = wrap_ddp(model)
    optimizer, scheduler = build_optimizer(ddp, OptimSettings(1e-4, 1e-5, 0, None, "constant", 0.0, 1.0, 0.9, 0.95))
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    ck = TrainerCheckpoints(Path(root), ddp.module, optimizer, scheduler, attempt=0, keep=3, log=lambda m: None,
                            meta={"run": "bench", "dp_size": dp, "tp_size": 1, "model": arch.to_dict()})

    def step() -> float:
        rng = np.random.default_rng(5)
        toks = [rng.integers(0, args.vocab, int(n)).astype(np.int32) for n in rng.integers(8, 64, 12)]
        sched = build_dp_schedule([len(t) for t in toks], dp_size=dp, max_tokens_per_gpu=256)
        part = sched.partitions[rank]
        payload = {"tokens": np.concatenate([toks[i] for i in part]),
                   "loss_mask": np.concatenate([np.ones(len(toks[i]), np.uint8) for i in part]),
                   "offsets": np.concatenate([[0], np.cumsum([len(toks[i]) for i in part])]).astype(np.int64),
                   "advantages": np.ones(len(part), np.float32), "rewards": np.ones(len(part), np.float32),
                   "sample_ids": np.asarray(part, np.int64)}
        pos = {i: p for p, i in enumerate(part)}
        mbs = [pack(payload, [pos[i] for i in mb], device) for mb in sched.step_microbatches(rank, 0)]
        return train_step(ddp, optimizer, scheduler, mbs, LossSettings("sft", "token"),
                          StepTotals(global_batch_size=12, loss_tokens=sum(len(t) - 1 for t in toks)), dp_size=dp,
                          dp_group=ps.get_data_parallel_group()).loss

    out: dict = {"params": sum(p.numel() for p in model.parameters()) * ps.get_tensor_model_parallel_world_size()}
    if mode == "save":
        step()
        saves = []
        for i in (1, 2):
            res = ck.save(TrainingProgress(global_step=i, rollout=i, samples_consumed=12 * i))
            saves.append({"shards": res.seconds_shards, "total": res.seconds_total, "bytes": res.bytes})
        out.update(saves=saves, bytes=saves[-1]["bytes"], loss=step(),
                   files=sum(1 for p in Path(root, "step_00000002").rglob("*") if p.is_file()))
    else:
        t0 = time.perf_counter()
        ck.resume()
        out.update(resume=time.perf_counter() - t0, loss=step())
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
