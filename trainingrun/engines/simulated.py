"""A simulated vLLM server: the part of vLLM's HTTP API the rollout uses, with no model behind it.

It answers `/v1/completions` after a configurable time per generated token, with completion lengths drawn from a
long-tailed (log-normal) distribution, so the rollout's own scheduling — the pool's dispatch, over-sampling with
abort, partial rollouts, weight sync to several engines, a dead or stalled engine — can be tested in seconds and
measured on a small CPU machine (benchmarks/rl_loop.py `--engine sim`). The rollout reaches it through the same
client as a real server (`trainingrun.engines.vllm.client`).

    python -m trainingrun.engines.simulated --port 0 [--token-seconds 0.002] [--max-batch 256] [--median-tokens 64]
                                         [--length-sigma 1.0] [--load-seconds 0] [--vocab 512]
    (prints "port N" once it listens)

Model of an engine: up to `max_batch` sequences decode at once, each taking `token_seconds` per token whatever the
batch (continuous batching on an accelerator that is not saturated); a request whose n sequences do not fit waits,
in arrival order. A sample's length is `min(max_tokens, lognormal(median_tokens, length_sigma))`; a sample shorter
than max_tokens ends with the end-of-text token (finish "stop"). Tokens and lengths are a function of the request's
seed and the sample's index (with a seed; random without), never of the server, so a request re-sent to another
simulated engine answers the same. The log-probability of a token is a fixed function of the token and the loaded
weight version.

Endpoints: GET /health, /v1/models, /is_paused, /weight_info, /get_world_size, /sim_stats (its counters: requests
served, by weight label, most sequences at once, loads); POST /v1/completions (n, max_tokens,
stop_token_ids, seed, logprobs, return_token_ids), /pause?mode=wait|abort|keep (abort: every sequence in flight ends
now with finish "abort" and the tokens so far, as vLLM 0.32 does), /resume, /update_weight_version,
/reset_prefix_cache, /collective_rpc with `trainingrun_load_dir` (the published files' sizes and SHA-256 checked and
every safetensors header read, as the worker extension does; refusals returned the same way; then `load_seconds`)
and `trainingrun_receive_weights` (the worker extension's own receive over torch.distributed, when torch is there).
Standard library only (plus the worker extension's functions); torch only for a broadcast.
"""

from __future__ import annotations

import argparse
import json
import math
import random
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


@dataclass
class SimConfig:
    token_seconds: float = 0.002
    max_batch: int = 256
    median_tokens: int = 64
    length_sigma: float = 1.0
    load_seconds: float = 0.0
    vocab: int = 512
    model: str = "simulated"


class _Active:
    """One request being generated: its clock and the abort epoch it started in."""

    def __init__(self, epoch: int):
        self.epoch = epoch
        self.wake = threading.Event()


