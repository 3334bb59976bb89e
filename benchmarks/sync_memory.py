"""The sending rank's memory during weight sync (issue 28's acceptance): a TP 2 (or PP 2) RL run, real trainer
processes.

`trainingrun run` of an on-policy GRPO spec whose engine is a simulated vLLM server the run reaches by
`engine.url` (`python -m trainingrun.engines.simulated`: it generates, checks every published directory's digests and
tensor headers, and loads nothing), two trainer ranks splitting a llama-architecture model by tensor parallelism
(or, with `--parallel pipeline`, into two pipeline stages; fp32, gloo), `weightSync.type` disk or broadcast with
`weightSync.bucketMiB`; with `store` the engine is the in-process megatron one (the rollout loads every version from
the run's file store) and the trainers write each version in parts (`engines/store_sync.py`). Every child runs under
`tests/peak_rss.py` (the kernel's peak resident set, VmHWM at exit, with its RANK). Prints one JSON object per
configuration: the model's bytes (fp32), each rank's peak, the sending rank's (rank 0's) excess over rank 1 and that
excess over the model's bytes (issue 28's acceptance: at most 0.25 with `bucketMiB: 32`).

Run: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sync_memory.py [--sync disk,broadcast,store] [--bucket-mib 32]
[--layers 8 --hidden 1536 --ffn 4608] [--parallel tensor|pipeline]`. About two minutes per configuration on 2 CPU
cores at the default size (0.88 GB of fp32 weights). Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 1 << 30


def hf_model(args, workdir: Path) -> Path:
    """A random llama-architecture HF directory of the benchmark's size (the engine loads HF weights: model.hf)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = workdir / "model"
    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                          num_attention_heads=12, num_key_value_heads=4, vocab_size=512,
                          max_position_embeddings=64, tie_word_embeddings=False)
        LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def spec(args, sync: str, url: str, hf: Path) -> dict:
    model = {"hf": str(hf)}
    return {"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "syncmem"},
            "spec": {"seed": 1, "model": model,
                     "trainer": {"replicas": 2, "gpusPerReplica": 0, f"{args.parallel}ParallelSize": 2,
                                 "maxTokensPerGPU": 512, "lossType": "ppo",
                                 "checkpoint": {"interval": 0, "path": "checkpoints"}},
                     "rollout": {"source": {"type": "generate", "generate": {
                                     "prompts": {"type": "synthetic", "synthetic": {
                                         "task": "copy", "minLength": 4, "maxLength": 4, "vocabSize": 64}},
                                     "sampling": {"temperature": 1.0, "maxNewTokens": 8},
                                     "reward": {"type": "token_match"}}},
                                 "engine": {"type": "vllm", "url": url} if sync != "store" else {"type": "megatron"},
                                 "maxPolicyLag": 0, "samplesPerRollout": 8, "groupSize": 4,
                                 "filters": {"zeroVariance": False}, "numRollouts": args.rollouts},
                     "weightSync": {"type": sync, "bucketMiB": args.bucket_mib},
                     "metrics": {"enabled": False}}}


def model_bytes(doc: dict) -> int:
    """fp32 bytes of the model's parameters (the plan's own count)."""
    from trainingrun.api import parse_trainingrun
    from trainingrun.api.memory import spec_plan

    plan = spec_plan(parse_trainingrun(doc))
    return int(plan.parameters * 4)


def measure(args, sync: str, workdir: Path) -> dict:
    from tests.simengine import SimProcess

    sim = SimProcess(token_seconds=0.001, median_tokens=6, length_sigma=0.3, vocab=512) if sync != "store" else None
    try:
        doc = spec(args, sync, sim.url if sim else "", hf_model(args, workdir))
        path = workdir / f"{sync}.yaml"
        path.write_text(yaml.safe_dump(doc))
        peaks = workdir / f"{sync}.peaks.jsonl"
        env = dict(os.environ, OMP_NUM_THREADS="1", TRAININGRUN_PEAK_FILE=str(peaks),
                   TRAININGRUN_CHILD_COMMAND=f"{sys.executable} {ROOT / 'tests' / 'peak_rss.py'}",
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "trainingrun", "run", str(path), "--out", str(workdir / sync),
                              "--no-plot"], cwd=workdir, env=env, capture_output=True, text=True,
                             timeout=args.timeout)
        if out.returncode != 0:
            raise RuntimeError(f"{sync}: trainingrun run exited {out.returncode}:\n{out.stdout[-3000:]}"
                               f"{out.stderr[-3000:]}")
        loads = sim.stats()["loads"] if sim else _store_versions(workdir / sync)
    finally:
        if sim:
            sim.close()
    rows = [json.loads(x) for x in peaks.read_text().splitlines()]
    ranks = {int(r["rank"]): r["peak_rss"] for r in rows if r["role"] == "trainer" and r.get("rank") is not None}
    size = model_bytes(doc)
    excess = ranks[0] - ranks[1]
    return {"sync": sync, "parallel": args.parallel, "bucket_mib": args.bucket_mib,
            "model_gib": round(size / GIB, 3),
            "rank0_peak_gib": round(ranks[0] / GIB, 3), "rank1_peak_gib": round(ranks[1] / GIB, 3),
            "excess_gib": round(excess / GIB, 3), "excess_over_model": round(excess / size, 3),
            "versions_loaded_by_engine": len(loads), "wall_s": round(time.monotonic() - t0, 1)}


def _store_versions(out: Path) -> list[str]:
    """The weight versions the trainers published (trainer 0's log lines), for `--sync store`: the in-process engine
    loads each before it generates the rollout of that version (lag 0)."""
    logs = "".join(p.read_text(errors="replace") for p in (out / "logs").glob("trainer-0*.log"))
    return [line for line in logs.splitlines() if "published:" in line and "weights version" in line]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sync", default="disk", help="comma-separated: disk, broadcast, store")
    ap.add_argument("--bucket-mib", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--ffn", type=int, default=4608)
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--parallel", default="tensor", choices=["tensor", "pipeline"],
                    help="how the two trainer ranks split the model: TP 2 or PP 2")
    ap.add_argument("--timeout", type=float, default=1200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="syncmem-") as tmp:
        for sync in args.sync.split(","):
            print(json.dumps(measure(args, sync, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
