"""Peak memory of the policy loss's log π and entropy, before and after the chunked vocab-parallel loss (issue 18).

What is measured: one micro-batch's forward and backward of log π(x_t) and the entropy H_t of softmax(z / T) from
logits z [T, V] (the model's output, here a leaf tensor in `--dtype`), i.e. everything the loss allocates besides
the logits themselves (the logits' gradient included: it is part of the loss's backward).

  before  the formula the trainer used before issue 18: log_softmax(z.float() · s) over the whole row [T, V] in
          float32, gather, the entropy −Σ p log p from that [T, V] tensor (no grad), autograd's backward
  after   `trainer.loss.token_logprobs(..., entropy=True, overwrite=True)`: chunks of rows, the logits' gradient
          written in place of the logits (as the trainer calls it)

Each measurement runs in a fresh subprocess: on CUDA the peak of `torch.cuda.max_memory_allocated` above what was
allocated before the loss; on the CPU the growth of the peak resident set (ru_maxrss) above the resident set with
the logits already touched (large blocks are mmap'ed and returned on free, so the peak is the loss's).

The issue's shape is T = 16384, V = 150000. On a small shared CPU machine the "before" path at that shape needs
~60 GB (five [T, V] float32 tensors), so by default it is measured at `--before-tokens` (smaller T, same V) and
extrapolated linearly in T (it is linear: every temporary is [T, V]); `--full` measures it at the full shape too
(a GPU machine). The "after" path is measured at the full shape.

Run: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/loss_memory.py [--tokens 16384] [--vocab 150000]
[--dtype bf16|fp32] [--before-tokens 512,1024] [--full] [--device cpu|cuda]`. Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

GIB = 1 << 30


def _measure(kind: str, tokens: int, vocab: int, dtype: str, device: str, temperature: float) -> float:
    """Bytes the loss allocated at its peak (this process: called in a fresh subprocess)."""
    import torch  # deferred: torch (the parent process only spawns)

    from trainingrun.trainer.loss import token_logprobs

    torch.manual_seed(0)
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    logits = torch.randn(tokens, vocab, dtype=dt, device=device).requires_grad_(True)
    ids = torch.randint(0, vocab, (tokens,), device=device)
    scale = 1.0 / temperature
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if kind == "before":
        logp_all = torch.log_softmax(logits.float() * scale, dim=-1)[:-1]
        picked = logp_all.gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)
        grad, = torch.autograd.grad(picked.sum(), [logits])
    else:
        logp, ent = token_logprobs(logits, ids, scale, entropy=True, overwrite=True)
        grad, = torch.autograd.grad(logp.sum() + ent.sum(), [logits])
    if device == "cuda":
        torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated() - base)
    del grad  # held until here: the gradient of the logits is part of the loss's peak
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base)


def _run(kind: str, tokens: int, args) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, "--tokens", str(tokens), "--vocab", str(args.vocab),
         "--dtype", args.dtype, "--device", args.device, "--temperature", str(args.temperature)],
        check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["bytes"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=150000)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="the logits' dtype")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--before-tokens", default="512,1024", help="T values the 'before' path is measured at")
    ap.add_argument("--full", action="store_true", help="measure 'before' at --tokens too")
    ap.add_argument("--child", choices=("before", "after"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps({"bytes": _measure(args.child, args.tokens, args.vocab, args.dtype, args.device,
                                            args.temperature)}))
        return
    tv = args.tokens * args.vocab
    logits_gib = tv * (2 if args.dtype == "bf16" else 4) / GIB
    print(f"loss peak memory besides the logits: T={args.tokens} V={args.vocab} logits {args.dtype} "
          f"({logits_gib:.2f} GiB), device {args.device}")
    small = [int(t) for t in args.before_tokens.split(",") if t]
    rows = [(t, _run("before", t, args)) for t in small]
    for t, b in rows:
        print(f"  before  T={t:>6}: {b / GIB:7.2f} GiB  ({b / (t * args.vocab * 4):.2f} float32 [T, V] tensors)")
    if args.full:
        before = _run("before", args.tokens, args)
        how = "measured"
    else:
        # linear fit b = c0 + c1·T through the measured points (one point: through the origin)
        if len(rows) >= 2:
            (t0, b0), (t1, b1) = rows[0], rows[-1]
            c1 = (b1 - b0) / (t1 - t0)
            c0 = b0 - c1 * t0
        else:
            c0, c1 = 0.0, rows[0][1] / rows[0][0]
        before = c0 + c1 * args.tokens
        how = f"extrapolated linearly from T={','.join(map(str, small))}"
    after = _run("after", args.tokens, args)
    print(f"  before  T={args.tokens:>6}: {before / GIB:7.2f} GiB  ({how})")
    print(f"  after   T={args.tokens:>6}: {after / GIB:7.2f} GiB  (measured)")
    print(f"  ratio before/after: {before / max(after, 1.0):.0f}x")


if __name__ == "__main__":
    main()
