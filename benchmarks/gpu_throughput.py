"""Throughput mode of the GPU smoke check: `bash benchmarks/gpu_smoke.sh --throughput` (one H200: under 8 minutes;
`--throughput --cpu`: the dry mode with a tiny model, what the test suite runs).

For each attention backend (te, flash, sdpa; `spec.model.attentionBackend`) one subprocess trains the same steps of
the same model from the same seed through the trainer's own code (`modeling.model.build_model`, `trainer.optim`,
`trainer.step.train_step` over the schedule's packed micro-batches), one rank, bf16:
  model     the llama-1b preset (16 layers, hidden 2048, 32 heads / 8 KV groups, vocab 128256, ~1.24B parameters)
            at seqLength 8192; the dry mode: 2 layers, hidden 64
  data      a "reverse the prompt" task whose prompt lengths are heavy-tailed (Pareto 1.2: most samples a few hundred
            tokens, some up to the 8192-token sequence), packed at maxTokensPerGPU 16384, ~64k tokens per step
A backend the device cannot run is reported with the trainer's own refusal (`modeling.model.attention_choice`), not
failed. Figures per backend, over the steps after the first (warm-up):
  tokens/s/GPU  Σ tokens / Σ step seconds (CUDA synchronised around each step)
  MFU           (6·N·T + 6·L·H·d·Σ s_i²) / (t · peak): N parameters without the input embedding (the output layer
                counted), T tokens, s_i the length of each packed sample (attention runs within a sample only), L
                layers, H query heads of size d; 6·L·H·d·s² is the causal half of QKᵀ and PV (2·L·H·d·s² forward,
                twice that backward). peak: the dense bf16 peak of the device (PEAKS in gpu_smoke.py)
  peak memory   torch.cuda.max_memory_allocated of the training process (reserved beside it)
  generation    the in-process engine (engines/megatron.py) on the backend's layer spec: generated tokens/s for
                a batch of heavy-tailed prompts (flash and sdpa generate through the same torch SDPA path)
  parity        per-step loss of every backend against sdpa (else the first that trained): max |Δloss|/loss ≤ 2e-2
                (bf16). The local spec (flash, sdpa) starts from identical weights; TE's layer spec draws its own
Lines `SMOKE throughput ...` and `SMOKE RESULT PASS|FAIL` as gpu_smoke.py; `--json FILE` writes every figure.
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

import numpy as np

import gpu_smoke  # benchmarks/ is this script's directory: the smoke check's peaks, parameter count and output
from gpu_smoke import PEAKS, check, n_params, say

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("te", "flash", "sdpa")
PARITY_TOL = 2e-2
GPU = dict(model=dict(architecture="llama", numLayers=16, hiddenSize=2048, numAttentionHeads=32, numQueryGroups=8,
                      ffnHiddenSize=8192, vocabSize=128256, seqLength=8192),
           max_tokens=16384, step_tokens=65536, steps=6, prompts=32, completions=4, new_tokens=256, timeout=200.0)
CPU = dict(model=dict(architecture="llama", numLayers=2, hiddenSize=64, numAttentionHeads=4, numQueryGroups=2,
                      ffnHiddenSize=192, vocabSize=256, seqLength=256),
           max_tokens=512, step_tokens=1024, steps=2, prompts=4, completions=2, new_tokens=8, timeout=240.0)
BUDGET_S = 450.0  # the whole mode stays under 8 minutes: every subprocess gets at most what is left of it


def arch_of(cfg: dict, backend: str):
    from trainingrun.modeling.architecture import resolve

    m = cfg["model"]
    sizes = dict(architecture=m["architecture"], num_layers=m["numLayers"], hidden_size=m["hiddenSize"],
                 num_attention_heads=m["numAttentionHeads"], num_query_groups=m["numQueryGroups"],
                 ffn_hidden_size=m["ffnHiddenSize"], vocab_size=m["vocabSize"], seq_length=m["seqLength"])
    impl = "auto" if backend == "te" else "local"  # the spec's pairing rule (api.spec.model: te-attention-needs-te-layers)
    return resolve(precision="bf16", transformer_impl=impl, attention_backend=backend, rope_base=500000.0,
                   tie_embeddings=True, **sizes)


def prompt_lengths(n: int, longest: int, seed: int) -> list[int]:
    """Heavy-tailed prompt lengths (Pareto 1.2, scale longest/16: median ~longest/20, ~3 % at longest), 4 .. longest."""
    rng = np.random.default_rng(seed)
    return [int(min(longest, 4 + rng.pareto(1.2) * longest / 16)) for _ in range(n)]


def pool(cfg: dict):
    """Samples prompt, separator, reversed prompt (loss on the reversed part) of heavy-tailed lengths, enough for
    `steps` steps of ~step_tokens tokens; and the steps as lists of sample indices."""
    from trainingrun.contract.published import Samples

    vocab, longest = cfg["model"]["vocabSize"], (cfg["model"]["seqLength"] - 1) // 2
    rng = np.random.default_rng(1)
    toks, masks, steps, step = [], [], [], []
    for plen in prompt_lengths(100_000, longest, seed=2):
        p = rng.integers(2, vocab, plen)
        toks.append(np.concatenate([p, [1], p[::-1]]).astype(np.int32))
        masks.append(np.r_[np.zeros(plen + 1, np.uint8), np.ones(plen, np.uint8)])
        step.append(len(toks) - 1)
        if sum(len(toks[i]) for i in step) >= cfg["step_tokens"]:
            steps.append(step)
            step = []
            if len(steps) == cfg["steps"]:
                break
    n = len(toks)
    return Samples(tokens=toks, loss_masks=masks, rewards=np.zeros(n, np.float32),
                   advantages=np.zeros(n, np.float32), sample_ids=np.arange(n, dtype=np.int64),
                   group_ids=list(range(n))), steps


def _single_rank() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def worker_train(cfg: dict, backend: str, cuda: bool) -> dict:
    """One backend's training steps (a subprocess of its own: process-global CPU shim, clean peak memory)."""
    _single_rank()
    from trainingrun.modeling.model import (ModelOptions, attention_choice, build_model, init_distributed,
                                            prepare_device, set_seed)

    device = prepare_device(1 if cuda else 0)
    arch = arch_of(cfg, backend)
    try:
        choice = attention_choice(arch, device)
    except ValueError as exc:
        return {"refused": str(exc)}
    init_distributed(device)
    import torch

    from trainingrun.contract.published import rank_payload
    from trainingrun.schedule import build_dp_schedule
    from trainingrun.trainer.batch import step_microbatches
    from trainingrun.trainer.loss import LossSettings, StepTotals
    from trainingrun.trainer.optim import OptimSettings, build_optimizer, wrap_ddp
    from trainingrun.trainer.step import train_step

    set_seed(0)
    ddp = wrap_ddp(build_model(arch, device, load_weights=False, options=ModelOptions(attention=choice)))
    opt, sched = build_optimizer(ddp, OptimSettings(1e-4, 0.0, 0, None, "constant", 0.0, 1.0, 0.9, 0.999), "bf16")
    samples, steps = pool(cfg)
    out = {"backend": choice.backend, "reason": choice.reason, "layer_impl": choice.layer_impl, "steps": []}
    for idx in steps:
        lens = [len(samples.tokens[i]) for i in idx]
        s = build_dp_schedule(lens, dp_size=1, max_tokens_per_gpu=cfg["max_tokens"]).to_dict()
        order = [idx[p] for p in s["partitions"][0]]
        payload = rank_payload(samples, order)
        loss_tokens = int(sum(int(samples.loss_masks[i][1:].sum()) for i in idx))
        if cuda:
            torch.cuda.synchronize()
        t0, first, loss, tokens = time.perf_counter(), 0, 0.0, 0
        for k, m in enumerate(s["num_microbatches"]):  # one optimizer step per schedule step (one here)
            mbs = step_microbatches(payload, s["micro_batch_indices"][0][first:first + m], device)
            first += m
            res = train_step(ddp, opt, sched, mbs, LossSettings("sft", "sample"),
                             StepTotals(global_batch_size=s["global_batch_sizes"][k], loss_tokens=loss_tokens),
                             dp_size=1)
            loss, tokens = loss + res.loss, tokens + sum(mb.num_tokens for mb in mbs)
        if cuda:
            torch.cuda.synchronize()
        out["steps"].append({"seconds": time.perf_counter() - t0, "loss": loss, "tokens": tokens,
                             "sum_len_sq": int(sum(n * n for n in lens)),
                             "microbatches": int(sum(s["num_microbatches"]))})
    if cuda:
        out["peak_allocated"] = torch.cuda.max_memory_allocated()
        out["peak_reserved"] = torch.cuda.max_memory_reserved()
    return out


