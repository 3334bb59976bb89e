"""On-policy RL loop figures: generation through the rollout vs the engine alone, weight sync vs copy bandwidth, and
how long trainers wait for data at maxPolicyLag 0 and 1.

    python benchmarks/rl_loop.py                      # every part, engine megatron
    python benchmarks/rl_loop.py --parts generation   # one part (generation, sync, wait)
    python benchmarks/rl_loop.py --engine vllm ...    # another engine (added by its own module, see ENGINES)
    python benchmarks/rl_loop.py --engine sim         # the rollout's scheduling against simulated vLLM servers:
                                                      # parts throughput, oversample, broadcast, idle (benchmarks/rl_loop_sim.py)

generation  The same requests (prompts of examples/rl.yaml's task, groupSize completions each) through
            `GenerateSource.generate` (the rollout's generate stage: engine + building the samples) and through the
            engine alone; ratio = rollout tok/s / engine tok/s (target >= 0.9). For the megatron engine also
            Megatron-core's own `StaticInferenceEngine` on the same prompts, the alternative to our KV-cache loop.
sync        Store weight sync for a few model sizes: trainer rank 0's `publish_weights` + the engine's read and
            `load_state_dict`, against the bytes / a measured memory copy bandwidth (numpy copy of the same bytes).
wait        `trainingrun run` of examples/rl.yaml (shortened) at maxPolicyLag 0 and 1: the fraction of the trainers'
            wall time spent waiting for data (records' data_wait_seconds over the time from the first wait to the
            last step), and the run's wall time.

Generation and sync run in a subprocess each (the CPU shim is process-global). OMP_NUM_THREADS=1 throughout.
Figures go to stdout as lines `name: value` plus one JSON line at the end (`--json`).
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
os.environ.setdefault("OMP_NUM_THREADS", "1")


# ---------------------------------------------------------------------------------------------------- generation
def _spec(**rollout) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "rl.yaml").read_text())
    doc["spec"]["rollout"].update(rollout)
    return doc


def generation_megatron(args) -> dict:
    """Runs in a subprocess: our KV-cache engine alone, the rollout's generate stage, Megatron's static engine."""
    import numpy as np
    import torch

    from trainingrun.api import parse_trainingrun
    from trainingrun.rollout.generate import GenerateSource
    from trainingrun.modeling.state import state_dict_arrays
    from trainingrun.engines.megatron import MegatronEngine
    from trainingrun.store import open_store

    torch.set_num_threads(1)
    doc = _spec(samplesPerRollout=args.samples, groupSize=8)
    doc["spec"]["rollout"]["source"]["generate"]["sampling"]["maxNewTokens"] = args.new_tokens
    doc["spec"]["rollout"]["source"]["generate"]["prompts"]["synthetic"].update(minLength=2, maxLength=8)
    doc["spec"]["model"]["seqLength"] = 64
    spec = parse_trainingrun(doc).spec
    tmp = tempfile.mkdtemp()
    store = open_store(f"file://{tmp}/store")
    arch = spec.model.resolved()
    engine = MegatronEngine(arch, fetch=store.read_weights, seed=spec.seed)
    arrays, dtypes = state_dict_arrays(engine.model)
    store.publish_weights(0, arrays, {"dtypes": dtypes})
    source = GenerateSource(spec, store, arch=arch, say=lambda m: None, engine=engine)
    source.ensure_weights(0)
    reps = args.repeats
    out: dict = {"requests": f"{spec.rollout.samples_per_rollout // 8} prompts x 8 completions, up to "
                             f"{args.new_tokens} new tokens, model {arch.num_layers} layers x "
                             f"{arch.hidden_size}"}
    rollout_tps, engine_tps, ratios = [], [], []
    for i in range(reps):  # back to back on the same requests; the median of the pairs' ratios (load varies)
        prompts = source.draw(i)
        source._index = i
        t0 = time.perf_counter()
        groups = source.generate(prompts, 0)
        t_rollout = time.perf_counter() - t0
        n_rollout = source.stats.generated_tokens
        seed = int(np.random.SeedSequence([spec.seed, i, 0x5A]).generate_state(1)[0])
        from trainingrun.contract.engine import Sampling

        sampling = Sampling(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=source.stop_ids, seed=seed)
        t0 = time.perf_counter()
        comps = engine.generate([p.tokens.tolist() for p in prompts], 8, sampling)
        t_engine = time.perf_counter() - t0
        n_engine = sum(len(c.tokens) for g in comps for c in g)
        assert n_engine == n_rollout and len(groups) == len(prompts)  # the very same requests and completions
        rollout_tps.append(n_rollout / t_rollout)
        engine_tps.append(n_engine / t_engine)
        ratios.append(t_engine / t_rollout)
        source._pending.clear()
    out["rollout_tok_s"] = float(np.median(rollout_tps))
    out["engine_tok_s"] = float(np.median(engine_tps))
    out["ratio"] = float(np.median(ratios))
    out["ratios"] = [round(x, 3) for x in ratios]
    try:
        out["megatron_static_engine_tok_s"] = _megatron_static(engine.model, source, spec, args)
    except Exception as exc:  # noqa: BLE001 - a figure we report as missing, with the reason
        if os.environ.get("RL_BENCH_TRACE"):
            import traceback

            traceback.print_exc()
        out["megatron_static_engine_tok_s"] = None
        out["megatron_static_engine_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def _megatron_static(model, source, spec, args) -> float:
    """Megatron-core's StaticInferenceEngine (legacy static batching) on the same prompts; best tok/s of repeats."""
    import torch
    from megatron.core.inference.engines import StaticInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    arch = spec.model.resolved()

    class Tok:  # what the controller asks of a tokenizer for token-id requests
        eod = 2
        vocab_size = arch.vocab_size

        def detokenize(self, ids, **_):
            return " ".join(map(str, ids))

        def tokenize(self, text):
            return [int(x) for x in text.split()]

        def offsets(self, ids, text):
            return list(range(len(ids)))

    config = InferenceWrapperConfig(hidden_size=arch.hidden_size, params_dtype=torch.float32,
                                    inference_batch_times_seqlen_threshold=-1,
                                    padded_vocab_size=arch.vocab_size, inference_max_requests=args.samples,
                                    inference_max_seq_length=64)
    # On CPU: Megatron's controller asks for a generator on torch.cuda.current_device() (an int, which the CPU shim's
    # device routing does not see); give it a CPU generator for the benchmark (tooling notes: what else it needs).
    cpu_generator = torch.Generator

    def generator(device=None):
        return cpu_generator()

    class Event:  # timing events only
        def __init__(self, *a, **k):
            self.t = 0.0

        def record(self, *a):
            self.t = time.perf_counter()

        def elapsed_time(self, other):
            return (other.t - self.t) * 1000

        def synchronize(self):
            pass

    cuda_event = torch.cuda.Event
    torch.Generator, torch.cuda.Event = generator, Event
    try:
        wrapped = GPTInferenceWrapper(model, config)
        controller = TextGenerationController(inference_wrapped_model=wrapped, tokenizer=Tok())
        engine = StaticInferenceEngine(text_generation_controller=controller, max_batch_size=args.samples, legacy=True)
        return _run_static(engine, source, args)
    finally:
        torch.Generator, torch.cuda.Event = cpu_generator, cuda_event


