"""The run's own vLLM servers in a cluster: the engine pods' container, their worker-extension ConfigMap and the URLs
the rollout is given. Pure functions of the spec: the vllm entry's `ServerPods` (`trainingrun.engines.table`), which
the operator's `render` module places among a run's children.

  ConfigMap  R-engine     the worker extension (`server.extension_files()`), mounted at EXTENSION_DIR and put on
                          PYTHONPATH: the official vLLM image needs nothing of trainingrun installed
  Pod        R-engine-<i> one per `rollout.engine.replicas`: the official vLLM image (`rollout.engine.vllm.image`), the
                          same server command line as local runs and tests (`server.server_args`, all interfaces, port
                          ENGINE_PORT), `gpus` GPUs each (its tensor-parallel size), readiness from /health, the run's
                          podTemplate volumes (model.hf and `weightSync.path` must be on them), hostname engine-<i>
                          under the headless Service; restartPolicy Always: the kubelet restarts a dead server and the
                          rollout sends its prompts to the others, then loads the current version into it
  Service    R-engine     headless (a stable name per replica: engine-<i>.R-engine.NS.svc), ENGINE_PORT, ready pods
                          only; the rollout gets every replica's URL, comma-separated ($TRAININGRUN_ENGINE_URL)

Multi-node replicas (`rollout.engine.vllm.nodes` N > 1): each replica is a leader pod (node 0: the API server, the
replica's URL, hostname engine-<i>) and N - 1 worker pods (node j: `vllm serve --headless`, no API server, no probes),
all started by vLLM's own multi-node launch over its multiprocessing executor, without Ray: `--nnodes N --node-rank j
--master-addr engine-<i>.R-engine.NS.svc --master-port MASTER_PORT --distributed-executor-backend mp`. The replica's
tensor-parallel size is gpus × N (vLLM requires N to divide its world size; each node runs `gpus` workers). The
workers resolve the leader before it is ready, so the Service publishes not-ready addresses for such a run. Every
node gets the same worker extension (`--worker-extension-cls` and PYTHONPATH): the leader's collective_rpc reaches
every vLLM worker process on every node, so a weight sync loads into all of them.

The development endpoints weight sync needs (VLLM_SERVER_DEV_MODE) are reachable inside the cluster through the
Service: restrict it with a NetworkPolicy to the run's pods where other tenants share the namespace.
"""

from __future__ import annotations

from typing import Any

from trainingrun.engines.vllm.server import ENTRYPOINT as _ENTRYPOINT
from trainingrun.engines.vllm.server import extension_files, lora_args, server_args, server_env
from trainingrun.plan import engine_name

ENGINE_PORT = 8000
MASTER_PORT = 29501  # vLLM's multi-node rendezvous on a replica's leader (its --master-port default)
WORKER_ENTRYPOINT = ("-m", "vllm.entrypoints.cli.main", "serve")  # `vllm serve`: the one that knows --headless
EXTENSION_DIR = "/opt/trainingrun-vllm"
EXTENSION_VOLUME = "vllm-extension"


def _key(path: str) -> str:
    """A ConfigMap key for a relative path (keys may not hold '/')."""
    return path.replace("/", "__")


def extension_config_map_data() -> dict[str, str]:
    return {_key(rel): text for rel, text in extension_files().items()}


def extension_volume(config_map: str) -> dict[str, Any]:
    items = [{"key": _key(rel), "path": rel} for rel in sorted(extension_files())]
    return {"name": EXTENSION_VOLUME, "configMap": {"name": config_map, "items": items}}


def replica_hostname(index: int) -> str:
    """Engine pod i's hostname under the headless Service (engine-<i>.R-engine.NS.svc), stable over restarts: the
    plan's name of engine replica i (`trainingrun.plan.engine_name`)."""
    return engine_name(index)