def worker_generate(cfg: dict, backend: str) -> dict:
    """The in-process engine's generation tokens/s on the backend's layer spec (untrained weights: speed only)."""
    from trainingrun.contract.engine import Sampling
    from trainingrun.contract.errors import ConfigError
    from trainingrun.engines.megatron import MegatronEngine

    try:
        engine = MegatronEngine(arch_of(cfg, backend), fetch=lambda version: ({}, {}), seed=0)
    except ConfigError as exc:
        return {"refused": str(exc)}
    rng = np.random.default_rng(3)
    longest = cfg["model"]["seqLength"] // 8
    prompts = [rng.integers(2, cfg["model"]["vocabSize"], n).tolist()
               for n in prompt_lengths(cfg["prompts"], longest, seed=4)]
    n = cfg["completions"]
    engine.generate(prompts[:2], 1, Sampling(max_new_tokens=4, seed=0))  # warm-up (kernels, caches)
    engine.stats.update(generated_tokens=0, generate_seconds=0.0)
    engine.generate(prompts, n, Sampling(max_new_tokens=cfg["new_tokens"], seed=1))
    st = engine.stats
    return {"backend": engine.attention.backend, "rows": len(prompts) * n, "generated_tokens": st["generated_tokens"],
            "seconds": st["generate_seconds"], "tokens_per_s": st["generated_tokens"] / st["generate_seconds"]}


