"""A simulated vLLM server: the part of vLLM's HTTP API the rollout uses, with no model behind it.

It answers `/v1/completions` after a configurable time per generated token, with completion lengths drawn from a
long-tailed (log-normal) distribution, so the rollout's own scheduling — the pool's dispatch, sticky routing and
adaptive concurrency, over-sampling with abort, partial rollouts, weight sync to several engines, a dead, stalled or
broken engine — can be tested in seconds and measured on a small CPU machine (benchmarks/rl_loop.py `--engine sim`,
benchmarks/engine_pool.py). The rollout reaches it through the same client as a real server
(`trainingrun.engines.vllm.client`).

    python -m trainingrun.engines.simulated --port 0 [--token-seconds 0.002] [--max-batch 256] [--median-tokens 64]
                                         [--length-sigma 1.0] [--load-seconds 0] [--vocab 512] [--kv-tokens N]
                                         [--prefill-token-seconds S] [--seq-token-seconds S]
                                         [--fail MESSAGE [--after-fail serve|exit|hang]]
    (prints "port N" once it listens)

Model of an engine (one scheduler thread, stepping as vLLM's engine core does):
  * Every step each running sequence gets one token; a step takes `token_seconds`, plus `seq_token_seconds` per
    running sequence (0: the same whatever the batch, an accelerator that is not saturated; above 0: a batch's step
    grows with its size, as a memory-bound decode does), plus `prefill_token_seconds` for every prompt token it had
    to compute this step (those not found in the prefix cache). The clock is the wall clock: a late step is caught
    up.
  * Requests wait in arrival order and are admitted (all n sequences at once) while the running sequences stay within
    `max_batch` and the KV cache — `kv_tokens` tokens (None: unbounded) — holds the prompt and what the request's
    sequences generated so far (the prompt once, shared by its n sequences). A running request's KV grows by a token
    per sequence and step; when the next step would not fit, the request admitted last is preempted (its KV freed,
    back to the front of the queue, recomputed on readmission: vLLM's recompute preemption), as often as needed.
  * Prefix cache (`prefix_cache`, on by default as vLLM's): full blocks of `block_tokens` tokens, keyed by the whole
    prefix they end, are cached when a sequence finishes (prompt and completion) and when a prompt is computed; a
    request's prompt hits the cache for its leading blocks found there (least recently used blocks go first once the
    cache holds `kv_tokens`). Cleared by /reset_prefix_cache, by a load and by a pause, as vLLM clears it.
A sample's length is `min(max_tokens, lognormal(median_tokens, length_sigma))`; a sample shorter than max_tokens ends
with the end-of-text token (finish "stop"). Tokens and lengths are a function of the request's seed and the sample's
index (with a seed; random without), never of the server, so a request re-sent to another simulated engine answers
the same. The log-probability of a token is a fixed function of the token and the loaded weight version.

Faults (`fail`): every /v1/completions answers HTTP 500 with vLLM's error body carrying `fail` as its message, and the
server logs `RuntimeError: <fail>` as an engine that died would; then (`after_fail`) it goes on answering so
(`serve`), exits 0 (`exit`, as a vLLM server whose engine died does) or stops listening while its process lives on
(`hang`: vLLM's API server stuck "waiting for background tasks").

Endpoints: GET /health, /v1/models, /is_paused, /weight_info, /get_world_size, /metrics (vLLM's names:
`vllm:num_requests_running`, `vllm:num_requests_waiting` (sequences), `vllm:kv_cache_usage_perc`,
`vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total` (tokens), `vllm:num_preemptions_total`,
`vllm:prompt_tokens_total`, `vllm:generation_tokens_total`), /sim_stats (its counters: requests served, by weight
label, most sequences at once, loads, prefix hits, preemptions); POST /v1/completions (n, max_tokens,
stop_token_ids, seed, logprobs, return_token_ids), /pause?mode=wait|abort|keep (abort: every request in flight,
running or queued, ends now with finish "abort" and the tokens so far, as vLLM 0.32 does), /resume,
/update_weight_version, /reset_prefix_cache, /collective_rpc with `trainingrun_check_dir` (names and shapes from the
headers, before the pause), `trainingrun_load_dir` (the published files' sizes and SHA-256 checked and every
safetensors header read, as the worker extension does; refusals returned the same way; then `load_seconds`) and `trainingrun_receive_weights` (the worker extension's own receive over torch.distributed,
when torch is there). Standard library only (plus the worker extension's functions); torch only for a broadcast.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import re
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from trainingrun.engines.vllm import worker_ext

EOS = 2
FIRST_TOKEN = 3
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."


@dataclass
class SimConfig:
    token_seconds: float = 0.002
    max_batch: int = 256
    median_tokens: int = 64
    length_sigma: float = 1.0
    load_seconds: float = 0.0
    vocab: int = 512
    model: str = "simulated"
    kv_tokens: int | None = None  # KV-cache capacity in tokens (None: unbounded)
    prefill_token_seconds: float = 0.0  # step time per prompt token computed (not found in the prefix cache)
    seq_token_seconds: float = 0.0  # step time per running sequence
    prefix_cache: bool = True
    block_tokens: int = 16
    fail: str | None = None  # every request fails with this engine error (module docstring)
    after_fail: str = "serve"  # serve | exit | hang


class _Request:
    """One /v1/completions request inside the engine: its sequences' targets, progress and tokens."""

    def __init__(self, prompt: list[int], lengths: list[int], rngs: list[random.Random], stops: set[int],
                 max_tokens: int, label: str):
        self.prompt, self.lengths, self.rngs, self.stops = prompt, lengths, rngs, stops
        self.max_tokens, self.label = max_tokens, label
        self.n = len(lengths)
        self.tokens: list[list[int]] = [[] for _ in lengths]  # generated so far, per sequence
        self.reasons: list[str | None] = [None] * self.n  # per sequence once it ended: stop, length or abort
        self.done = threading.Event()
        self.kv = 0  # tokens of KV cache it holds while running

    @property
    def unfinished(self) -> int:
        return sum(1 for r in self.reasons if r is None)

    def need(self) -> int:
        """KV tokens it holds once admitted: its prompt and every sequence's tokens so far."""
        return len(self.prompt) + sum(len(t) for t in self.tokens)