def _run_static(engine, source, args) -> float:
    from megatron.core.inference.inference_request import InferenceRequest
    from megatron.core.inference.sampling_params import SamplingParams

    best = 0.0
    for i in range(args.repeats):
        prompts = source.draw(i)
        params = SamplingParams(temperature=1.0, top_k=0, top_p=0.0, return_log_probs=True,
                                num_tokens_to_generate=args.new_tokens, termination_id=2)
        reqs = []
        for j, p in enumerate(prompts):
            for k in range(8):
                reqs.append(InferenceRequest(request_id=str(j * 8 + k), prompt="", sampling_params=params,
                                             prompt_tokens=p.tokens.tolist()))
        t0 = time.perf_counter()
        results = engine.generate(inference_requests=reqs)
        dt = time.perf_counter() - t0
        n = sum(len(r.generated_tokens) for r in results)
        best = max(best, n / dt)
    return best


# ---------------------------------------------------------------------------------------------------- sync
def sync_megatron(args) -> dict:
    """Runs in a subprocess: publish (trainer rank 0) + read + load (engine) through a file store, per model size."""
    import numpy as np
    import torch

    from trainingrun.modeling.architecture import resolve
    from trainingrun.modeling.state import state_dict_arrays
    from trainingrun.engines.megatron import MegatronEngine
    from trainingrun.store import open_store

    torch.set_num_threads(1)
    rows = []
    sizes_list = [
        ("tiny", dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=256)),
        ("small", dict(num_layers=4, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024, vocab_size=1024)),
        ("h768x4", dict(num_layers=4, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072,
                        vocab_size=32000)),
    ]
    for name, sizes in sizes_list:
        tmp = tempfile.mkdtemp()
        store = open_store(f"file://{tmp}/store?fsync=0")
        engine = MegatronEngine(resolve(**sizes, seq_length=64, precision="fp32"), fetch=store.read_weights, seed=1)
        arrays, dtypes = state_dict_arrays(engine.model)
        nbytes = sum(a.nbytes for a in arrays.values())
        buf = np.empty(nbytes, np.uint8)
        src = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays.values()])
        copy_s = min(_timed(lambda: np.copyto(buf, src)) for _ in range(5))
        publish, load = [], []
        for v in range(args.repeats):
            publish.append(_timed(lambda: store.publish_weights(v, arrays, {"dtypes": dtypes})))
            load.append(_timed(lambda: engine.load_weights(v)))
        total = min(publish) + min(load)
        rows.append({"model": name, "MB": nbytes / 1e6, "publish_s": min(publish), "load_s": min(load),
                     "sync_s": total, "copy_GB_s": nbytes / copy_s / 1e9,
                     "sync_over_copy": total / copy_s})
    return {"rows": rows}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------- wait
