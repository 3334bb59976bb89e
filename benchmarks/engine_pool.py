"""The engine pool's dispatch on simulated vLLM servers (issue 30, item 8): sticky routing and adaptive concurrency.

    .venv/bin/python benchmarks/engine_pool.py sticky   [--engines 2] [--episodes 48] [--turns 4] ...
    .venv/bin/python benchmarks/engine_pool.py adaptive [--kv-tokens 24000] [--requests 600] [--fixed 16,32,64,...]
    .venv/bin/python benchmarks/engine_pool.py sticky-wait

Each simulated engine (`python -m trainingrun.engines.simulated`, a process of its own) steps its running sequences
every --token-ms, pays --prefill-us per prompt token it computes (not found in its prefix cache), holds --kv-tokens
of KV cache and preempts (recomputes) what does not fit; it exports vLLM's metric names on /metrics, which the pool
reads (`VLLMReplica.signals`). The pool is the rollout's (`VLLMEngine`), so the figures are the dispatch's, not the
CPU's. Every part prints one JSON object per line, then a summary line with the ratios.

sticky       multi-turn episodes in lock step (as `rollout/episodes.py` runs them: one generate call per turn for every
             running episode): a shared system prompt (--system tokens), a task of its own, then per turn the
             completion and an observation (--observation tokens). Each episode's requests carry its affinity
             (sticky) or none (least loaded): the engines' prefix-cache hit rate (their own counters) and the tokens
             generated per second. Target: sticky hits more and is not slower.
adaptive     a long-tailed mix (prompts log-normal around --prompt-median tokens, completions log-normal around
             --median-tokens, one sample each: agentic turns) on engines whose KV cache is the limit: generated
             tokens per second at each fixed concurrency of --fixed and with `concurrency: auto` (cold: the limit
             starts at 64, and warm: a second run on the same pool). Targets: auto within 10 % of the best fixed
             setting, and >= 1.2 x fixed 64.
sticky-wait  sticky routing when the sticky replica is at its limit: wait up to --waits seconds for room there, or go
             to the least loaded replica at once (0), on the sticky workload with a low fixed limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.simengine import SimProcess, publish_disk_version  # noqa: E402
from trainingrun.contract.engine import GroupRequest, Sampling  # noqa: E402
from trainingrun.engines.vllm.engine import VLLMEngine, make_clients  # noqa: E402
from trainingrun.store import open_store  # noqa: E402

VOCAB = 4096


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


class Engines:
    """Simulated engines (processes) and a weight version 0 to load into a pool over them."""

    def __init__(self, count: int, args, **cfg):
        base = dict(token_seconds=args.token_ms / 1000, max_batch=args.max_batch, median_tokens=args.median_tokens,
                    length_sigma=args.length_sigma, vocab=VOCAB, prefill_token_seconds=args.prefill_us / 1e6,
                    seq_token_seconds=args.seq_us / 1e6, kv_tokens=args.kv_tokens)
        base.update(cfg)
        self.sims = [SimProcess(**{k: v for k, v in base.items() if v is not None}) for _ in range(count)]
        self.tmp = Path(tempfile.mkdtemp())
        self.store = open_store(f"file://{self.tmp / 'store'}")
        publish_disk_version(self.store, self.tmp / "w", 0)

    def pool(self, concurrency, **kw) -> VLLMEngine:
        pool = VLLMEngine(make_clients([s.url for s in self.sims], timeout=900),
                          fetch=lambda v: self.store.read_weights(v)[1], concurrency=concurrency, seeded=True,
                          say=lambda m: None, **kw)
        pool.load_weights(0)
        return pool

    def stats(self) -> list[dict]:
        out = []
        for s in self.sims:
            with urllib.request.urlopen(s.url + "/sim_stats", timeout=30) as r:
                out.append(json.loads(r.read()))
        return out

    def reset_caches(self) -> None:
        for s in self.sims:
            urllib.request.urlopen(urllib.request.Request(s.url + "/reset_prefix_cache", method="POST"),
                                   timeout=30).read()

    def close(self) -> None:
        for s in self.sims:
            s.close()
        self.store.close()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


# ------------------------------------------------------------------------------------------------------ sticky
def episodes_run(pool: VLLMEngine, args, *, sticky: bool, seed: int) -> dict:
    """args.episodes episodes in lock step, each of 1 .. args.turns turns (uniform: episodes end at different turns,
    as they do); returns tokens/s and the wall time."""
    rng = random.Random(seed)
    system = tokens(random.Random(0), args.system)
    contexts = [system + tokens(rng, args.task) for _ in range(args.episodes)]
    ends = [rng.randint(1, args.turns) for _ in contexts]
    sampling = Sampling(temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=(2,), seed=seed)
    generated, t0 = 0, time.perf_counter()
    for turn in range(args.turns):
        running = [i for i in range(len(contexts)) if ends[i] > turn]
        affinities = [f"ep{seed}-{i}" for i in running] if sticky else None
        out = pool.generate([contexts[i] for i in running], 1,
                            dataclasses.replace(sampling, seed=seed * 100 + turn), affinities=affinities)
        for i, (c,) in zip(running, out):
            generated += len(c.tokens)
            contexts[i] = contexts[i] + [int(t) for t in c.tokens] + tokens(rng, args.observation)
    if sticky:
        pool.release(f"ep{seed}-{i}" for i in range(len(contexts)))
    wall = time.perf_counter() - t0
    return {"tok_s": generated / wall, "wall_s": wall, "generated": generated}


def sticky(args) -> dict:
    rows = {}
    engines = Engines(args.engines, args)
    try:
        for mode in ("least-loaded", "sticky") if args.mode == "both" else (args.mode,):
            pool = engines.pool(args.concurrency)
            runs = []
            for rep in range(args.repeats):
                engines.reset_caches()
                before = pool.engine_counts()
                run = episodes_run(pool, args, sticky=mode == "sticky", seed=rep + 1)
                after = pool.engine_counts()
                q = sum(after[k].prefix_queries - before[k].prefix_queries for k in after)
                h = sum(after[k].prefix_hits - before[k].prefix_hits for k in after)
                run["prefix_hit_rate"] = h / q if q else 0.0
                runs.append(run)
                emit({"part": "sticky", "mode": mode, "repeat": rep, **{k: round(v, 4) for k, v in run.items()}})
            pool.close()
            rows[mode] = {"tok_s": statistics.median(r["tok_s"] for r in runs),
                          "prefix_hit_rate": statistics.median(r["prefix_hit_rate"] for r in runs)}
    finally:
        engines.close()
    if len(rows) < 2:
        emit({"part": "sticky", "engines": args.engines, **rows})
        return rows
    summary = {"part": "sticky", "engines": args.engines, "least_loaded": rows["least-loaded"],
               "sticky": rows["sticky"], "tok_s_ratio": rows["sticky"]["tok_s"] / rows["least-loaded"]["tok_s"]}
    emit(summary)
    return summary


def sticky_wait(args) -> dict:
    rows = []
    engines = Engines(args.engines, args)
    try:
        for wait in [float(x) for x in args.waits.split(",")]:
            pool = engines.pool(args.wait_concurrency, sticky_wait=wait)
            runs = []
            for rep in range(args.repeats):
                engines.reset_caches()
                before = pool.engine_counts()
                run = episodes_run(pool, args, sticky=True, seed=rep + 1)
                after = pool.engine_counts()
                q = sum(after[k].prefix_queries - before[k].prefix_queries for k in after)
                h = sum(after[k].prefix_hits - before[k].prefix_hits for k in after)
                run["prefix_hit_rate"] = h / q if q else 0.0
                runs.append(run)
            pool.close()
            row = {"part": "sticky-wait", "wait_s": wait, "concurrency": args.wait_concurrency,
                   "tok_s": statistics.median(r["tok_s"] for r in runs),
                   "prefix_hit_rate": statistics.median(r["prefix_hit_rate"] for r in runs)}
            rows.append(row)
            emit(row)
    finally:
        engines.close()
    return {"rows": rows}


# ------------------------------------------------------------------------------------------------------ adaptive
def mix(args, seed: int) -> list[GroupRequest]:
    """The long-tailed mix: prompt lengths log-normal (median --prompt-median, sigma --prompt-sigma, capped)."""
    rng = random.Random(seed)
    out = []
    for i in range(args.requests):
        length = min(args.prompt_cap, max(8, int(rng.lognormvariate(math.log(args.prompt_median), args.prompt_sigma))))
        out.append(GroupRequest(prompt=tokens(rng, length), n=1, seed=seed * 100_000 + i))
    return out


def generate_mix(pool: VLLMEngine, args, seed: int) -> dict:
    requests = mix(args, seed)
    sampling = Sampling(temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=(2,))
    t0 = time.perf_counter()
    out = pool.generate_groups(requests, sampling)
    wall = time.perf_counter() - t0
    generated = sum(len(c.tokens) for g in out for c in g)
    return {"tok_s": generated / wall, "wall_s": wall, "generated": generated}


def adaptive(args) -> dict:
    engines = Engines(args.engines, args)
    results: dict[str, float] = {}
    try:
        settings = [*[int(x) for x in args.fixed.split(",")], "auto"] if args.only is None else [
            args.only if args.only == "auto" else int(args.only)]
        for setting in settings:
            pool = engines.pool(setting)
            runs = []
            for rep in range(args.repeats):
                engines.reset_caches()
                pre = sum(s["preemptions"] for s in engines.stats())
                run = generate_mix(pool, args, seed=rep + 1)
                run["preemptions"] = sum(s["preemptions"] for s in engines.stats()) - pre
                run["limits"] = sorted(c.concurrency for c in pool.engine_counts().values())
                runs.append(run)
                emit({"part": "adaptive", "concurrency": setting, "repeat": rep,
                      **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in run.items()}})
            pool.close()
            key = str(setting)
            results[key] = statistics.median(r["tok_s"] for r in runs)
            if setting == "auto":  # warm: the second and later runs start from the limits the first one learned
                results["auto (warm)"] = statistics.median(r["tok_s"] for r in runs[1:]) if len(runs) > 1 else runs[0]["tok_s"]
                results["auto (cold)"] = runs[0]["tok_s"]
    finally:
        engines.close()
    fixed = {k: v for k, v in results.items() if k.isdigit()}
    if args.only is not None or not fixed or "auto" not in results:
        emit({"part": "adaptive", "engines": args.engines, "kv_tokens": args.kv_tokens, "tok_s": results})
        return results
    best = max(fixed, key=fixed.get)
    summary = {"part": "adaptive", "engines": args.engines, "kv_tokens": args.kv_tokens, "tok_s": results,
               "best_fixed": int(best), "auto_vs_best": results["auto"] / fixed[best],
               "auto_vs_64": results["auto"] / fixed["64"] if "64" in fixed else None,
               "target_within_10pct": results["auto"] >= 0.9 * fixed[best],
               "target_1.2x_64": "64" in fixed and results["auto"] >= 1.2 * fixed["64"]}
    emit(summary)
    return summary


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="*", default=["sticky", "adaptive"], choices=["sticky", "adaptive", "sticky-wait"])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--token-ms", type=float, default=20.0, help="a decode step, milliseconds")
    ap.add_argument("--prefill-us", type=float, default=20.0, help="microseconds per prompt token computed")
    ap.add_argument("--seq-us", type=float, default=200.0, help="microseconds per running sequence in a step")
    ap.add_argument("--max-batch", type=int, default=512, help="sequences an engine runs at once (max_num_seqs)")
    ap.add_argument("--kv-tokens", type=int, default=None, help="each engine's KV cache in tokens")
    ap.add_argument("--median-tokens", type=int, default=48, help="median completion length")
    ap.add_argument("--length-sigma", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    s = ap.add_argument_group("sticky")
    s.add_argument("--episodes", type=int, default=48)
    s.add_argument("--turns", type=int, default=6, help="most turns of an episode")
    s.add_argument("--system", type=int, default=512, help="tokens of the shared system prompt")
    s.add_argument("--task", type=int, default=64, help="tokens of each episode's own task")
    s.add_argument("--observation", type=int, default=64, help="tokens of each observation")
    s.add_argument("--concurrency", type=int, default=64)
    s.add_argument("--mode", choices=("both", "sticky", "least-loaded"), default="both",
                   help="both, or one (one whole process per mode)")
    s.add_argument("--waits", default="0,0.5,2", help="sticky-wait: seconds to try")
    s.add_argument("--wait-concurrency", type=int, default=8, help="sticky-wait: the fixed limit that makes waits")
    a = ap.add_argument_group("adaptive")
    a.add_argument("--requests", type=int, default=1000)
    a.add_argument("--prompt-median", type=int, default=256)
    a.add_argument("--prompt-sigma", type=float, default=0.8)
    a.add_argument("--prompt-cap", type=int, default=4096)
    a.add_argument("--fixed", default="32,64,128,256,512")
    a.add_argument("--only", default=None, help="one setting (a number or auto): one whole process per setting")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    for part in args.parts:
        {"sticky": sticky, "adaptive": adaptive, "sticky-wait": sticky_wait}[part](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
