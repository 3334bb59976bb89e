"""Rewards served over HTTP: a reward service of the user's own (`reward.type: remote`) and an LLM judge behind an
OpenAI-compatible chat endpoint (`reward.type: judge`). Standard library only (urllib), a bounded thread pool.

    remote   POST url  {"samples": [{"prompt", "prompt_tokens", "response", "response_tokens", "reference", "meta"},
                                    ...]}                      (batchSize samples per request; text fields null where
                                                                the task has no text)
             answer    {"rewards": [float, ...]}               (one per sample, in the same order)
    judge    POST <url>/chat/completions  {"model", "messages": [{"role": "user", "content": template filled with the
             sample's prompt, response, reference}], "max_tokens", "temperature"}   (one request per sample; a url
             that already ends in /chat/completions is used as it is)
             answer    {"choices": [{"message": {"content": TEXT}}]}: the reward is float(first group of `pattern`
                       searched in TEXT) / scale; TEXT is kept (`Verdict.raw`) for inspection

At most `concurrency` requests are in flight (one thread pool per reward, shared by every batch). Each try of a request
gets `timeoutSeconds` (connecting, sending and the whole answer; a service that trickles its answer is cut when the
time is up). A request answered 5xx, or whose connection failed (refused, reset, closed without an answer), is tried
again up to `retries` times after 0.25 s, 0.5 s, 1 s, ... (at most 8 s); a 4xx answer and a timeout are not. What
cannot be scored fails its samples, with a reason (the rollout counts them, gives them failedReward and goes on):

    http         the service answered an error status (4xx; 5xx after the retries)
    unreachable  no answer: the connection was refused, reset or closed (after the retries)
    timeout      no complete answer within timeoutSeconds
    invalid      an answer that breaks the contract: not JSON, no list `rewards`, another number of rewards than
                 samples, a judge answer without choices or that `pattern` does not match
    nan          a reward that is not a finite number (NaN, infinity, a string, null, a boolean)

Request headers (`headers`: name → Secret key) carry values from the environment (`resolve_headers`; the variable is
`api.spec.rollout.header_env(place, name)`): never from the spec, and never written to a log or a message.

This module knows samples as the JSON objects of `rollout.rewards.RewardSample.to_json`; `rollout/rewards.py` holds
the table entries that use it.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from trainingrun.api.spec.rollout import header_env
from trainingrun.contract.errors import ConfigError

SAMPLE_FIELDS = ("prompt", "prompt_tokens", "response", "response_tokens", "reference", "meta")
RETRY_FIRST_SECONDS = 0.25
RETRY_MAX_SECONDS = 8.0
MAX_ANSWER_BYTES = 64 << 20
SERVICE_REASONS = ("http", "unreachable", "timeout", "invalid", "nan")


@dataclass(frozen=True)
class Verdict:
    """One sample's outcome: its reward, or why it failed (`reason`, module docstring); `raw` the judge's answer."""

    value: float | None
    reason: str | None = None
    message: str = ""
    raw: str | None = None


class ServiceFailure(Exception):
    """A request that failed for good (after its retries): `reason` as in the module docstring."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


class _Retryable(ServiceFailure):
    """5xx or a failed connection: tried again while retries are left."""


def retry_delay(attempt: int) -> float:
    """Seconds before retry `attempt` (0 first): 0.25, 0.5, 1, ... at most RETRY_MAX_SECONDS."""
    return min(RETRY_FIRST_SECONDS * 2 ** attempt, RETRY_MAX_SECONDS)