class SimEngine:
    """The engine state behind the HTTP handler: a scheduler thread stepping the running requests (module docstring)."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.cond = threading.Condition()
        self.waiting: collections.deque[_Request] = collections.deque()  # arrival order (preempted: at the front)
        self.running: list[_Request] = []  # admission order
        self.paused = False
        self.frozen = False  # pause mode keep: no step runs
        self.label = "default"
        self.version_loaded = 0
        self.served = 0
        self.served_by_label: dict[str, int] = {}  # requests answered, by the weight label they were generated under
        self.max_busy = 0  # most sequences decoding at once
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self.failed_requests = 0
        self.loads: list[dict[str, Any]] = []
        self.reference: dict[str, list[int]] | None = None  # tensor shapes of the first directory loaded
        self.blocks: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached prefix blocks (LRU)
        self.on_fail = None  # set by the HTTP server: what `after_fail` does
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="sim-scheduler", daemon=True)
        self._thread.start()

    # ---- requests
    def lengths(self, n: int, max_tokens: int, seed: int | None) -> tuple[list[int], list[random.Random]]:
        rngs = [random.Random(f"{seed}/{j}") if seed is not None else random.Random() for j in range(n)]
        mu = math.log(max(self.cfg.median_tokens, 1))
        lengths = [min(max_tokens, max(1, int(round(r.lognormvariate(mu, self.cfg.length_sigma))))) for r in rngs]
        return lengths, rngs

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        n = int(body.get("n", 1))
        max_tokens = int(body.get("max_tokens", 16))
        seed = body.get("seed")
        stops = set(int(t) for t in body.get("stop_token_ids") or []) | {EOS}
        prompt = [int(t) for t in body.get("prompt") or []]
        lengths, rngs = self.lengths(n, max_tokens, None if seed is None else int(seed))
        with self.cond:
            req = _Request(prompt, lengths, rngs, stops, max_tokens, self.label)
            self.waiting.append(req)
            self.cond.notify_all()
        req.done.wait()
        version = self.version_loaded
        choices = []
        for j, (ids, reason) in enumerate(zip(req.tokens, req.reasons)):
            lps = [-(0.05 + ((t * 31 + version * 7) % 97) / 25.0) for t in ids]
            choices.append({"index": j, "token_ids": ids, "finish_reason": reason,
                            "logprobs": {"token_logprobs": lps}, "text": ""})
        with self.cond:
            self.served += 1
            self.served_by_label[req.label] = self.served_by_label.get(req.label, 0) + 1
        return {"id": "cmpl-sim", "object": "text_completion", "model": self.cfg.model, "choices": choices}

    def _token(self, rng: random.Random, stops: set[int]) -> int:
        while True:
            t = rng.randrange(FIRST_TOKEN, self.cfg.vocab)
            if t not in stops:
                return t

    # ---- the scheduler (called with self.cond held)
    @property
    def busy(self) -> int:
        """Sequences decoding now."""
        return sum(r.unfinished for r in self.running)

    @property
    def kv_used(self) -> int:
        return sum(r.kv for r in self.running)

    def _admit(self) -> int:
        """Admit waiting requests in order while they fit; the prompt tokens computed (not cached)."""
        computed = 0
        busy, kv, cap = self.busy, self.kv_used, self.cfg.kv_tokens
        while self.waiting and not self.paused:
            req = self.waiting[0]
            if busy and busy + req.unfinished > self.cfg.max_batch:
                break
            need = req.need()
            # room for the prompt and a token per sequence (an empty engine admits anything: it must make progress)
            if self.running and cap is not None and kv + need + req.unfinished > cap:
                break
            self.waiting.popleft()
            hits = self._lookup(req.prompt) if self.cfg.prefix_cache else 0
            self.prefix_queries += len(req.prompt)
            self.prefix_hits += hits
            self.prompt_tokens += len(req.prompt)
            computed += need - hits
            self._insert(req.prompt)
            req.kv = need
            self.running.append(req)
            busy, kv = busy + req.unfinished, kv + need
        self.max_busy = max(self.max_busy, busy)
        return computed

    def _preempt(self) -> None:
        """Push back the requests admitted last until the running ones can each take a token."""
        cap = self.cfg.kv_tokens
        if cap is None:
            return
        busy, kv = self.busy, self.kv_used
        while len(self.running) > 1 and kv + busy > cap:
            req = self.running.pop()
            busy, kv = busy - req.unfinished, kv - req.kv
            req.kv = 0
            self.waiting.appendleft(req)
            self.preemptions += 1

    def _step(self) -> None:
        """One token for every running sequence; finished requests answered."""
        for req in list(self.running):
            for j in range(req.n):
                if req.reasons[j] is not None:
                    continue
                ids = req.tokens[j]
                ids.append(self._token(req.rngs[j], req.stops))
                req.kv += 1
                self.generated_tokens += 1
                if len(ids) >= req.lengths[j]:
                    req.reasons[j] = "length" if len(ids) == req.max_tokens else "stop"
                    if req.reasons[j] == "stop":
                        ids[-1] = EOS
                    req.kv -= len(ids)  # its own tokens freed (the shared prompt stays till the last)
                    self._insert(req.prompt + req.tokens[j])
            if not req.unfinished:
                self.running.remove(req)
                req.kv = 0
                req.done.set()

    def _loop(self) -> None:
        next_at = time.monotonic()
        while True:
            with self.cond:
                while not self._stop and (self.frozen or not (self.running or (self.waiting and not self.paused))):
                    self.cond.wait()
                    next_at = time.monotonic()
                if self._stop:
                    return
                computed = self._admit()
                self._preempt()
                batch = self.busy
                self._step()
                self.cond.notify_all()
            next_at += (self.cfg.token_seconds + self.cfg.seq_token_seconds * batch
                        + self.cfg.prefill_token_seconds * computed)
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)

    def close(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()

    # ---- the prefix cache: blocks keyed by a hash of the whole prefix they end
    def _keys(self, tokens: list[int]) -> list[int]:
        b = self.cfg.block_tokens
        return [hash(tuple(tokens[:end])) for end in range(b, len(tokens) + 1, b)]

    def _lookup(self, tokens: list[int]) -> int:
        hits = 0
        for key in self._keys(tokens):
            if key not in self.blocks:
                break
            self.blocks.move_to_end(key)
            hits += self.cfg.block_tokens
        return hits

    def _insert(self, tokens: list[int]) -> None:
        if not self.cfg.prefix_cache:
            return
        for key in self._keys(tokens):
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        if self.cfg.kv_tokens is not None:
            while len(self.blocks) * self.cfg.block_tokens > self.cfg.kv_tokens:
                self.blocks.popitem(last=False)

    def reset_prefix_cache(self) -> None:
        with self.cond:
            self.blocks.clear()

    # ---- what it reports
    def metrics(self) -> str:
        with self.cond:
            kv = self.kv_used / self.cfg.kv_tokens if self.cfg.kv_tokens else 0.0
            values = {
                "vllm:num_requests_running": ("gauge", self.busy),
                "vllm:num_requests_waiting": ("gauge", sum(r.unfinished for r in self.waiting)),
                "vllm:kv_cache_usage_perc": ("gauge", kv),
                "vllm:prefix_cache_queries_total": ("counter", self.prefix_queries),
                "vllm:prefix_cache_hits_total": ("counter", self.prefix_hits),
                "vllm:num_preemptions_total": ("counter", self.preemptions),
                "vllm:prompt_tokens_total": ("counter", self.prompt_tokens),
                "vllm:generation_tokens_total": ("counter", self.generated_tokens),
            }
        labels = f'{{engine="0",model_name="{self.cfg.model}"}}'
        lines = []
        for name, (kind, value) in values.items():
            lines += [f"# TYPE {name.removesuffix('_total')} {kind}", f"{name}{labels} {float(value)}"]
        return "\n".join(lines) + "\n"

    def stats(self) -> dict[str, Any]:
        with self.cond:
            return {"served": self.served, "served_by_label": dict(self.served_by_label), "max_busy": self.max_busy,
                    "generated_tokens": self.generated_tokens, "loads": list(self.loads), "label": self.label,
                    "prefix_queries": self.prefix_queries, "prefix_hits": self.prefix_hits,
                    "preemptions": self.preemptions, "failed_requests": self.failed_requests}

    # ---- control
    def pause(self, mode: str) -> None:
        with self.cond:
            if mode == "abort":  # every request in flight, running or queued, ends now with its tokens so far
                for req in [*self.running, *self.waiting]:
                    req.reasons = [r or "abort" for r in req.reasons]
                    req.kv = 0
                    req.done.set()
                self.running.clear()
                self.waiting.clear()
            self.paused = True
            self.frozen = mode == "keep"
            if mode == "wait":
                while self.running:
                    self.cond.wait(0.05)
            if mode != "keep":
                self.blocks.clear()  # vLLM clears its caches on a pause
            self.cond.notify_all()

    def resume(self) -> None:
        with self.cond:
            self.paused = self.frozen = False
            self.cond.notify_all()

    def rpc(self, method: str, kwargs: dict[str, Any]) -> list[Any]:
        if method == "trainingrun_check_dir":
            return [self._check_dir(str(kwargs["path"]))]
        if method == "trainingrun_load_dir":
            return [self._load_dir(str(kwargs["path"]), kwargs.get("files"))]
        if method == "trainingrun_receive_weights":
            return [self._receive(json.loads(kwargs["request"]))]
        raise ValueError(f"unknown method {method!r}")

    def fail_request(self) -> str:
        """A request while `fail` is set: the engine's error, logged as an engine that died logs it."""
        with self.cond:
            self.failed_requests += 1
        cause = self.cfg.fail or ""
        line = cause if re.match(r"\w+(Error|Exception): ", cause) else f"RuntimeError: {cause}"
        print(f"ERROR [simulated] EngineCore encountered a fatal error.\nTraceback (most recent call last):\n"
              f"  File \"simulated.py\", in step\n{line}", file=sys.stderr, flush=True)
        return self.cfg.fail or ""

    def _check_dir(self, path: str) -> dict[str, Any]:
        """The worker extension's pre-load check: the directory's tensor names and shapes against the model's (the
        first directory loaded), from the headers."""
        try:
            shapes = worker_ext.dir_shapes(Path(path))
            if self.reference is not None:
                worker_ext.check_shapes(shapes, self.reference, path)
        except (OSError, ValueError) as exc:
            return {"refused": f"{type(exc).__name__}: {exc}", "path": path}
        return {"path": path, "tensors": len(shapes)}

    def _load_dir(self, path: str, files: str | None) -> dict[str, Any]:
        t0 = time.perf_counter()
        directory = Path(path)
        try:
            if files:
                worker_ext.check_digests(directory, json.loads(files))
            found = worker_ext.safetensors_files(directory)
            if not found:
                raise FileNotFoundError(f"{directory}: no *.safetensors weights")
            shapes: dict[str, list[int]] = {}
            for f in found:
                shapes.update(worker_ext.read_header(f))
            if self.reference is None:
                self.reference = shapes
            elif shapes != self.reference:
                raise ValueError(f"{directory}: not this model's weights (tensor names or shapes differ)")
        except Exception as exc:  # noqa: BLE001 - a refusal, returned as the worker extension does
            return {"refused": f"{type(exc).__name__}: {exc}", "path": path}
        time.sleep(self.cfg.load_seconds)
        nbytes = sum(f.stat().st_size for f in found)
        self.loads.append({"path": path, "bytes": nbytes})
        return {"path": path, "bytes": nbytes, "tensors": len(shapes), "read_seconds": time.perf_counter() - t0,
                "load_seconds": self.cfg.load_seconds}

    def _receive(self, req: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        manifest, named, store = worker_ext.receive(req, rank=1, device="cpu")
        time.sleep(self.cfg.load_seconds)
        store.set(manifest["done_key"], "ok")
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        self.loads.append({"version": manifest["version"], "bytes": nbytes,
                           "transfer": (manifest.get("transfer") or {}).get("group", req["group"])})
        return {"version": manifest["version"], "bytes": nbytes, "tensors": len(named),
                "receive_seconds": time.perf_counter() - t0, "load_seconds": self.cfg.load_seconds}


class _Handler(BaseHTTPRequestHandler):
    engine: SimEngine  # set on the class made per server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args) -> None:  # one line per request, like vLLM's access log
        if getattr(self.server, "log", None) is not None:
            self.server.log.write(f"{self.address_string()} - {fmt % args}\n")
            self.server.log.flush()

    def _reply(self, code: int, payload: Any) -> None:
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        size = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(size) or b"{}") if size else {}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        e = self.engine
        path = urlparse(self.path).path
        if path == "/health":
            self._reply(200, {})
        elif path == "/v1/models":
            self._reply(200, {"data": [{"id": e.cfg.model}]})
        elif path == "/is_paused":
            self._reply(200, {"is_paused": e.paused})
        elif path == "/weight_info":
            self._reply(200, {"weight_version": e.label})
        elif path == "/get_world_size":
            self._reply(200, {"world_size": 1})
        elif path == "/metrics":  # Prometheus text, vLLM's names
            self._reply(200, e.metrics())
        elif path == "/sim_stats":  # the simulator's own counters (tests, benchmarks)
            self._reply(200, e.stats())
        else:
            self._reply(404, {"error": f"no route {path}"})

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        e = self.engine
        url = urlparse(self.path)
        try:
            body = self._body()
            if url.path == "/v1/completions" and e.cfg.fail is not None:  # a broken engine (module docstring)
                cause = e.fail_request()  # logged as the engine's root cause
                message = cause if e.cfg.after_fail == "serve" else ENGINE_DEAD  # vLLM: its engine died
                self._reply(500, {"error": {"message": message, "type": "InternalServerError", "param": None,
                                            "code": 500}})
                self.server.broken()
            elif url.path == "/v1/completions":
                self._reply(200, e.complete(body))
            elif url.path == "/pause":
                e.pause(parse_qs(url.query).get("mode", ["abort"])[0])
                self._reply(200, {"status": "paused"})
            elif url.path == "/resume":
                e.resume()
                self._reply(200, {"status": "resumed"})
            elif url.path == "/update_weight_version":
                e.label = str(body["new_version"])
                digits = "".join(ch for ch in e.label if ch.isdigit())
                e.version_loaded = int(digits) if digits and not e.label.startswith("loading:") else e.version_loaded
                self._reply(200, {"weight_version": e.label})
            elif url.path == "/reset_prefix_cache":
                e.reset_prefix_cache()
                self._reply(200, {"success": True})
            elif url.path == "/collective_rpc":
                self._reply(200, {"results": e.rpc(body["method"], body.get("kwargs") or {})})
            else:
                self._reply(404, {"error": f"no route {url.path}"})
        except Exception as exc:  # noqa: BLE001 - a 500, like vLLM's
            self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # a rollout keeps hundreds of requests in flight
    daemon_threads = True
    log = None
    after_fail = "serve"
    hung = False

    def broken(self) -> None:
        """After a failed request (`after_fail`): exit 0 (exit) or stop listening with the process alive (hang)."""
        if self.after_fail == "exit":
            threading.Timer(0.2, os._exit, args=(0,)).start()
        elif self.after_fail == "hang" and not self.hung:
            self.hung = True
            threading.Thread(target=lambda: (self.shutdown(), self.server_close()), daemon=True).start()


