"""The GPU smoke check (run it through benchmarks/gpu_smoke.sh, which installs carried wheels first).

Every run goes through `python -m trainingrun run SPEC --out DIR` (rollout + trainer processes, file store; NCCL on
CUDA, gloo on CPU) and is read back from its metrics.jsonl. Output: `SMOKE <check>: ...` lines with the figures,
then `SMOKE RESULT PASS|FAIL`. Checks and tolerances:
  te-vs-local   (TE present) TE bf16 vs local bf16, per-step loss, |Δ|/loss ≤ 2e-2
  bf16-vs-fp32  local spec, per-step loss, |Δ|/loss ≤ 2e-2 (bf16 has 8 mantissa bits; same data, same start)
  cuda-vs-cpu   small model, fp32, per-step loss, |Δ|/loss ≤ 1e-4 (TF32 off: only summation order differs)
Throughput: tokens/s = Σ tokens / Σ step seconds over the steps after the first (warm-up); MFU = 6·N·tokens/s over
the dense peak of the device for the dtype (N = parameters without the input embedding; attention FLOPs not
counted, so MFU is a lower bound).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# dense peak FLOP/s (bf16 tensor cores, fp32 without TF32) by device name
PEAKS = {"H200": (989e12, 67e12), "H100": (989e12, 67e12), "A100": (312e12, 19.5e12), "L40S": (362e12, 91.6e12)}
RESULTS: list[tuple[str, bool]] = []


def say(msg: str) -> None:
    print(f"SMOKE {msg}", flush=True)


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok))
    say(f"{name}: {'ok' if ok else 'FAILED'}: {detail}")


def spec(name: str, *, model: dict, gpus: int, samples: int, rollouts: int, max_len: int, max_tokens: int,
         vocab: int) -> str:
    doc = {
        "apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": name},
        "spec": {
            "seed": 7, "model": model,
            "trainer": {"replicas": 1, "gpusPerReplica": gpus, "maxTokensPerGPU": max_tokens, "lossType": "sft",
                        "optimizer": {"lr": 1e-4, "clipGrad": 0.0},
                        "checkpoint": {"interval": 0, "path": "checkpoints"}},
            "rollout": {"source": {"type": "synthetic", "synthetic": {"task": "reverse", "minLength": 16,
                                                                        "maxLength": max_len, "vocabSize": vocab}},
                        "samplesPerRollout": samples, "groupSize": 4, "numRollouts": rollouts,
                        "filters": {"zeroVariance": False}, "maxPendingRollouts": 2},
            "metrics": {"enabled": False},
            "failurePolicy": {"maxRestarts": 0},
        },
    }
    return json.dumps(doc)  # JSON is YAML


def train(tmp: Path, name: str, doc: str, timeout: float, *, hide_cuda: bool = False) -> list[dict] | None:
    (tmp / f"{name}.yaml").write_text(doc)
    out = tmp / name
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if hide_cuda:  # a CPU run on a CUDA machine: the CPU shim refuses to install where CUDA is visible
        env["CUDA_VISIBLE_DEVICES"] = ""
    try:
        proc = subprocess.run([sys.executable, "-m", "trainingrun", "run", str(tmp / f"{name}.yaml"), "--out",
                               str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        say(f"{name}: did not finish in {timeout:.0f}s")
        return None
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        say(f"{name}: exit {proc.returncode} after {wall:.0f}s; last lines:\n{tail}")
        logs = sorted((out / "logs").glob("trainer*")) if (out / "logs").is_dir() else []
        for log in logs[:1]:
            say(f"{name}: {log.name}:\n" + "\n".join(log.read_text().splitlines()[-25:]))
        return None
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    say(f"{name}: {len(recs)} steps in {wall:.0f}s wall; losses {[round(r['loss'], 5) for r in recs]}")
    return recs


def throughput(name: str, recs: list[dict], params: int, peak: float | None) -> None:
    steady = recs[1:] or recs
    secs = sum(r["step_seconds"] for r in steady)
    tokens = sum(r["tokens"] for r in steady)
    tps = tokens / secs if secs > 0 else 0.0
    mfu = f"{6 * params * tps / peak * 100:.1f}%" if peak else "n/a (peak unknown)"
    say(f"{name}: {tps:,.0f} tokens/s over {len(steady)} steps ({tokens} tokens, {secs:.2f}s), MFU {mfu} "
        f"(6·N·tokens/s, N = {params / 1e6:.1f}M)")


def parity(name: str, a: list[dict] | None, b: list[dict] | None, tol: float) -> None:
    if a is None or b is None:
        check(name, False, "a run failed (see above)")
        return
    la, lb = [r["loss"] for r in a], [r["loss"] for r in b]
    if len(la) != len(lb):
        check(name, False, f"step counts differ: {len(la)} vs {len(lb)}")
        return
    worst = max(abs(x - y) / abs(y) for x, y in zip(la, lb))
    check(name, worst <= tol, f"max per-step |Δloss|/loss {worst:.2e} (tolerance {tol:g}) over {len(la)} steps")


def random_hf_model(out: Path, m: dict) -> Path:
    """A random Llama of the sizes in `m`, saved by transformers (the same start for the CUDA and the CPU run)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=m["vocabSize"], hidden_size=m["hiddenSize"], intermediate_size=m["ffnHiddenSize"],
                      num_hidden_layers=m["numLayers"], num_attention_heads=m["numAttentionHeads"],
                      num_key_value_heads=m["numQueryGroups"], max_position_embeddings=m["seqLength"],
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def n_params(m: dict) -> int:
    """Parameters without the input embedding (the matmul parameters of 6·N)."""
    h, L, f, v = m["hiddenSize"], m["numLayers"], m["ffnHiddenSize"], m["vocabSize"]
    d = h // m["numAttentionHeads"]
    qkv = h * (m["numAttentionHeads"] + 2 * m["numQueryGroups"]) * d
    return L * (qkv + m["numAttentionHeads"] * d * h + 3 * h * f + 2 * h) + h + v * h


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="dry mode without CUDA: tiny models, gloo, the same checks")
    ap.add_argument("--keep", metavar="DIR", help="keep the run directories here (default: a temporary directory)")
    args = ap.parse_args()

    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    gpus = 1 if cuda else 0
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak_bf16 = peak_fp32 = None
    for key, (pb, pf) in PEAKS.items():
        if key in name:
            peak_bf16, peak_fp32 = pb, pf
    import warnings

    warnings.filterwarnings("ignore")  # megatron's "Apex/TE not installed" notes; TE's absence is reported below
    try:
        import megatron.core

        mc = megatron.core.__version__
    except Exception as exc:  # noqa: BLE001
        say(f"setup: megatron-core does not import: {exc}")
        say("RESULT FAIL")
        return 1
    try:
        import transformer_engine  # noqa: F401

        te = cuda
        te_note = "transformer_engine imports"
    except Exception as exc:  # noqa: BLE001
        te, te_note = False, f"transformer_engine ABSENT ({type(exc).__name__}): TE checks skipped; local spec only"
    say(f"setup: python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core {mc}, device {name}, "
        f"{'NCCL' if cuda else 'gloo (dry mode: --cpu or no CUDA)'}; {te_note}")
    if not cuda and not args.cpu:
        say("setup: no CUDA device visible: running the CPU dry mode")

    if cuda:  # ~156M parameters, samples up to ~2k tokens, ~56k tokens per step in 8k-token micro-batches, 6 steps
        big = dict(architecture="llama", numLayers=8, hiddenSize=1024, numAttentionHeads=16, numQueryGroups=4,
                   ffnHiddenSize=2816, vocabSize=32000, seqLength=2048)
        run_kw = dict(samples=512, rollouts=6, max_len=1000, max_tokens=8192, vocab=32000)
        timeout = 240.0
    else:
        big = dict(architecture="llama", numLayers=2, hiddenSize=64, numAttentionHeads=4, numQueryGroups=2,
                   ffnHiddenSize=192, vocabSize=256, seqLength=256)
        run_kw = dict(samples=16, rollouts=3, max_len=48, max_tokens=512, vocab=256)
        timeout = 300.0
    small = dict(architecture="llama", numLayers=2, hiddenSize=64, numAttentionHeads=4, numQueryGroups=2,
                 ffnHiddenSize=192, vocabSize=256, seqLength=256)
    small_kw = dict(samples=16, rollouts=3, max_len=48, max_tokens=512, vocab=256)

    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    tmp.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        params = n_params(big)
        runs = {}
        for precision in ("bf16", "fp32"):
            model = {**big, "precision": precision, "transformerImpl": "local"}
            runs[precision] = train(tmp, f"local-{precision}", spec(f"local-{precision}", model=model, gpus=gpus,
                                                                    **run_kw), timeout)
            if runs[precision]:
                throughput(f"local-{precision}", runs[precision], params,
                           peak_bf16 if precision == "bf16" else peak_fp32)
        parity("bf16-vs-fp32", runs["bf16"], runs["fp32"], 2e-2)
        if te:
            model = {**big, "precision": "bf16", "transformerImpl": "transformer_engine"}
            te_run = train(tmp, "te-bf16", spec("te-bf16", model=model, gpus=gpus, **run_kw), timeout)
            if te_run:
                throughput("te-bf16", te_run, params, peak_bf16)
            parity("te-vs-local", te_run, runs["bf16"], 2e-2)
            # fp32 with the TE spec: what happens is reported, not judged (auto picks the local spec for fp32)
            model = {**big, "precision": "fp32", "transformerImpl": "transformer_engine"}
            te32 = train(tmp, "te-fp32", spec("te-fp32", model=model, gpus=gpus, **run_kw), timeout)
            say(f"te-fp32: {'trained' if te32 else 'refused/failed'} (informational; see docs/trainer.md)")
        else:
            say("te-vs-local: skipped (transformer_engine absent); the TE spec is selected only when it imports")
        # Both runs start from the same weights (an HF directory): Megatron initialises weights with the device's
        # RNG, so a CUDA-initialised model and a CPU-initialised one differ before the first step.
        model = {"hf": str(random_hf_model(tmp / "small-hf", small)), "seqLength": small["seqLength"],
                 "precision": "fp32", "transformerImpl": "local"}
        dev = train(tmp, "small-fp32-device", spec("small-fp32-device", model=model, gpus=gpus, **small_kw), timeout)
        if cuda:
            ref = train(tmp, "small-fp32-cpu", spec("small-fp32-cpu", model=model, gpus=0, **small_kw), timeout,
                        hide_cuda=True)
            parity("cuda-vs-cpu", dev, ref, 1e-4)
        else:
            check("cuda-vs-cpu", dev is not None, "dry mode: no CUDA, the CPU run trained" if dev else "run failed")
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    ok = all(passed for _, passed in RESULTS)
    say(f"total {time.perf_counter() - t0:.0f}s; checks: " + ", ".join(f"{n}={'ok' if p else 'FAILED'}"
                                                                     for n, p in RESULTS))
    say(f"RESULT {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