def server_resources(spec) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(requests, limits, device-plugin GPUs) of one engine pod (`rollout.engine.vllm`): no nvidia.com/gpu where the
    pod claims its devices by DRA (`resourceClaims`: the GPUs come from the claims)."""
    v = spec.rollout.engine.vllm
    return dict(v.resources.requests), dict(v.resources.limits), 0 if v.resource_claims else v.gpus


def engine_url(service: str, namespace: str, replicas: int = 1) -> str:
    """The URLs of the engine pods (their stable per-replica names under the headless Service), comma-separated."""
    return ",".join(f"http://{replica_hostname(i)}.{service}.{namespace}.svc:{ENGINE_PORT}" for i in range(replicas))


def pods_per_replica(spec) -> int:
    """The pods of one engine replica: a leader and nodes - 1 workers (`rollout.engine.vllm.nodes`)."""
    return spec.rollout.engine.vllm.nodes


def multi_node_args(nodes: int, node: int, leader: str) -> list[str]:
    """vLLM's own multi-node launch (no Ray) for node `node` of `nodes`, meeting at `leader` (node 0's hostname)."""
    return ["--nnodes", str(nodes), "--node-rank", str(node), "--master-addr", leader,
            "--master-port", str(MASTER_PORT), "--distributed-executor-backend", "mp"]


def engine_container(spec, *, volume_mounts: list[dict[str, Any]], resources: dict[str, Any], node: int = 0,
                     leader: str | None = None) -> dict[str, Any]:
    """The vLLM container of the engine pod of `spec` (a TrainingRunSpec with rollout.engine.type vllm): node `node`
    of its replica (0: the leader, serving the API; with `rollout.engine.vllm.nodes` > 1 a worker `vllm serve
    --headless` otherwise), meeting at `leader` (the leader's hostname; needed when nodes > 1)."""
    v = spec.rollout.engine.vllm
    model = spec.model.hf
    assert model is not None, "the vllm engine loads model.hf (cluster_errors refuses a run without it)"
    max_len = v.max_model_len or spec.model.seq_length  # None: the model's own (config.json, read by vLLM)
    args = server_args(model, port=ENGINE_PORT, host="0.0.0.0", dtype=v.dtype, max_model_len=int(max_len or 0),
                       enforce_eager=v.gpus == 0, tensor_parallel_size=max(v.gpus, 1) * v.nodes,
                       prefix_caching=v.prefix_caching, extra=[*lora_args(spec), *v.args])
    if not max_len:
        i = args.index("--max-model-len")
        del args[i:i + 2]
    if v.nodes > 1:
        assert leader is not None, "a multi-node engine replica's pods meet at its leader"
        args += multi_node_args(v.nodes, node, leader)
        if node > 0:  # a worker: `vllm serve --headless` in place of the API server's entrypoint
            args = [*WORKER_ENTRYPOINT, *args[len(_ENTRYPOINT):], "--headless"]
    # the image's own environment plus ours; OMP threads are the image's choice on GPUs
    env = server_env(EXTENSION_DIR, kv_cache_gib=v.kv_cache_gib, omp_threads=None if v.gpus else 1, base={})
    if node > 0:  # a headless worker: no API server to probe; its replica fails with it (the operator replaces it)
        return {
            "name": "vllm", "image": v.image, "imagePullPolicy": spec.image_pull_policy, "command": ["python3"],
            "args": args, "env": [{"name": k, "value": val} for k, val in sorted(env.items())],
            "volumeMounts": [{"name": EXTENSION_VOLUME, "mountPath": EXTENSION_DIR, "readOnly": True},
                             *volume_mounts],
            **({"resources": resources} if resources else {}),
        }
    ports = [{"name": "http", "containerPort": ENGINE_PORT}]
    if v.nodes > 1:
        ports.append({"name": "rendezvous", "containerPort": MASTER_PORT})
    return {
        "name": "vllm",
        "image": v.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["python3"],
        "args": args,
        "env": [{"name": k, "value": val} for k, val in sorted(env.items())],
        "ports": ports,
        "readinessProbe": {"httpGet": {"path": "/health", "port": ENGINE_PORT}, "periodSeconds": 5,
                           "failureThreshold": 3},
        # loading a model takes minutes: liveness only after /health first answered (startupProbe)
        "startupProbe": {"httpGet": {"path": "/health", "port": ENGINE_PORT}, "periodSeconds": 10,
                         "failureThreshold": 180},
        "livenessProbe": {"httpGet": {"path": "/health", "port": ENGINE_PORT}, "periodSeconds": 10,
                          "failureThreshold": 6},
        "volumeMounts": [{"name": EXTENSION_VOLUME, "mountPath": EXTENSION_DIR, "readOnly": True}, *volume_mounts],
        **({"resources": resources} if resources else {}),
    }
