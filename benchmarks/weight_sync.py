"""Weight-sync figures with simulated engines (issue 28 item 10): one JSON object per line.

The sender streams a model of `--params` parameters (fp32 master weights, a few tensors of llama-like shapes) bucket
by bucket as `trainingrun/modeling/sync_plan.py` plans it (`--bucket-mib`): each bucket's tensors are cast to the
engine dtype (bf16) and packed into one flat buffer, then copied into the buffer of every simulated engine (an
engine = a preallocated flat bf16 copy of the model on the same device), and the bucket is freed. Lines:

  {"kind": "sync", "engines": N, "seconds": ..., "gbps": ...}             N = 1, 2, 4, 8
  {"kind": "memcpy", "gbps": ...}            one copy of the same bytes (the machine's memory bandwidth, for scale)
  {"kind": "peak", "params": P, "model_bytes": ..., "peak_extra_bytes": ..., "bucket_bytes": ...}
      at two model sizes (P and 2P), each in a fresh process: the sender's peak resident set during the streamed
      sync (VmHWM, reset before it) minus its resident set after building the model (CPU; on CUDA the allocator's peak minus the model's).

`--device cuda` runs the same on one GPU: gather/cast/pack on the GPU and the device-to-host copy of each bucket
into pinned host memory (a "d2h" line). There is one GPU on the device machine, so no NCCL group of several ranks:
what crosses GPUs is not measured (the output says so). Only torch, numpy and this package.

  {"kind": "broadcast", "mode": "pool"|"per_engine", "engines": N, "bytes_sent_rank0": ..., "seconds": ...}
      the real broadcast sync (`BroadcastSender`, gloo on 127.0.0.1) of the same model in bf16 to N = 1, 2, 4, 8
      simulated engines, each a process running the worker extension's own `receive` (one worker each): "pool"
      serves them as the pool does, in one transfer (a chain through the engines, each bucket sent once by rank 0);
      "per_engine" as before issue 28 item 2, one transfer per engine, one after another. `seconds` is the sender's,
      from the manifest to the last engine's answer (the receivers' torch import excluded). `--broadcast-only` skips
      the other lines.
  {"kind": "broadcast", "engine_tp": T, "engines": N, "bytes_per_worker": [...], "bytes_sent_rank0": ...}
      `--engine-tp T`: the pool's transfer to N = 1, 2, 4 engines of TP T (T worker processes each), the model's
      tensors under Llama-like names, sliced per worker (issue 28 item 6); only these lines.

Run: `OMP_NUM_THREADS=1 python benchmarks/weight_sync.py [--params 20000000] [--bucket-mib 8] [--device cpu]`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainingrun.modeling.sync_plan import bucket_bytes, plan_buckets  # noqa: E402


def make_model(params: int, device: str):
    import torch

    hidden = 1024 if params >= 50_000_000 else 256
    shapes, total, i = [], 0, 0
    while total < params:
        shape = [(4 * hidden, hidden), (hidden, hidden), (hidden,)][i % 3]
        n = 1
        for d in shape:
            n *= d
        shapes.append(shape)
        total += n
        i += 1
    g = torch.Generator(device=device).manual_seed(0)
    return {f"w{i}": torch.randn(s, generator=g, device=device) for i, s in enumerate(shapes)}


def stream(model, limit: int, sinks) -> int:
    """Bucket by bucket: cast to bf16, pack, hand to every sink, free. Returns the bytes sent to one sink."""
    import torch

    sizes = [(n, t.numel() * 2) for n, t in model.items()]
    sent = 0
    for b in plan_buckets(sizes, limit):
        flat = torch.empty(b.nbytes // 2, dtype=torch.bfloat16, device=next(iter(model.values())).device)
        pos = 0
        for n in b.names:
            t = model[n]
            flat[pos:pos + t.numel()].copy_(t.reshape(-1))
            pos += t.numel()
        for sink in sinks:
            sink(flat, sent)
        sent += b.nbytes
        del flat
    return sent


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def run_sync(model, limit: int, device: str) -> None:
    import torch

    total = sum(t.numel() for t in model.values())
    for engines in (1, 2, 4, 8):
        bufs = [torch.empty(total, dtype=torch.bfloat16, device=device) for _ in range(engines)]
        sinks = [lambda flat, at, buf=buf: buf[at // 2:at // 2 + flat.numel()].copy_(flat) for buf in bufs]
        _sync(device)
        t0 = time.perf_counter()
        nbytes = stream(model, limit, sinks)
        _sync(device)
        dt = time.perf_counter() - t0
        print(json.dumps({"kind": "sync", "device": device, "engines": engines, "bytes": nbytes * engines,
                          "seconds": round(dt, 6), "gbps": round(nbytes * engines / dt / 1e9, 3)}), flush=True)
        del bufs, sinks
    src = torch.empty(total, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    _sync(device)
    t0 = time.perf_counter()
    dst.copy_(src)
    _sync(device)
    dt = time.perf_counter() - t0
    print(json.dumps({"kind": "memcpy", "device": device, "bytes": total * 2, "seconds": round(dt, 6),
                      "gbps": round(total * 2 / dt / 1e9, 3)}), flush=True)
    if device == "cuda":
        host = torch.empty(total, dtype=torch.bfloat16).pin_memory()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        nbytes = stream(model, limit, [lambda flat, at: host[at // 2:at // 2 + flat.numel()].copy_(flat)])
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(json.dumps({"kind": "d2h", "device": device, "bytes": nbytes, "seconds": round(dt, 6),
                          "gbps": round(nbytes / dt / 1e9, 3),
                          "note": "one GPU: bucket gather/cast/pack on the GPU + device-to-host copies; no "
                                  "multi-GPU NCCL broadcast measured"}), flush=True)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> int:
    """Linux: reset the peak resident set (VmHWM) to the current one; return the current one in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def peak(params: int, limit: int, device: str) -> None:
    """In this (fresh) process: the sender's peak extra memory of one streamed sync to one engine on the host."""
    import torch

    model = make_model(params, device)
    model_bytes = sum(t.numel() * t.element_size() for t in model.values())
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.max_memory_allocated()
    else:
        base = _reset_peak_rss()
    stream(model, limit, [lambda flat, at: None])
    if device == "cuda":
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
    else:
        extra = max(0, _status_kib("VmHWM") * 1024 - base)
    print(json.dumps({"kind": "peak", "device": device, "params": params, "model_bytes": model_bytes,
                      "peak_extra_bytes": extra, "bucket_bytes": limit,
                      "peak_extra_buckets": round(extra / limit, 3)}), flush=True)