def _spawn(part: str, backend: str, cuda: bool, tmp: Path, timeout: float) -> dict:
    out = tmp / f"{part}-{backend}.json"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, __file__, "--worker", part, "--backend", backend, "--out", str(out)]
    if not cuda:
        cmd.append("--cpu")
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU shim refuses to install where CUDA is visible
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"failed": f"did not finish in {timeout:.0f}s"}
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        return {"failed": f"exit {proc.returncode}; last lines:\n{tail}"}
    return json.loads(out.read_text())


def figures(cfg: dict, run: dict, peak: float | None) -> dict:
    """tokens/s/GPU and MFU over the steps after the first (module docstring)."""
    m = cfg["model"]
    steady = run["steps"][1:] or run["steps"]
    secs = sum(s["seconds"] for s in steady)
    tokens = sum(s["tokens"] for s in steady)
    d = m["hiddenSize"] // m["numAttentionHeads"]
    flops = sum(6 * n_params(m) * s["tokens"] + 6 * m["numLayers"] * m["numAttentionHeads"] * d * s["sum_len_sq"]
                for s in steady)
    return {"tokens_per_s": tokens / secs, "flops_per_s": flops / secs, "mfu": flops / secs / peak if peak else None,
            "attention_share": 1 - sum(6 * n_params(m) * s["tokens"] for s in steady) / flops}