class SimulatedServer:
    """A simulated engine serving on 127.0.0.1 in a background thread of this process (tests); `main` runs one as a
    process of its own (benchmarks, and tests that kill or stop it)."""

    def __init__(self, cfg: SimConfig | None = None, *, port: int = 0, log_path: str | Path | None = None):
        self.engine = SimEngine(cfg or SimConfig())
        handler = type("Handler", (_Handler,), {"engine": self.engine})
        self.httpd = _Server(("127.0.0.1", port), handler)
        self.httpd.log = open(log_path, "a") if log_path else None
        self.httpd.after_fail = self.engine.cfg.after_fail
        self.thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SimulatedServer:
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="simulated-vllm", daemon=True)
        self.thread.start()
        return self

    def close(self) -> None:
        if not self.httpd.hung:
            self.httpd.shutdown()
            self.httpd.server_close()
        self.engine.close()
        if self.httpd.log is not None:
            self.httpd.log.close()

    def __enter__(self) -> SimulatedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="A simulated vLLM server (trainingrun.engines.simulated).")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--token-seconds", type=float, default=SimConfig.token_seconds)
    ap.add_argument("--max-batch", type=int, default=SimConfig.max_batch)
    ap.add_argument("--median-tokens", type=int, default=SimConfig.median_tokens)
    ap.add_argument("--length-sigma", type=float, default=SimConfig.length_sigma)
    ap.add_argument("--load-seconds", type=float, default=SimConfig.load_seconds)
    ap.add_argument("--vocab", type=int, default=SimConfig.vocab)
    ap.add_argument("--kv-tokens", type=int, default=None, help="KV-cache capacity in tokens (default: unbounded)")
    ap.add_argument("--prefill-token-seconds", type=float, default=SimConfig.prefill_token_seconds)
    ap.add_argument("--seq-token-seconds", type=float, default=SimConfig.seq_token_seconds)
    ap.add_argument("--prefix-cache", type=int, choices=(0, 1), default=1)
    ap.add_argument("--fail", default=None, help="every request fails with this engine error")
    ap.add_argument("--after-fail", choices=("serve", "exit", "hang"), default="serve")
    ap.add_argument("--log", default=None, help="append one line per request to this file")
    a = ap.parse_args(argv)
    cfg = SimConfig(token_seconds=a.token_seconds, max_batch=a.max_batch, median_tokens=a.median_tokens,
                    length_sigma=a.length_sigma, load_seconds=a.load_seconds, vocab=a.vocab, kv_tokens=a.kv_tokens,
                    prefill_token_seconds=a.prefill_token_seconds, seq_token_seconds=a.seq_token_seconds,
                    prefix_cache=bool(a.prefix_cache), fail=a.fail,
                    after_fail=a.after_fail)
    server = SimulatedServer(cfg, port=a.port, log_path=a.log)
    print(f"port {server.port}", flush=True)
    try:
        server.httpd.serve_forever()
        while server.httpd.hung:  # stopped listening, the process lives on (after_fail hang)
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
