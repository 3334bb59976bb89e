"""The rollout's own scheduling against simulated vLLM servers (`benchmarks/rl_loop.py --engine sim`; issue 20 item 8).

Each simulated engine (`python -m trainingrun.engines.simulated`, a process of its own) decodes up to --sim-batch
sequences at once, --token-ms per token, with log-normal (long-tailed) completion lengths; the rollout reaches it
through the same pool client as a real vLLM server (`trainingrun.engines.vllm.engine.VLLMEngine`, the engine pool
over vLLM servers). So the figures are the rollout's dispatch, abort and overlap, not this machine's CPU.

throughput   the same requests through a pool of 1, 2 and 4 engines: generated tokens per second; target
             4 engines >= 0.9 x 4 x one engine.
oversample   the rollout's generate stage (`GenerateSource`, the prompt stream) on the long-tailed mix: wall time to
             P accepted groups without over-sampling (P requests, every one waited for) and with overSampling 0.5
             (1.5 P requests, the rest aborted once P groups finished); target: >= 30 % less wall time.
broadcast    weight sync by `broadcast` to pools of 1, 2 and 4 simulated engines (each receives over gloo with the
             worker extension's own `receive`, as a real server's worker does): trainer 0's sender serves one transfer
             per engine, one after another (a fan-out, not one process group over all engines); the pool's wall
             time and each engine's seconds, for --sync-mb of bf16 weights.
idle         the rollout loop (`RolloutLoop`) with a stand-in trainer that trains each rollout for --train-s seconds
             and then publishes the next weight version (the engines load it from disk as from a real trainer):
             the trainer's idle fraction (time waiting for rollout k over its loop time) at maxPolicyLag 0 and 1,
             with generation faster than training; target < 10 % at lag 1.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

from tests.simengine import SimProcess, publish_disk_version
from trainingrun.api import parse_trainingrun
from trainingrun.contract.engine import GroupRequest, Sampling
from trainingrun.rollout.generate import GenerateSource
from trainingrun.rollout.loop import RolloutLoop
from trainingrun.store import open_store
from trainingrun.engines.vllm.engine import VLLMEngine, make_clients

GROUP = 4


def _engines(count: int, args, **cfg) -> list[SimProcess]:
    base = dict(token_seconds=args.token_ms / 1000, max_batch=args.sim_batch, median_tokens=args.median_tokens,
                length_sigma=args.length_sigma, vocab=8)
    base.update(cfg)
    return [SimProcess(**base) for _ in range(count)]


def _pool(sims, store, concurrency: int) -> VLLMEngine:
    return VLLMEngine(make_clients([s.url for s in sims], timeout=600), fetch=lambda v: store.read_weights(v)[1],
                      concurrency=concurrency, seeded=True, say=lambda m: None)


def _store():
    tmp = Path(tempfile.mkdtemp())
    store = open_store(f"file://{tmp / 'store'}")
    return tmp, store


def throughput(args) -> dict:
    """Tokens per second through pools of 1, 2, 4 engines (the same requests; each engine kept full: its cap is
    the sequences it decodes at once)."""
    tmp, store = _store()
    publish_disk_version(store, tmp / "w", 0)
    rows = []
    for count in (1, 2, 4):
        sims = _engines(count, args)
        try:
            pool = _pool(sims, store, concurrency=args.sim_batch // GROUP)
            pool.load_weights(0)
            requests = [GroupRequest(prompt=[5, 6, 3 + i % 5], n=GROUP, seed=i)
                        for i in range(args.sim_requests * count)]
            sampling = Sampling(temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=(2,))
            runs = []
            for _ in range(args.repeats_sim):
                t0 = time.perf_counter()
                out = pool.generate_groups(requests, sampling)
                wall = time.perf_counter() - t0
                runs.append(sum(len(c.tokens) for g in out for c in g) / wall)
            pool.close()
        finally:
            for s in sims:
                s.close()
        rows.append({"engines": count, "requests": len(requests), "tok_s": statistics.median(runs), "runs": runs})
    one = rows[0]["tok_s"]
    for r in rows:
        r["vs_ideal"] = r["tok_s"] / (r["engines"] * one)
    return {"rows": rows, "target_4": rows[-1]["vs_ideal"] >= 0.9}


def broadcast(args) -> dict:
    """Weight sync by broadcast (fan-out) to 1, 2, 4 engines: wall time of `load_weights` and per-engine seconds."""
    import torch  # deferred: torch (the broadcast part only)

    from trainingrun.engines.vllm.broadcast import BroadcastSender

    numel = int(args.sync_mb * (1 << 20)) // 2 // 8
    named = [(f"model.layers.{i}.weight", torch.randn(numel)) for i in range(8)]  # bf16 on the wire
    rows = []
    for count in (1, 2, 4):
        sender = BroadcastSender(0, host="127.0.0.1", dtype="bfloat16", keep_versions=1, timeout=120,
                                 log=lambda m: None).start()
        sims = _engines(count, args)
        try:
            metas: dict[int, dict] = {}
            pool = VLLMEngine(make_clients([s.url for s in sims], timeout=600), fetch=metas.__getitem__,
                              say=lambda m: None, load_timeout=120)
            walls, per_engine = [], []
            for v in range(args.repeats_sim + 1):
                snap = sender.set_weights(v, named)
                metas[v] = {"method": "broadcast", "host": "127.0.0.1", "port": sender.port, "backend": "gloo",
                            "bytes": snap.nbytes}
                t0 = time.perf_counter()
                pool.load_weights(v)
                if v:  # the first transfer includes the workers' first group set-up: warm-up
                    walls.append(time.perf_counter() - t0)
                    per_engine.append(sorted(pool.last_sync.values()))
            pool.close()
        finally:
            for s in sims:
                s.close()
            sender.close()
        rows.append({"engines": count, "MB": snap.nbytes / 1e6, "wall_s": statistics.median(walls),
                     "per_engine_s": per_engine[len(per_engine) // 2]})
    return {"rows": rows}


def _doc(**rollout) -> dict:
    r = {"source": {"type": "generate", "generate": {
            "prompts": {"synthetic": {"task": "copy", "minLength": 1, "maxLength": 3, "vocabSize": 8}},
            "sampling": {"maxNewTokens": 0}, "reward": {"type": "token_match"}}},
         "samplesPerRollout": 0, "groupSize": GROUP, "numRollouts": 8, "maxPendingRollouts": 4,
         "filters": {"zeroVariance": False}, "steps": {"policy": "dynamic"}}
    r.update(rollout)
    return {"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "sim"},
            "spec": {"seed": 5, "model": {"preset": "tiny", "vocabSize": 8, "seqLength": 4096},
                     "trainer": {"replicas": 1, "maxTokensPerGPU": 1 << 20, "lossType": "ppo"}, "rollout": r}}


def _source(doc, store, engine) -> GenerateSource:
    spec = parse_trainingrun(doc).spec
    return GenerateSource(spec, store, arch=spec.model.resolved(), say=lambda m: None, engine=engine)


def oversample(args) -> dict:
    """Source rollouts of P groups on one engine, without and with over-sampling + abort."""
    tmp, store = _store()
    publish_disk_version(store, tmp / "w", 0)
    prompts = args.sim_prompts
    sims = _engines(1, args, max_batch=prompts * GROUP * 2)
    out = {}
    try:
        for name, over in (("plain", 0.0), ("over_sampling_0.5", 0.5)):
            doc = _doc(samplesPerRollout=prompts * GROUP, overSampling=over)
            doc["spec"]["rollout"]["source"]["generate"]["sampling"]["maxNewTokens"] = args.max_new_tokens
            engine = _pool(sims, store, concurrency=prompts * 2)
            source = _source(doc, store, engine)
            walls, accepted, aborted = [], [], []
            for i in range(args.repeats_sim):
                t0 = time.perf_counter()
                groups = source.generate(source.draw(i), 0)
                walls.append(time.perf_counter() - t0)
                source.score(groups)
                accepted.append(len(groups))
                aborted.append(source.stats.groups_aborted)
            engine.close()
            out[name] = {"wall_s": statistics.median(walls), "walls": walls, "groups": accepted, "aborted": aborted}
    finally:
        for s in sims:
            s.close()
    out["cut"] = 1 - out["over_sampling_0.5"]["wall_s"] / out["plain"]["wall_s"]
    out["target"] = out["cut"] >= 0.30
    return out


def idle(args, lag: int) -> dict:
    """The rollout loop and a stand-in trainer: idle fraction of the trainer's loop."""
    tmp, store = _store()
    url = store.url
    publish_disk_version(store, tmp / "w", 0)
    sims = _engines(2, args)
    n = args.rollouts
    doc = _doc(samplesPerRollout=args.sim_prompts * GROUP, numRollouts=n, maxPolicyLag=lag)
    doc["spec"]["rollout"]["source"]["generate"]["sampling"]["maxNewTokens"] = args.max_new_tokens
    waits: list[float] = []
    span: list[float] = []

    def trainer():
        reader = open_store(url)
        start = None
        for k in range(n):
            t0 = time.monotonic()
            assert reader.wait_rollout(k, timeout=600)
            if start is None:
                start = time.monotonic()  # the first rollout's wait includes the rollout's start-up
            else:
                waits.append(time.monotonic() - t0)
            time.sleep(args.train_s)  # "training" rollout k
            reader.ack(k, 0)
            publish_disk_version(reader, tmp / "w", k + 1)
        span.append(time.monotonic() - start)

    try:
        engine = _pool(sims, store, concurrency=args.sim_batch // GROUP)
        spec = parse_trainingrun(doc).spec
        import trainingrun.rollout.loop as loop_mod  # the loop builds its source; ours uses the simulated pool

        orig = loop_mod.make_source
        loop_mod.make_source = lambda s, arch, say, st, max_wait: GenerateSource(s, st, arch=arch, say=say,
                                                                                 engine=engine, max_wait=max_wait)
        try:
            lp = RolloutLoop(spec, store, progress=lambda _m: None)
        finally:
            loop_mod.make_source = orig
        lp.say = lambda m: None
        t = threading.Thread(target=trainer, daemon=True)
        t0 = time.monotonic()
        t.start()
        lp.run()
        gen = time.monotonic() - t0
        t.join(600)
    finally:
        for s in sims:
            s.close()
    return {"lag": lag, "rollouts": n, "train_s": args.train_s, "idle_fraction": sum(waits) / span[0],
            "trainer_loop_s": span[0], "rollout_wall_s": gen}


def run_all(args, parts: list[str]) -> dict:
    figures = {}
    if "throughput" in parts:
        figures["throughput"] = throughput(args)
    if "oversample" in parts:
        figures["oversample"] = oversample(args)
    if "broadcast" in parts:
        figures["broadcast"] = broadcast(args)
    if "idle" in parts:
        figures["idle"] = [idle(args, lag) for lag in (0, 1)]
    return figures


def report(f: dict, args) -> None:
    cfg = (f"simulated engines: {args.token_ms} ms/token, {args.sim_batch} sequences at once, lengths log-normal "
           f"(median {args.median_tokens}, sigma {args.length_sigma}) capped at {args.max_new_tokens}")
    print(cfg)
    if "throughput" in f:
        print("generation throughput (pool client, least-outstanding dispatch):")
        for r in f["throughput"]["rows"]:
            print(f"  {r['engines']} engine(s)  {r['requests']:5d} groups  {r['tok_s']:9.0f} tok/s   "
                  f"{r['vs_ideal']:.3f} x (engines x one engine)")
        print(f"  target 4 engines >= 0.9 x 4 x one: {'ok' if f['throughput']['target_4'] else 'MISSED'}")
    if "oversample" in f:
        o = f["oversample"]
        print(f"source rollout wall time to {args.sim_prompts} groups (one engine, long-tailed mix):")
        print(f"  without over-sampling      {o['plain']['wall_s']:7.2f} s  (groups {o['plain']['groups']})")
        print(f"  overSampling 0.5 + abort   {o['over_sampling_0.5']['wall_s']:7.2f} s  (groups "
              f"{o['over_sampling_0.5']['groups']}, aborted {o['over_sampling_0.5']['aborted']})")
        print(f"  cut {100 * o['cut']:.1f} %  (target >= 30 %: {'ok' if o['target'] else 'MISSED'})")
    if "broadcast" in f:
        print("weight sync by broadcast (trainer 0 serves each engine in turn: a fan-out):")
        for r in f["broadcast"]["rows"]:
            print(f"  {r['engines']} engine(s)  {r['MB']:7.1f} MB  pool {r['wall_s']:7.3f} s   per engine "
                  + " ".join(f"{x:.3f}" for x in r["per_engine_s"]))
    if "idle" in f:
        print(f"trainer idle (stand-in trainer {args.train_s} s per rollout, 2 engines, {args.rollouts} rollouts):")
        for r in f["idle"]:
            print(f"  maxPolicyLag {r['lag']}: idle {100 * r['idle_fraction']:5.1f} % of the trainer's loop "
                  f"({r['trainer_loop_s']:.1f} s)")
