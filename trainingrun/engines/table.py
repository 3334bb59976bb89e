"""The engine table: `rollout.engine.type` → everything the run needs of that engine type, one `EngineType` each.

  build         (spec, store, arch) → the rollout's `Engine` (trainingrun/contract/engine.py), fetching weight
                versions through the run's weight sync
  publishers    weightSync.type → the trainer-side publisher factory (spec, store, *, arch, rank, attempt) →
                `trainingrun.trainer.weights.WeightPublisher`: the weight syncs that reach this engine
  servers       `Servers`, for an engine served by servers the run may run itself: how the operator renders them as
                pods (`ServerPods`) and how the local launcher starts one on this machine (`local`); None for an
                engine in the rollout process
  logprob_dtype the dtype its log-probabilities are computed in (the trainer's default logprob tolerance)

The rules over the table, each written once: `make_engine` (the rollout's engine), `make_publisher` (the trainers'
publisher), `own_servers` (how many servers the run runs itself: "the run owns its engines", for the operator and the
local launcher), `server_kind` (how they are run), `logprob_dtype`.

Entries: `megatron` (in-process, `megatron.py`; weights through the store, `store_sync.py`) and `vllm` (a pool of vLLM
servers, `vllm/`; weights by disk or broadcast). `register` adds one from outside (a test registers a stand-in engine
type: tests/integration/test_engine_table.py); what else a new engine type touches is in docs/architecture.md ("A new
engine type").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from trainingrun.contract.engine import Engine
from trainingrun.contract.errors import ConfigError
from trainingrun.engines import store_sync
from trainingrun.engines.vllm import engine as vllm_engine
from trainingrun.engines.vllm import k8s as vllm_k8s
from trainingrun.engines.vllm import multinode as vllm_multinode
from trainingrun.engines.vllm import publish as vllm_publish
from trainingrun.modeling.architecture import Architecture

Builder = Callable[[Any, Any, Architecture], Engine]  # (spec, store, arch) -> the rollout's engine
PublisherFactory = Callable[..., Any]  # (spec, store, *, arch, rank, attempt) -> a WeightPublisher


class LocalServer(Protocol):
    """One of the run's own servers as a process on this machine (what the local launcher supervises)."""

    url: str
    log_path: Path
    proc: Any  # the running subprocess.Popen, or None (the launcher sets it to None when the process is gone)
    pid: int | None
    starts: int  # how often it was started

    def start(self) -> None: ...

    def healthy(self) -> bool: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ServerPods:
    """How the operator renders the run's own servers (pure functions of the spec; `trainingrun.operator.render`
    places them: one pod per replica, named R-engine-<i>, hostname engine-<i> under the headless Service R-engine)."""

    port: int  # the servers' port (the Service's)
    urls: Callable[[str, str, int], str]  # (service, namespace, replicas) -> every replica's URL, comma-separated
    config_map_data: Callable[[], dict[str, str]]  # the files the servers mount (ConfigMap R-engine)
    volumes: Callable[[str], list[dict[str, Any]]]  # (the ConfigMap's name) -> the pod's own volumes
    resources: Callable[[Any], tuple[dict[str, Any], dict[str, Any], int]]  # spec -> (requests, limits, GPUs)
    container: Callable[..., dict[str, Any]]  # (spec, *, volume_mounts, resources) -> the server's container
    claims: Callable[[Any], list[Any]] = lambda spec: []  # spec -> the pod's DRA claims (api.spec.base.PodResourceClaim)
    # spec -> pods per replica: a leader (node 0, the replica's URL) and workers; `container` then also takes
    # node=j and leader=<the leader's hostname> (vllm: `rollout.engine.vllm.nodes`)
    nodes: Callable[[Any], int] = lambda spec: 1


@dataclass(frozen=True)
class Servers:
    """The servers of an engine type that the run runs itself (`rollout.engine.replicas`) unless `engine.url` names
    the user's."""

    title: str  # what they are called in the launcher's messages ("vLLM")
    pods: ServerPods  # in a cluster (the operator)
    local: Callable[..., LocalServer]  # (spec, *, log_path, port) -> a server on this machine; ValueError: cannot