def resolve_headers(headers: Mapping[str, Any], place: str, environ: Mapping[str, str] | None = None,
                    *, field_path: str) -> dict[str, str]:
    """Header name → its value from the environment variable `header_env(place, name)`. A variable that is not set
    is a ConfigError naming the field, the header, the variable and the Secret key it comes from in a cluster."""
    env = os.environ if environ is None else environ
    out = {}
    for name, secret in headers.items():
        var = header_env(place, name)
        value = env.get(var)
        if not value:
            ref = secret if isinstance(secret, Mapping) else {}
            raise ConfigError(f"{field_path}.headers.{name}: environment variable {var} is not set (in a cluster "
                              f"the operator sets it from Secret {ref.get('name')!r} key {ref.get('key')!r}; locally "
                              "set it in the launcher's environment)")
        out[name] = value
    return out


@dataclass
class Service:
    """Where and how to send requests (module docstring); `headers` hold secret values: never print them."""

    url: str
    timeout: float
    retries: int = 2
    concurrency: int = 4
    headers: dict[str, str] = field(default_factory=dict, repr=False)
    sleep: Callable[[float], None] = time.sleep

    def post(self, body: Any, *, url: str | None = None) -> Any:
        """POST `body` as JSON and return the parsed answer; ServiceFailure when it fails for good."""
        try:
            data = json.dumps(body, default=str, allow_nan=False).encode()
        except ValueError as exc:  # a NaN in a sample's meta or reference: JSON has no NaN
            raise ServiceFailure("invalid", f"the request cannot be written as JSON: {exc}") from None
        target = url or self.url
        for attempt in range(self.retries + 1):
            try:
                return _post_once(target, data, self.headers, self.timeout)
            except _Retryable as exc:
                if attempt == self.retries:
                    tries = f" (after {self.retries + 1} tries)" if self.retries else ""
                    raise ServiceFailure(exc.reason, exc.message + tries) from None
                self.sleep(retry_delay(attempt))
        raise AssertionError("unreachable")  # pragma: no cover