def receiver(request: str) -> None:
    """One simulated engine worker (a process): the worker extension's receive, then "ok" for the sender; with
    `--engine-tp` worker `_rank` of a TP engine, which prints what it received."""
    from trainingrun.engines.vllm.worker_ext import receive

    req = json.loads(request)
    rank, tp = int(req.pop("_rank", 0)), req.pop("_tp", None)
    manifest, named, store = receive(req, rank=1 + rank, device="cpu", tp=tp)
    store.set(manifest["done_key"], "ok")
    if tp:
        print(json.dumps({"rank": rank, "received_bytes": manifest["received_bytes"]}), flush=True)


def llama_names(model: dict) -> dict:
    """`make_model`'s tensors under Llama-like HF names the slicing table knows ((4h, h) an up_proj, (h, h) an
    o_proj, (h,) a norm), for `--engine-tp`."""
    names = {2: "mlp.up_proj.weight", 1: "self_attn.o_proj.weight", 0: "input_layernorm.weight"}
    out = {}
    for i, t in enumerate(model.values()):
        kind = 0 if t.dim() == 1 else (2 if t.shape[0] != t.shape[1] else 1)
        out[f"model.layers.{i}.{names[kind]}"] = t
    return out


def run_broadcast_tp(model, limit: int, t: int) -> None:
    """The pool's transfer to N engines of TP `t` (t worker processes each): what each worker received."""
    import os
    import uuid

    from trainingrun.engines.vllm.broadcast import BroadcastSender, new_group_name

    sender = BroadcastSender(0, host="127.0.0.1", timeout=600, dtype="bfloat16", bucket_bytes=limit,
                             join_window=120, log=lambda m: print(f"# {m}", file=sys.stderr)).start()
    tp = {"size": t, "kv_heads": t, "vocab_pad": 64, "expert_parallel": False}
    try:
        nbytes = sender.set_weights(0, llama_names(model).items()).nbytes
        for engines in (1, 2, 4):
            joint = {"id": uuid.uuid4().hex[:12], "members": engines}
            before, served = sender.bytes_sent, sender.transfers
            procs = []
            for _ in range(engines):
                req = {"host": "127.0.0.1", "port": sender.port, "group": new_group_name(), "world_size": 1 + t,
                       "backend": "gloo", "timeout": 600, "connect_timeout": 60, "version": 0, "joint": joint}
                procs += [subprocess.Popen([sys.executable, __file__, "--receiver",
                                            json.dumps({**req, "_rank": r, "_tp": {**tp, "rank": r}})],
                                           env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                                           text=True) for r in range(t)]
            outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
            while sender.transfers < served + 1:
                time.sleep(0.05)
            got = [o["received_bytes"] for o in outs]
            print(json.dumps({"kind": "broadcast", "mode": "pool", "engine_tp": t, "engines": engines,
                              "model_bytes": nbytes, "bytes_per_worker": got,
                              "worker_over_model": [round(b / nbytes, 3) for b in got],
                              "bytes_sent_rank0": sender.bytes_sent - before,
                              "bytes_sent_over_model": round((sender.bytes_sent - before) / nbytes, 3),
                              "seconds": round(sender.last["total_seconds"], 3)}), flush=True)
    finally:
        sender.close()