def wait_fraction(args, lag: int) -> dict:
    doc = _spec(numRollouts=args.rollouts, maxPolicyLag=lag)
    doc["spec"]["metrics"]["enabled"] = False
    tmp = Path(tempfile.mkdtemp())
    spec = tmp / "rl.yaml"
    spec.write_text(yaml.safe_dump(doc))
    out = tmp / "run"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "trainingrun", "run", str(spec), "--out", str(out),
                           "--progress-interval", "600"], cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode:
        raise RuntimeError(f"run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    waits = [r["data_wait_seconds"] for r in recs]
    # the trainers' loop time: from the start of the first wait to the end of the last step (rank 0's clock)
    first = recs[0]["time"] - recs[0]["step_seconds"] - recs[0]["data_wait_seconds"]
    span = recs[-1]["time"] - first
    steady = recs[1:]  # the first wait includes the rollout's start-up (building the engine)
    steady_span = recs[-1]["time"] - recs[0]["time"]
    return {"lag": lag, "rollouts": len(recs), "wall_s": wall, "wait_fraction": sum(waits) / span,
            "wait_fraction_after_first": sum(r["data_wait_seconds"] for r in steady) / steady_span,
            "trainer_loop_s": span, "mean_step_s": sum(r["step_seconds"] for r in recs) / len(recs),
            "mean_weight_sync_s": sum(r.get("weight_sync_seconds", 0.0) for r in recs) / len(recs),
            "reward_first_last": (recs[0]["reward_mean"], recs[-1]["reward_mean"])}


# ---------------------------------------------------------------------------------------------------- driver
ENGINES = {"megatron": {"generation": generation_megatron, "sync": sync_megatron}}


def _vllm_part(part: str):
    def run(args) -> dict:
        import benchmarks.rl_loop_vllm as v  # imported on use: needs nothing of vLLM until then

        return getattr(v, f"{part}_vllm")(args)
    return run


ENGINES["vllm"] = {"generation": _vllm_part("generation"), "sync": _vllm_part("sync")}
ENGINES["sim"] = {}  # its own parts: benchmarks/rl_loop_sim.py
SIM_PARTS = "throughput,oversample,broadcast,idle"


def _in_subprocess(part: str, args) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); sys.argv = {sys.argv!r}; "
            f"import benchmarks.rl_loop as b; a = b.parse(); "
            f"print('RESULT ' + json.dumps(b.ENGINES[a.engine][{part!r}](a)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{part} failed:\n{proc.stderr[-3000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="megatron", choices=sorted(ENGINES))
    ap.add_argument("--parts", default=None, help=f"default generation,sync,wait; --engine sim: {SIM_PARTS}")
    ap.add_argument("--samples", type=int, default=256, help="completions per generate call (groups of 8)")
    ap.add_argument("--new-tokens", type=int, default=16, help="max new tokens per completion")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rollouts", type=int, default=16, help="rollouts of each wait-fraction run")
    ap.add_argument("--json", action="store_true", help="also print all figures as one JSON line")
    ap.add_argument("--concurrency", type=int, default=64, help="vllm: requests the rollout keeps in flight")
    ap.add_argument("--vllm-model", default=None, help="vllm: HF directory to generate with (default: tiny Llama)")
    ap.add_argument("--vllm-tiny-only", action="store_true", help="vllm: sync figures for the tiny Llama only")
    sim = ap.add_argument_group("--engine sim (simulated vLLM servers)")
    sim.add_argument("--token-ms", type=float, default=10.0, help="milliseconds per generated token")
    sim.add_argument("--sim-batch", type=int, default=64, help="sequences an engine decodes at once")
    sim.add_argument("--median-tokens", type=int, default=32, help="median completion length")
    sim.add_argument("--length-sigma", type=float, default=1.0, help="log-normal sigma of completion lengths")
    sim.add_argument("--max-new-tokens", type=int, default=256, help="the completions' cap")
    sim.add_argument("--sim-requests", type=int, default=64, help="throughput: groups (of 4) per engine")
    sim.add_argument("--sim-prompts", type=int, default=16, help="oversample/idle: prompts (groups) per rollout")
    sim.add_argument("--train-s", type=float, default=3.0, help="idle: the stand-in trainer's seconds per rollout")
    sim.add_argument("--repeats-sim", type=int, default=3)
    sim.add_argument("--sync-mb", type=float, default=64, help="broadcast: MB of bf16 weights per version")
    args = ap.parse_args()
    if args.parts is None:
        args.parts = SIM_PARTS if args.engine == "sim" else "generation,sync,wait"
    return args


