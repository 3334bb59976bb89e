"""Trainer benchmark on CPU (one rank, real Megatron-core): prints figures, asserts nothing.

1. Packed (THD, no padding) vs padded micro-batches for the same schedule: tokens/s counted in real tokens, and the
   padding waste (padded tokens / real tokens − 1). Padding pads each sample to the longest of its micro-batch.
2. Variable vs fixed global batch size on the same samples: the same pool trained as steps of varying size (what
   dynamic sampling produces) and as equal steps; cost per sample and its ratio.

Run: `.venv/bin/python benchmarks/trainer.py [--steps N] [--hidden H]`. Runs itself in a subprocess-free way: this
script is the process, with WORLD_SIZE=1 over gloo.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the hand-built rollouts of the tests (tests/synthetic.py)

from trainingrun.local.procs import free_port  # noqa: E402 - after the path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=96, help="samples in the pool")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=120, help="longest prompt (heavy-tailed lengths)")
    ap.add_argument("--max-tokens", type=int, default=1024, help="maxTokensPerGPU of the schedule")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))

    from trainingrun.modeling.architecture import resolve
    from trainingrun.modeling.model import build_model, init_distributed, prepare_device, set_seed
    from trainingrun.trainer.optim import OptimSettings, build_optimizer, wrap_ddp

    device = prepare_device(0)
    init_distributed(device)
    import torch

    from trainingrun.schedule import build_dp_schedule
    from trainingrun.contract.published import rank_payload
    from trainingrun.trainer.batch import step_microbatches
    from trainingrun.trainer.loss import LossSettings, StepTotals
    from trainingrun.trainer.step import train_step
    from tests.synthetic import loss_tokens_of, make_samples

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    set_seed(0)
    vocab = 256
    arch = resolve(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4,
                   ffn_hidden_size=4 * args.hidden, vocab_size=vocab, seq_length=2 * args.max_len + 2, precision="fp32")
    ddp = wrap_ddp(build_model(arch, device))
    loss = LossSettings("sft", "sample")
    opt, sched = build_optimizer(ddp, OptimSettings(1e-4, 0.0, 0, None, "constant", 0.0, 1.0, 0.9, 0.999))

    # heavy-tailed lengths: most samples short, a few long
    rng = np.random.default_rng(0)
    pool = make_samples(args.samples, vocab=vocab, seed=1, min_len=4, max_len=args.max_len, group_size=1)
    for i in range(args.samples):
        plen = int(min(args.max_len, 4 + rng.pareto(1.5) * 10))
        p = rng.integers(2, vocab, plen)
        pool.tokens[i] = np.concatenate([p, [1], p[::-1]]).astype(np.int32)
        m = np.zeros(len(pool.tokens[i]), np.uint8)
        m[plen + 1:] = 1
        pool.loss_masks[i] = m

    def run_steps(step_sizes: list[int], padded: bool) -> tuple[float, int, int]:
        """Train the pool as consecutive steps of `step_sizes` samples; (seconds, real tokens, computed tokens)."""
        secs = real = computed = 0
        start = 0
        for n in step_sizes:
            idx = list(range(start, start + n))
            start += n
            lens = [len(pool.tokens[i]) for i in idx]
            s = build_dp_schedule(lens, dp_size=1, max_tokens_per_gpu=args.max_tokens).to_dict()
            payload = rank_payload(pool, [idx[p] for p in s["partitions"][0]])
            gbs = sum(s["global_batch_sizes"])
            first = 0
            for m in s["num_microbatches"]:
                positions = s["micro_batch_indices"][0][first:first + m]
                first += m
                mbs = step_microbatches(payload, positions, device, pad_to_longest=padded)
                t0 = time.perf_counter()
                train_step(ddp, opt, sched, mbs, loss, StepTotals(global_batch_size=gbs,
                                                                  loss_tokens=loss_tokens_of(pool, idx)), dp_size=1)
                secs += time.perf_counter() - t0
                real += sum(int(mb.loss.lengths.sum()) for mb in mbs)
                computed += sum(int(mb.input_ids.shape[1]) for mb in mbs)
        return secs, real, computed

    fixed = [16] * (args.samples // 16)
    variable_base = [8, 20, 12, 32, 24]  # what a zero-variance filter makes of equal rollouts
    variable = (variable_base * (args.samples // sum(variable_base) + 1))
    out, total = [], 0
    for v in variable:
        if total + v > sum(fixed):
            break
        out.append(v)
        total += v
    if total < sum(fixed):
        out.append(sum(fixed) - total)
    variable = out

    run_steps([8], padded=False)  # warm-up
    best = {}
    for name, sizes_, padded in (("packed", fixed, False), ("padded", fixed, True), ("variable", variable, False)):
        runs = [run_steps(sizes_, padded) for _ in range(args.repeats)]
        best[name] = min(runs, key=lambda r: r[0])
        secs, real, computed = best[name]
        print(f"{name:9s} steps {len(sizes_):3d}  samples {sum(sizes_):4d}  real tokens {real:6d}  computed {computed:6d}"
              f"  {secs:7.3f}s  {real / secs:9.0f} tokens/s  {sum(sizes_) / secs:7.1f} samples/s", flush=True)
    p, q, v = best["packed"], best["padded"], best["variable"]
    print(f"packed vs padded throughput (real tokens/s): {(p[1] / p[0]) / (q[1] / q[0]):.2f}x")
    print(f"padding waste: {q[2] / q[1] - 1:.1%} extra tokens computed when padding to the micro-batch's longest")
    print(f"variable vs fixed global batch size, cost per sample: {(v[0] / sum(variable)) / (p[0] / sum(fixed)):.3f}x "
          f"(steps {variable} vs {len(fixed)} x 16)")


if __name__ == "__main__":
    main()