def _post_once(url: str, data: bytes, headers: Mapping[str, str], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={**headers, "Content-Type": "application/json", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = _read(resp, deadline)
    except urllib.error.HTTPError as exc:
        try:
            detail = exc.read(500).decode(errors="replace")
        except (OSError, http.client.HTTPException):
            detail = ""
        for value in headers.values():  # a service that echoes a header back: its value never reaches a log
            detail = detail.replace(value, "***")
        message = f"POST {url}: HTTP {exc.code}" + (f": {detail.strip()[:300]}" if detail.strip() else "")
        if exc.code >= 500:
            raise _Retryable("http", message) from None
        raise ServiceFailure("http", message) from None
    except TimeoutError:
        raise ServiceFailure("timeout", f"POST {url}: no answer within {timeout:g}s") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise ServiceFailure("timeout", f"POST {url}: no answer within {timeout:g}s") from None
        raise _Retryable("unreachable", f"POST {url}: {exc.reason}") from None
    except (ConnectionError, http.client.HTTPException, OSError) as exc:
        raise _Retryable("unreachable", f"POST {url}: connection failed: {type(exc).__name__}: {exc}") from None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ServiceFailure("invalid", f"POST {url}: the answer is not JSON: {raw[:120]!r}") from None


def _read(resp, deadline: float) -> bytes:
    """The whole answer, cut (timeout) once `deadline` passes and refused (invalid) beyond MAX_ANSWER_BYTES."""
    chunks, size = [], 0
    read = getattr(resp, "read1", resp.read)  # read1: what has arrived (read(n) would wait for all n bytes)
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError
        try:
            chunk = read(1 << 16)
        except socket.timeout:
            raise TimeoutError from None
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise ServiceFailure("invalid", f"the answer is larger than {MAX_ANSWER_BYTES >> 20} MiB")
        chunks.append(chunk)


def finite(value: Any) -> float | None:
    """`value` as a float when it is a finite number (not a boolean), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    x = float(value)
    return x if math.isfinite(x) else None


class _Pooled:
    """A bounded thread pool, made on first use, shut down by `close` (a hung request's thread ends with its
    socket's timeout)."""

    def __init__(self, service: Service, name: str):
        self.service = service
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.service.concurrency, thread_name_prefix=self.name)
            return self._pool

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None


class RemoteReward(_Pooled):
    """`reward.type: remote`: batches of `batch_size` samples, one request each (module docstring)."""

    def __init__(self, service: Service, batch_size: int):
        super().__init__(service, "reward-remote")
        self.batch_size = batch_size

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> list[Verdict]:
        batches = [samples[i:i + self.batch_size] for i in range(0, len(samples), self.batch_size)]
        futures = [self.pool().submit(self.score_batch, b) for b in batches]
        return [v for f in futures for v in f.result()]

    def score_batch(self, batch: Sequence[Mapping[str, Any]]) -> list[Verdict]:
        body = {"samples": [{k: s.get(k) for k in SAMPLE_FIELDS} for s in batch]}
        try:
            answer = self.service.post(body)
        except ServiceFailure as exc:
            return [Verdict(None, exc.reason, exc.message)] * len(batch)
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list):
            got = f"keys {sorted(answer)[:5]}" if isinstance(answer, dict) else type(answer).__name__
            return [Verdict(None, "invalid", f"the answer has no list 'rewards' ({got})")] * len(batch)
        if len(rewards) != len(batch):
            return [Verdict(None, "invalid", f"the answer has {len(rewards)} rewards for {len(batch)} samples")] \
                * len(batch)
        out = []
        for r in rewards:
            x = finite(r)
            out.append(Verdict(x) if x is not None
                       else Verdict(None, "nan", f"reward {r!r:.40} is not a finite number"))
        return out


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return json.dumps(value, default=str)


def chat_url(url: str) -> str:
    """The chat endpoint of an OpenAI-compatible base URL (…/v1 → …/v1/chat/completions)."""
    url = url.rstrip("/")
    return url if url.endswith("/chat/completions") else url + "/chat/completions"


class JudgeReward(_Pooled):
    """`reward.type: judge`: one chat completion per sample (module docstring)."""

    def __init__(self, service: Service, *, model: str, template: str, pattern: str, scale: float,
                 max_tokens: int, temperature: float):
        super().__init__(service, "reward-judge")
        self.url = chat_url(service.url)
        self.model, self.template, self.scale = model, template, scale
        self.pattern = re.compile(pattern)
        self.max_tokens, self.temperature = max_tokens, temperature

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> list[Verdict]:
        return list(self.pool().map(self.score_one, samples))

    def message(self, sample: Mapping[str, Any]) -> str:
        prompt = sample.get("prompt")
        return self.template.format(prompt=_text(prompt if prompt is not None else sample.get("prompt_tokens")),
                                    response=_text(sample.get("response")), reference=_text(sample.get("reference")))

    def score_one(self, sample: Mapping[str, Any]) -> Verdict:
        body = {"model": self.model, "messages": [{"role": "user", "content": self.message(sample)}],
                "max_tokens": self.max_tokens, "temperature": self.temperature}
        try:
            answer = self.service.post(body, url=self.url)
        except ServiceFailure as exc:
            return Verdict(None, exc.reason, exc.message)
        try:
            text = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            return Verdict(None, "invalid", f"the judge's answer has no choices[0].message.content: {answer!r:.120}")
        if not isinstance(text, str):
            return Verdict(None, "invalid", f"the judge's content is {type(text).__name__}, not text")
        m = self.pattern.search(text)
        if m is None:
            return Verdict(None, "invalid", f"the judge's answer does not match pattern {self.pattern.pattern!r}: "
                                            f"{text[-160:]!r}", raw=text)
        try:
            score = float(m.group(1))
        except (TypeError, ValueError):
            return Verdict(None, "invalid", f"pattern group 1 is {m.group(1)!r}, not a number", raw=text)
        if not math.isfinite(score):
            return Verdict(None, "nan", f"the judge's score {m.group(1)!r} is not a finite number", raw=text)
        return Verdict(score / self.scale, raw=text)
