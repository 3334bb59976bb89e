"""Loading new weights into a running vLLM server: from an HF directory (`disk`) or from trainer rank 0 (`broadcast`).

Both follow one sequence, driven by the rollout between its generate calls:
  label "loading:<label>"  →  POST /pause?mode=wait (in-flight requests finish)  →  load  →  POST /reset_prefix_cache
  (cached prefixes were computed with the old weights)  →  label "<label>"  →  POST /resume
The engine's weight-version label (`/update_weight_version`, `/weight_info`) is what makes "never half-applied"
checkable: it names a version only after that version loaded completely. A load that fails or is interrupted leaves
"loading:..." (or, when the server restarts, vLLM's "default"), and the rollout's engine refuses to generate until a
load succeeds (the pool: `trainingrun.engines.pool`, its label `LOADING`).

disk:      first `collective_rpc("trainingrun_check_dir", path=DIR)` — the files' headers against the model's tensor
           names and shapes, before the label and the pause: a version that does not fit is refused while the engine
           keeps generating; then `collective_rpc("trainingrun_load_dir", path=DIR, files=...)` — the worker
           extension checks the published files' sizes and SHA-256 (`files`, from the version's meta), reads the
           whole directory (safetensors, HF checkpoint names), checks names and shapes, then calls vLLM's
           `reload_weights` with the tensors, which shards and repacks them. Not vLLM's `reload_weights(weights_path=DIR)` directly: that one
           replaces weights while reading, so a missing or unreadable directory leaves the model half-replaced and
           the engine dead (vLLM 0.32.0). The trainer writes the directory beside its final name and renames it
           into place, so a complete name is a complete directory.
broadcast: `collective_rpc("trainingrun_receive_weights", request=...)` — the worker extension joins a process group
           with trainer rank 0, receives every bucket, and only then applies them (`worker_ext.py`).
lora:      (a LoRA run; the server was started with --enable-lora) the version is a PEFT adapter directory:
           `collective_rpc("trainingrun_check_files", path=DIR, files=...)` checks its files' sizes and SHA-256
           first (refused while the engine keeps generating), then label "loading:<label>" → `/v1/load_lora_adapter`
           (name: the version's `adapter_name`) → label "<label>" → `/v1/unload_lora_adapter` of the versions no
           longer kept. No pause and no prefix-cache reset: a request names the adapter it generates with (its
           `model`), so a request in flight keeps its version's adapter and nothing is ever half-applied; vLLM's
           prefix cache is kept per adapter.

A refusal by the extension (damaged or foreign weights) raises `WeightsRefused` naming the directory (or version)
and the reason. The HTTP wait of a load is bounded a little above the worker's own bound (connect + transfer), so a
load that cannot finish fails here instead of blocking the rollout; vLLM's collective_rpc timeout is never used.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from trainingrun.contract.engine import EngineError, WeightsRefused
from trainingrun.engines.pool import LOADING
from trainingrun.engines.vllm.client import VLLMClient
from trainingrun.engines.vllm.worker_ext import CONNECT_TIMEOUT

__all__ = ["HTTP_MARGIN", "LOADING", "load_adapter", "load_from_broadcast", "load_from_disk"]
HTTP_MARGIN = 30.0  # the rollout waits this much longer than the worker's own bound before it gives up


def _refusals(results: list[Any]) -> list[str]:
    return [str(r["refused"]) for r in results if isinstance(r, dict) and "refused" in r]


def _apply(client: VLLMClient, marker: str, load: Callable[[], dict[str, Any]],
           label: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    client.set_weight_version(LOADING + marker)
    client.pause("wait")
    try:
        t1 = time.perf_counter()
        result = load()
        t2 = time.perf_counter()
        client.reset_prefix_cache()
        result["label"] = label(result)
        client.set_weight_version(result["label"])
    finally:
        client.resume()
    return {"load_seconds": t2 - t1, "total_seconds": time.perf_counter() - t0, **result}


def load_from_disk(client: VLLMClient, path: str, label: str, *, timeout: float = 600,
                   files: dict[str, list] | None = None) -> dict[str, Any]:
    """Load the HF directory `path` (its weight files checked against `files`: {name: [bytes, sha256]}, when given)
    and label the engine `label`; raises (label left "loading:...") on failure, `WeightsRefused` when the engine
    refused the directory."""
    kwargs = {"path": path, **({"files": json.dumps(files)} if files else {})}
    # names and shapes first, while the engine generates: a version that does not fit is refused before the pause
    refused = _refusals(client.collective_rpc("trainingrun_check_dir", {"path": path}, timeout=timeout + HTTP_MARGIN))
    if refused:
        raise WeightsRefused(path, refused[0])

    def load() -> dict[str, Any]:
        results = client.collective_rpc("trainingrun_load_dir", kwargs, timeout=timeout + HTTP_MARGIN)
        refused = _refusals(results)
        if refused:
            raise WeightsRefused(path, refused[0])
        return {"path": path, "results": results}

    return _apply(client, label, load, lambda _: label)


def load_from_broadcast(client: VLLMClient, *, host: str, port: int, group: str, label: Callable[[int], str],
                        backend: str = "gloo", timeout: float = 300, version: int | None = None,
                        connect_timeout: float = CONNECT_TIMEOUT,
                        joint: dict[str, Any] | None = None) -> dict[str, Any]:
    """Receive weight `version` (None: the newest the sender holds) from trainer rank 0 at host:port
    (`BroadcastSender`); the engine is labelled `label(version received)`. The worker gives up on a sender it
    cannot reach within `connect_timeout` seconds and on a transfer not done `timeout` seconds after that.
    `joint` ({"id", "members"}: the pool's sync of this version to `members` engines) lets the sender serve the
    engines of one sync in one transfer (`BroadcastSender._gather`)."""
    world = 1 + client.world_size()
    connect_timeout = min(connect_timeout, timeout)
    request = json.dumps({"host": host, "port": int(port), "group": group, "world_size": world,
                          "backend": backend, "timeout": timeout, "connect_timeout": connect_timeout,
                          "version": version, "joint": joint})

    def load() -> dict[str, Any]:
        results = client.collective_rpc("trainingrun_receive_weights", {"request": request},
                                        timeout=connect_timeout + timeout + HTTP_MARGIN)
        refused = _refusals(results)
        if refused:
            raise WeightsRefused(f"version {version} from {host}:{port}", refused[0])
        versions = {r.get("version") for r in results if isinstance(r, dict)}
        if len(versions) != 1 or len(results) != world - 1:
            raise RuntimeError(f"broadcast weight load: unexpected worker results {results}")
        return {"version": int(versions.pop()), "results": results}

    return _apply(client, group, load, lambda r: label(r["version"]))


def load_adapter(client: VLLMClient, path: str, name: str, label: str, *, timeout: float = 600,
                 files: dict[str, list] | None = None, unload: list[str] = ()) -> dict[str, Any]:
    """Serve the PEFT adapter directory `path` (its files checked against `files` when given) as model `name`, label
    the engine `label`, then unload the adapters named in `unload` (an adapter already gone is no error); raises
    (label left "loading:...") on failure, `WeightsRefused` when the engine refused the directory (module
    docstring, "lora")."""
    if files:
        results = client.collective_rpc("trainingrun_check_files", {"path": path, "files": json.dumps(files)},
                                         timeout=timeout + HTTP_MARGIN)
        refused = _refusals(results)
        if refused:
            raise WeightsRefused(path, refused[0])
    t0 = time.perf_counter()
    client.set_weight_version(LOADING + label)
    try:
        client.load_lora_adapter(name, path, timeout=timeout + HTTP_MARGIN)
    except EngineError as exc:
        if "already been loaded" not in str(exc):  # loaded before (a retried load): serve it
            raise
    t1 = time.perf_counter()
    client.set_weight_version(label)
    unloaded = []
    for old in unload:
        try:
            client.unload_lora_adapter(old, timeout=timeout + HTTP_MARGIN)
            unloaded.append(old)
        except EngineError:  # not loaded there (a restarted server): nothing to free
            pass
    return {"path": path, "adapter": name, "label": label, "unloaded": unloaded, "load_seconds": t1 - t0,
            "total_seconds": time.perf_counter() - t0}