def main() -> int:
    args = parse()
    parts = args.parts.split(",")
    figures: dict = {"engine": args.engine, "load": os.getloadavg()}
    print(f"engine {args.engine}; load average {figures['load'][0]:.2f} (2-core machine shared with other work)")
    if args.engine == "sim":
        sys.path.insert(0, str(ROOT))  # benchmarks/rl_loop_sim.py and the simulated servers of tests/simengine.py
        import benchmarks.rl_loop_sim as sim  # imported on use: it starts simulated servers of its own

        figures.update(sim.run_all(args, parts))
        sim.report(figures, args)
        if args.json:
            print(json.dumps(figures))
        return 0
    if "generation" in parts:
        g = figures["generation"] = _in_subprocess("generation", args)
        print(f"generation ({g['requests']}):")
        print(f"  engine alone       {g['engine_tok_s']:9.0f} tok/s")
        print(f"  through rollout    {g['rollout_tok_s']:9.0f} tok/s   ratio {g['ratio']:.3f}  (target >= 0.9: "
              f"{'ok' if g['ratio'] >= 0.9 else 'MISSED'}; median of {len(g['ratios'])} back-to-back pairs "
              f"{g['ratios']})")
        if g.get("megatron_static_engine_tok_s") is not None:
            print(f"  megatron static    {g['megatron_static_engine_tok_s']:9.0f} tok/s   (Megatron-core's "
                  "StaticInferenceEngine, same prompts)")
        elif "megatron_static_engine_error" in g:
            print(f"  megatron static    not measured: {g['megatron_static_engine_error']}")
    if "sync" in parts:
        s = figures["sync"] = _in_subprocess("sync", args)
        print("weight sync through the store (file://, publish + read + load_state_dict):" if args.engine == "megatron"
              else "weight sync to vLLM (disk: HF dir written + pause/reload/reset/resume; broadcast: snapshot + gloo "
                   "group to the worker extension):")
        print(f"  {'model':18} {'MB':>8} {'publish s':>10} {'load s':>8} {'sync s':>8} {'copy GB/s':>10} "
              f"{'sync / copy':>12}")
        for r in s["rows"]:
            print(f"  {r['model']:18} {r['MB']:8.1f} {r['publish_s']:10.4f} {r['load_s']:8.4f} {r['sync_s']:8.4f} "
                  f"{r['copy_GB_s']:10.2f} {r['sync_over_copy']:12.1f}x")
    if "wait" in parts and args.engine != "megatron":
        print("trainer wait for data: measured with the megatron engine (--engine megatron --parts wait)")
    elif "wait" in parts:
        rows = figures["wait"] = [wait_fraction(args, lag) for lag in (0, 1)]
        print(f"trainer wait for data (examples/rl.yaml, {args.rollouts} rollouts, 2 trainers):")
        for r in rows:
            print(f"  maxPolicyLag {r['lag']}: waiting {100 * r['wait_fraction']:5.1f}% of the trainers' loop "
                  f"({100 * r['wait_fraction_after_first']:.1f}% after the first rollout), loop "
                  f"{r['trainer_loop_s']:.1f}s, run wall {r['wall_s']:.1f}s, mean step {r['mean_step_s']:.3f}s, mean weight sync "
                  f"{r['mean_weight_sync_s']:.4f}s")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