def run_broadcast(model, limit: int) -> None:
    """The real broadcast sync to N engine processes, as one transfer of the pool and one transfer per engine."""
    import os
    import uuid

    from trainingrun.engines.vllm.broadcast import BroadcastSender, new_group_name

    sender = BroadcastSender(0, host="127.0.0.1", timeout=600, dtype="bfloat16", bucket_bytes=limit,
                             join_window=120, log=lambda m: print(f"# {m}", file=sys.stderr)).start()
    try:
        sender.set_weights(0, model.items())
        for mode in ("pool", "per_engine"):
            for engines in (1, 2, 4, 8):
                joint = {"id": uuid.uuid4().hex[:12], "members": engines} if mode == "pool" else None
                before, served = sender.bytes_sent, sender.transfers
                procs = []
                for _ in range(engines):
                    req = {"host": "127.0.0.1", "port": sender.port, "group": new_group_name(), "world_size": 2,
                           "backend": "gloo", "timeout": 600, "connect_timeout": 60, "version": 0, "joint": joint}
                    procs.append(subprocess.Popen([sys.executable, __file__, "--receiver", json.dumps(req)],
                                                  env={**os.environ, "OMP_NUM_THREADS": "1"}))
                want = served + (1 if mode == "pool" else engines)
                while sender.transfers < want:
                    if any(p.poll() not in (None, 0) for p in procs):
                        raise RuntimeError("a receiver failed")
                    time.sleep(0.05)
                for p in procs:
                    p.wait(timeout=600)
                seconds = sum(t["total_seconds"] for t in list(sender.history)[served - want:])
                sent = sender.bytes_sent - before
                print(json.dumps({"kind": "broadcast", "mode": mode, "engines": engines, "backend": "gloo",
                                  "model_bytes": sender._snapshots[0].nbytes, "bytes_sent_rank0": sent,
                                  "bytes_sent_over_model": round(sent / sender._snapshots[0].nbytes, 3),
                                  "seconds": round(seconds, 3)}), flush=True)
    finally:
        sender.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=20_000_000)
    ap.add_argument("--bucket-mib", type=int, default=8)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--peak-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--broadcast-only", action="store_true", help="only the broadcast lines (gloo, CPU)")
    ap.add_argument("--engine-tp", type=int, default=1,
                    help="engines of this tensor parallelism (worker processes each): the sliced broadcast's bytes "
                         "per worker (only those lines)")
    ap.add_argument("--receiver", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.receiver:
        receiver(args.receiver)
        return
    limit = bucket_bytes(args.bucket_mib)
    if args.engine_tp > 1:
        run_broadcast_tp(make_model(args.params, "cpu"), limit, args.engine_tp)
        return
    if args.broadcast_only:
        run_broadcast(make_model(args.params, "cpu"), limit)
        return
    if args.peak_only:
        peak(args.params, limit, args.device)
        return
    run_sync(make_model(args.params, args.device), limit, args.device)
    if args.device == "cpu":
        run_broadcast(make_model(args.params, "cpu"), limit)
    for p in (args.params, 2 * args.params):
        out = subprocess.run([sys.executable, __file__, "--peak-only", "--params", str(p), "--bucket-mib",
                              str(args.bucket_mib), "--device", args.device], check=True, capture_output=True,
                             text=True)
        print(out.stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
