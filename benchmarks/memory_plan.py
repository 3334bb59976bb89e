"""The memory plan against the measured peak of real CPU trainer processes (issue 28).

For each configuration: `trainingrun run` of a small llama-architecture model (fp32, sdpa, gloo, one trainer) whose
micro-batches fill the token cap, every child wrapped by `tests/peak_rss.py` (the kernel's peak resident set of the
trainer process, VmHWM at exit), two rollouts of one optimizer step each (the second step's peak holds Adam's states,
as every later one does); beside it the plan of the same spec (`trainingrun.api.memory.spec_plan`, what
`trainingrun plan` prints): one JSON object per line with both totals, their ratio and the plan's terms.

`--attention`: the sdpa core attention alone at SmolLM2-135M's shape (9 query heads, 3 key/value heads of 64), one
packed document of T tokens, forward and backward, in a fresh process each: the growth of the peak resident set,
for the block-diagonal call sdpa made before issue 28 ("before": one masked SDPA call, torch's math kernel) and the
per-document calls ("after"). (What the attention keeps for the backward is the plan's `core_attention_bytes` to
the byte: tests/unit/test_attention_backends.py.)

Run: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory_plan.py [--configs llama-1k,llama-4k,tiny]
[--attention]`. Prints figures, asserts nothing (tests/integration/test_memory_plan.py holds the plan within 25 % of
the runs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30

LLAMA = dict(architecture="llama", numLayers=2, hiddenSize=256, numAttentionHeads=4, numQueryGroups=2,
             ffnHiddenSize=1024, vocabSize=32000, seqLength=4096)
# name -> (model, maxTokensPerGPU, synthetic prompt length): a sample of prompt length L has 2L + 2 tokens, and
# 10 samples fill one micro-batch of the cap (10 x 402 = 4020 of 4096; 5 x 202 = 1010 of 1024 twice)
CONFIGS = {
    "llama-1k": (LLAMA, 1024, 100),
    "llama-4k": (LLAMA, 4096, 200),
    "tiny": ({"preset": "tiny"}, 256, 20),
}


def spec(name: str) -> dict:
    model, cap, length = CONFIGS[name]
    return {"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "memplan"},
            "spec": {"seed": 1, "model": dict(model),
                     "trainer": {"replicas": 1, "maxTokensPerGPU": cap, "lossType": "sft",
                                 "checkpoint": {"interval": 0, "path": "checkpoints"}},
                     "rollout": {"source": {"type": "synthetic",
                                            "synthetic": {"task": "reverse", "minLength": length,
                                                          "maxLength": length, "vocabSize": 64}},
                                 "samplesPerRollout": 10, "groupSize": 2, "filters": {"zeroVariance": False},
                                 "numRollouts": 2},
                     "metrics": {"enabled": False}}}


def measure(name: str, workdir: Path, timeout: float = 600) -> dict:
    """Run configuration `name` in `workdir`; its plan and the trainer's measured peak."""
    from trainingrun.api import load_trainingrun
    from trainingrun.api.memory import spec_plan

    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec(name)))
    peaks = workdir / f"{name}.peaks.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", TRAININGRUN_PEAK_FILE=str(peaks),
               TRAININGRUN_CHILD_COMMAND=f"{sys.executable} {ROOT / 'tests' / 'peak_rss.py'}",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    out = subprocess.run([sys.executable, "-m", "trainingrun", "run", str(path), "--out", str(workdir / name),
                          "--no-plot"], cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{name}: trainingrun run exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    trainers = [r for r in map(json.loads, peaks.read_text().splitlines()) if r["role"] == "trainer"]
    records = [json.loads(x) for x in (workdir / name / "metrics.jsonl").read_text().splitlines()]
    role = spec_plan(load_trainingrun(path)).role("trainer")
    measured = max(r["peak_rss"] for r in trainers)
    return {"config": name, "max_tokens_per_gpu": spec(name)["spec"]["trainer"]["maxTokensPerGPU"],
            "tokens_per_micro_batch": max(r["tokens"] // r["num_microbatches"] for r in records),
            "steps": len(records), "plan_gib": round(role.total / GIB, 3), "measured_gib": round(measured / GIB, 3),
            "plan_over_measured": round(role.total / measured, 3),
            "terms_gib": {t.key: round(t.gib, 3) for t in role.terms}}


def _attention_child(kind: str, tokens: int) -> float:
    """MiB the peak resident set grew by over one forward + backward of the sdpa core attention (this process)."""
    import resource

    import torch

    from trainingrun.modeling.attention import PackedSDPAttention, block_causal_mask

    class Config:
        attention_dropout, kv_channels, hidden_size, num_attention_heads = 0.0, 64, 576, 9

    class Packed:
        qkv_format = "thd"
        cu_seqlens_q = cu_seqlens_kv = torch.tensor([0, tokens], dtype=torch.int32)

    torch.manual_seed(0)
    q = torch.randn(tokens, 9, 64, requires_grad=True)
    k, v = (torch.randn(tokens, 3, 64, requires_grad=True) for _ in range(2))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if kind == "after":
        out = PackedSDPAttention(Config(), layer_number=1)(q, k, v, None, packed_seq_params=Packed())
    else:
        mask = block_causal_mask(Packed.cu_seqlens_q, tokens)
        qq, kk, vv = (x.transpose(0, 1) for x in (q, k, v))
        kk, vv = (x.repeat_interleave(3, dim=0) for x in (kk, vv))
        out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask).transpose(0, 1)
    out.sum().backward()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024


def attention(kind: str, tokens: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child-attention", kind, str(tokens)], check=True,
                         capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return {"attention": kind, "tokens": tokens, "peak_growth_mib": round(float(out.stdout.split()[-1]), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="llama-1k,llama-4k,tiny")
    ap.add_argument("--attention", action="store_true", help="the sdpa core attention before and after issue 28")
    ap.add_argument("--child-attention", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_attention:
        print(_attention_child(args.child_attention[0], int(args.child_attention[1])))
        return
    if args.attention:
        for kind, tokens in (("before", 2048), ("before", 4096), ("after", 4096), ("after", 8192),
                             ("after", 32768)):
            print(json.dumps(attention(kind, tokens)), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs.split(","):
            print(json.dumps(measure(name, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