class SimEngine:
    """The engine state behind the HTTP handler."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.cond = threading.Condition()
        self.busy = 0  # sequences decoding
        self.queue: list[int] = []  # tickets waiting for room, in arrival order
        self.tickets = 0
        self.paused = False
        self.abort_epoch = 0
        self.active: set[_Active] = set()
        self.label = "default"
        self.version_loaded = 0
        self.served = 0
        self.served_by_label: dict[str, int] = {}  # requests answered, by the weight label they were generated under
        self.max_busy = 0  # most sequences decoding at once
        self.generated_tokens = 0
        self.loads: list[dict[str, Any]] = []
        self.reference: dict[str, list[int]] | None = None  # tensor shapes of the first directory loaded

    # ---- generation
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
        lengths, rngs = self.lengths(n, max_tokens, None if seed is None else int(seed))
        me = self._admit(n)
        label = self.label  # the weights it is generated with
        try:
            t0 = time.monotonic()
            ends = sorted(set(lengths))
            cut_at: int | None = None
            done = 0
            for end in ends:
                while True:
                    if me.epoch != self.abort_epoch:
                        cut_at = int((time.monotonic() - t0) / self.cfg.token_seconds)
                        break
                    left = t0 + end * self.cfg.token_seconds - time.monotonic()
                    if left <= 0:
                        break
                    me.wake.wait(left)
                    me.wake.clear()
                if cut_at is not None:
                    break
                finished = sum(1 for x in lengths if x == end)
                done += finished
                self._release(finished)
            self._release(n - done)
        finally:
            with self.cond:
                self.active.discard(me)
        choices = []
        version = self.version_loaded
        for j, (length, rng) in enumerate(zip(lengths, rngs)):
            m = length if cut_at is None else min(length, cut_at)
            ids = [self._token(rng, stops) for _ in range(m)]
            if cut_at is None or length <= cut_at:
                reason = "length" if length == max_tokens else "stop"
                if reason == "stop" and ids:
                    ids[-1] = EOS
            else:
                reason = "abort"
            lps = [-(0.05 + ((t * 31 + version * 7) % 97) / 25.0) for t in ids]
            choices.append({"index": j, "token_ids": ids, "finish_reason": reason,
                            "logprobs": {"token_logprobs": lps}, "text": ""})
        with self.cond:
            self.served += 1
            self.served_by_label[label] = self.served_by_label.get(label, 0) + 1
            self.generated_tokens += sum(len(c["token_ids"]) for c in choices)
        return {"id": "cmpl-sim", "object": "text_completion", "model": self.cfg.model, "choices": choices}

    def _token(self, rng: random.Random, stops: set[int]) -> int:
        while True:
            t = rng.randrange(FIRST_TOKEN, self.cfg.vocab)
            if t not in stops:
                return t

    def _admit(self, n: int) -> _Active:
        """Wait (in arrival order) until n more sequences fit and the engine is not paused."""
        with self.cond:
            ticket = self.tickets
            self.tickets += 1
            self.queue.append(ticket)
            while (self.paused or self.queue[0] != ticket
                   or (self.busy and self.busy + n > self.cfg.max_batch)):
                self.cond.wait()
            self.queue.pop(0)
            self.busy += n
            self.max_busy = max(self.max_busy, self.busy)
            me = _Active(self.abort_epoch)
            self.active.add(me)
            self.cond.notify_all()
            return me

    def _release(self, n: int) -> None:
        if n:
            with self.cond:
                self.busy -= n
                self.cond.notify_all()

    # ---- control
    def pause(self, mode: str) -> None:
        with self.cond:
            if mode == "abort":
                self.abort_epoch += 1
                for a in self.active:
                    a.wake.set()
            self.paused = True
            if mode == "wait":
                while self.active:
                    self.cond.wait(0.05)
            self.cond.notify_all()

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def rpc(self, method: str, kwargs: dict[str, Any]) -> list[Any]:
        if method == "trainingrun_load_dir":
            return [self._load_dir(str(kwargs["path"]), kwargs.get("files"))]
        if method == "trainingrun_receive_weights":
            return [self._receive(json.loads(kwargs["request"]))]
        raise ValueError(f"unknown method {method!r}")

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
        store.set(worker_ext.DONE_KEY.format(group=req["group"], rank=1), "ok")
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        self.loads.append({"version": manifest["version"], "bytes": nbytes})
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
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
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
        elif path == "/sim_stats":  # the simulator's own counters (tests, benchmarks)
            self._reply(200, {"served": e.served, "served_by_label": e.served_by_label, "max_busy": e.max_busy,
                              "generated_tokens": e.generated_tokens, "loads": e.loads, "label": e.label})
        else:
            self._reply(404, {"error": f"no route {path}"})

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        e = self.engine
        url = urlparse(self.path)
        try:
            body = self._body()
            if url.path == "/v1/completions":
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


class SimulatedServer:
    """A simulated engine serving on 127.0.0.1 in a background thread of this process (tests); `main` runs one as a
    process of its own (benchmarks, and tests that kill or stop it)."""

    def __init__(self, cfg: SimConfig | None = None, *, port: int = 0, log_path: str | Path | None = None):
        self.engine = SimEngine(cfg or SimConfig())
        handler = type("Handler", (_Handler,), {"engine": self.engine})
        self.httpd = _Server(("127.0.0.1", port), handler)
        self.httpd.log = open(log_path, "a") if log_path else None
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
        self.httpd.shutdown()
        self.httpd.server_close()
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
    ap.add_argument("--log", default=None, help="append one line per request to this file")
    a = ap.parse_args(argv)
    cfg = SimConfig(token_seconds=a.token_seconds, max_batch=a.max_batch, median_tokens=a.median_tokens,
                    length_sigma=a.length_sigma, load_seconds=a.load_seconds, vocab=a.vocab)
    server = SimulatedServer(cfg, port=a.port, log_path=a.log)
    print(f"port {server.port}", flush=True)
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