def main(cpu: bool, json_path: str | None) -> int:
    import torch

    cuda = torch.cuda.is_available() and not cpu
    cfg = GPU if cuda else CPU
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = next((pb for key, (pb, _) in PEAKS.items() if key in name), None)
    m = cfg["model"]
    say(f"throughput setup: device {name}, torch {torch.__version__}; llama {m['numLayers']} layers hidden "
        f"{m['hiddenSize']} ({n_params(m) / 1e6:.1f}M without the input embedding), seqLength {m['seqLength']}, "
        f"maxTokensPerGPU {cfg['max_tokens']}, bf16, {cfg['steps']} steps of ~{cfg['step_tokens']} tokens; "
        f"MFU = (6·N·T + 6·L·H·d·Σs²) / (t · {f'{peak / 1e12:.0f} TFLOP/s' if peak else 'peak unknown'})")
    t0 = time.perf_counter()
    report: dict = {"device": name, "model": m, "max_tokens_per_gpu": cfg["max_tokens"], "backends": {}}
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-") as tmp:
        def left() -> float:
            return min(cfg["timeout"], BUDGET_S - (time.perf_counter() - t0))

        from trainingrun.modeling.model import attention_choice

        here = torch.device("cuda", 0) if cuda else torch.device("cpu")
        for backend in BACKENDS:
            try:  # the trainer's own check, here first: a refused backend costs no subprocess (the worker checks too)
                attention_choice(arch_of(cfg, backend), here)
            except ValueError as exc:
                report["backends"][backend] = {"refused": str(exc)}
                say(f"throughput {backend}: not available here: {exc}")
                continue
            if left() < 30:
                check(f"throughput-{backend}", False, f"not run: the mode's {BUDGET_S:.0f}s budget is spent")
                report["backends"][backend] = {"failed": "time budget spent"}
                continue
            run = _spawn("train", backend, cuda, Path(tmp), left())
            report["backends"][backend] = run
            if "refused" in run:
                say(f"throughput {backend}: not available here: {run['refused']}")
                continue
            if "failed" in run:
                check(f"throughput-{backend}", False, run["failed"])
                continue
            run["figures"] = f = figures(cfg, run, peak)
            mem = f", peak memory {run['peak_allocated'] / 2**30:.1f} GiB allocated " \
                  f"({run['peak_reserved'] / 2**30:.1f} GiB reserved)" if "peak_allocated" in run else ""
            mfu = f"{f['mfu'] * 100:.1f}%" if f["mfu"] is not None else "n/a (peak unknown)"
            say(f"throughput {backend}: {f['tokens_per_s']:,.0f} tokens/s/GPU, MFU {mfu} (attention "
                f"{f['attention_share'] * 100:.0f}% of the FLOPs){mem}; losses "
                f"{[round(s['loss'], 4) for s in run['steps']]} ({run['reason']})")
            gen = _spawn("generate", backend, cuda, Path(tmp), left()) if left() >= 30 else \
                {"failed": f"not run: the mode's {BUDGET_S:.0f}s budget is spent"}
            run["generation"] = gen
            if "tokens_per_s" in gen:
                say(f"throughput {backend} generation: {gen['tokens_per_s']:,.0f} tokens/s ({gen['rows']} rows, "
                    f"{gen['generated_tokens']} tokens in {gen['seconds']:.1f}s, in-process engine, attention "
                    f"{gen['backend']})")
            else:
                check(f"generation-{backend}", False, gen.get("failed") or gen.get("refused", "?"))
        trained = {b: r for b, r in report["backends"].items() if "steps" in r}
        ref_name = "sdpa" if "sdpa" in trained else next(iter(trained), None)  # sdpa, else the first that trained
        for backend, run in trained.items():
            if backend == ref_name:
                continue
            ref = trained[ref_name]
            worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(run["steps"], ref["steps"]))
            check(f"parity-{backend}-vs-{ref_name}", worst <= PARITY_TOL,
                  f"max per-step |Δloss|/loss {worst:.2e} (tolerance {PARITY_TOL:g}) over {len(ref['steps'])} steps")
        if len(trained) < 2:
            say(f"throughput parity: one backend trained here ({', '.join(trained) or 'none'}): nothing to compare")
        check("throughput", bool(trained), f"{len(trained)} of {len(BACKENDS)} backends trained: "
              f"{', '.join(trained) or 'none'}")
    report["seconds"] = time.perf_counter() - t0
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    ok = all(passed for _, passed in gpu_smoke.RESULTS)
    say(f"total {report['seconds']:.0f}s; checks: " + ", ".join(f"{n}={'ok' if p else 'FAILED'}"
                                                               for n, p in gpu_smoke.RESULTS))
    say(f"RESULT {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="dry mode without CUDA: a tiny model, the same path")
    ap.add_argument("--json", metavar="FILE", help="write every figure here")
    ap.add_argument("--worker", choices=("train", "generate"), help=argparse.SUPPRESS)
    ap.add_argument("--backend", choices=BACKENDS, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is None:
        raise SystemExit(main(a.cpu, a.json))
    conf = CPU if a.cpu else GPU
    result = worker_train(conf, a.backend, not a.cpu) if a.worker == "train" else worker_generate(conf, a.backend)
    Path(a.out).write_text(json.dumps(result))