@dataclass(frozen=True)
class EngineType:
    """One entry of the table (see the module docstring)."""

    name: str  # rollout.engine.type
    build: Builder
    publishers: Mapping[str, PublisherFactory]  # weightSync.type -> publisher factory
    servers: Servers | None = None  # None: the engine runs in the rollout process
    logprob_dtype: Callable[[Any], str] = field(default=lambda spec: "float32")


def _build_megatron(spec, store, arch: Architecture) -> Engine:
    from trainingrun.engines import megatron  # deferred: torch, megatron

    return megatron.build(spec, store, arch)


ENGINES: dict[str, EngineType] = {
    "megatron": EngineType(
        name="megatron",
        build=_build_megatron,
        publishers={"store": store_sync.make_store_publisher},
    ),
    "vllm": EngineType(
        name="vllm",
        build=vllm_engine.build,
        publishers={"disk": vllm_publish.make_vllm_publisher, "broadcast": vllm_publish.make_vllm_publisher},
        servers=Servers(
            title="vLLM",
            pods=ServerPods(port=vllm_k8s.ENGINE_PORT, urls=vllm_k8s.engine_url,
                            config_map_data=vllm_k8s.extension_config_map_data,
                            volumes=lambda config_map: [vllm_k8s.extension_volume(config_map)],
                            resources=vllm_k8s.server_resources, container=vllm_k8s.engine_container,
                            claims=lambda spec: list(spec.rollout.engine.vllm.resource_claims),
                            nodes=vllm_k8s.pods_per_replica),
            local=vllm_multinode.local_replica,
        ),
        logprob_dtype=lambda spec: spec.rollout.engine.vllm.dtype,
    ),
}


def register(entry: EngineType) -> EngineType:
    """Add an engine type to the table (a name already there is refused). The API admits only the types its
    `rollout.engine.type` Literal names: docs/architecture.md, "A new engine type"."""
    if entry.name in ENGINES:
        raise ValueError(f"engine type {entry.name!r} is in the table already")
    ENGINES[entry.name] = entry
    return entry


def engine_type(name: str) -> EngineType:
    """The entry of `rollout.engine.type` `name` (ConfigError naming the field and the types there are)."""
    entry = ENGINES.get(name)
    if entry is None:
        raise ConfigError(f"rollout.engine.type: {name!r} is not available in this build; allowed: "
                          f"{', '.join(sorted(ENGINES))}")
    return entry


def make_engine(spec, store, arch: Architecture) -> Engine:
    """The engine `spec.rollout.engine` names (the in-process one builds `arch`), fetching weights through the run's
    weight sync."""
    return engine_type(spec.rollout.engine.type).build(spec, store, arch)


def make_publisher(spec, store, *, arch: Architecture, rank: int, attempt: int = 0) -> Any:
    """The trainers' publisher of `spec.weightSync.type` for the run's engine (generated rollouts). Which sync
    reaches which engine is a rule of the spec (checked at admission); an entry without it is refused here, naming
    the field."""
    entry = engine_type(spec.rollout.engine.type)
    factory = entry.publishers.get(spec.weight_sync.type)
    if factory is None:
        raise ConfigError(f"weightSync.type: {spec.weight_sync.type!r} does not reach the {entry.name} engine; "
                          f"allowed: {', '.join(sorted(entry.publishers))}")
    return factory(spec, store, arch=arch, rank=rank, attempt=attempt)


def server_kind(spec) -> Servers | None:
    """How the run's engine servers are run (None: the engine runs in the rollout process)."""
    return engine_type(spec.rollout.engine.type).servers


def own_servers(spec) -> int:
    """How many servers the run runs for its engine: `rollout.engine.replicas` for generated rollouts whose engine
    is served by servers and no `engine.url` (the user's own) — else 0. The one rule "the run owns its engines" of
    the operator and the local launcher."""
    e = spec.rollout.engine
    if spec.rollout.source.type != "generate" or e.url or server_kind(spec) is None:
        return 0
    return e.replicas


def logprob_dtype(spec) -> str:
    """The dtype the run's engine computes log-probabilities in."""
    return engine_type(spec.rollout.engine.type).logprob_dtype(spec)
