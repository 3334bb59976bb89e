"""Pure render functions: a TrainingRun (+ its owner identity and attempt) → the plain dicts of its children.

Nothing here talks to the API server; `trainingrun.operator.handlers` creates what is missing. Every child carries an
owner reference to its TrainingRun (controller: true), so deleting the run garbage-collects them.

Children of a run `R` in namespace `NS`:
  ConfigMap  R-config           the run manifest as YAML, mounted at `trainingrun.plan.CONFIG_MOUNT_PATH`; annotated
                                with a hash of it (`config_hash`), so a changed spec (a resize) is noticed; with the
                                run's own engines also `engines`, the pool's URLs one a line, mounted beside it in the
                                rollout pod ($TRAININGRUN_ENGINE_URL_FILE): updated in place when the pool is resized
  Service    R-trainers         headless; trainer pods of attempt k set hostname trainer-<rank>-a<k> + subdomain
                                R-trainers, so MASTER_ADDR = trainer-0-a<k>.R-trainers.NS.svc is the current
                                attempt's trainer 0 and never a pod of an older attempt still terminating
  Pod        R-rollout-a<k>     the rollout (attempt k)
  Pod        R-trainer-<i>-a<k> trainer rank i (attempt k)
  Pod+Svc    R-store            Redis, only with `store.managed: true` (or no store configured)
  PodGroup   R-a<k>             only with `gangScheduling.enabled` (`trainingrun.operator.gang`), per attempt; with
                                provider kubernetes a Workload R-a<k> first
  CM+Svc     R-engine           the run's own engine servers (the plan's engine roles), only with an engine type served
  Pod        R-engine-<i>       by servers (vllm) and no `engine.url`, rendered by its entry's `ServerPods`
                                (`trainingrun.engines.table`; vllm: `trainingrun.engines.vllm.k8s`): the servers'
                                ConfigMap (vllm: the worker extension), a headless Service (pod i is
                                engine-<i>.R-engine.NS.svc) and one pod per `rollout.engine.replicas`; like the store
                                they outlive attempts. In Kueue's accounting (the run's queue, pod group R-engine) and,
                                with gang scheduling, in a serving group R-engine of their own (`gang`). restartPolicy
                                Never: the operator replaces a failed engine pod alone (R-engine-<i>-r<g>, the failure
                                policy). With rollout.engine.vllm.nodes N > 1 a replica is N pods: its leader
                                R-engine-<i> (labels engine-replica i, engine-node 0) and workers R-engine-<i>-n<j>
                                (engine-node j), meeting at the leader; a failed pod replaces the whole replica;
                                with gang scheduling (or Kueue) one group per replica, R-engine-<i> (`gang`)
Pod names carry the attempt so a restarted group never collides with pods of the previous attempt still terminating;
every pod's TRAININGRUN_ATTEMPT is its attempt, which the store and checkpoints use to refuse an older attempt's
writes. A rollout or engine pod restarted alone carries its generation in its name, its label
trainingrun.dev/role-attempt and (the rollout) TRAININGRUN_ROLE_ATTEMPT, by which the store's writer claim prefers
the newer rollout over an older one of the same attempt. The names, the owner and `Child` (one child, as `status.decide` asks for it) are the operator's vocabulary
(`trainingrun.operator.vocabulary`); `render_child` renders one child with the function `RENDERERS` names for its
kind and role, and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainingrun.api.constants import (
    ANNOTATION_CONFIG_HASH,
    APP,
    LABEL_ATTEMPT,
    LABEL_ENGINE_NODE,
    LABEL_ENGINE_REPLICA,
    LABEL_NAME,
    LABEL_RANK,
    LABEL_REPLICA,
    LABEL_ROLE,
    LABEL_ROLE_ATTEMPT,
    LABEL_RUN,
    ROLE_CONFIG,
    ROLE_ENGINE,
    ROLE_ROLLOUT,
    ROLE_STORE,
    ROLE_TRAINER,
)
from trainingrun.api.models import TrainingRun
from trainingrun.operator import gang
from trainingrun.operator.vocabulary import (
    CONFIG_VOLUME,
    SHM_VOLUME,
    STORE_PORT,
    Child,
    Names,
    Owner,
    base_children,
    config_hash,
    config_data,
    ENGINES_KEY,
    engine_child,
    engine_is_managed,
    engine_nodes,
    engine_replicas,
    master_addr,
    run_epoch,
    store_is_managed,
    store_url,
)
from trainingrun.plan import CONFIG_MOUNT_PATH, DEFAULT_MASTER_PORT, ProcessPlan, RunPlan, build_plan, engine_roles
from trainingrun.engines.table import ServerPods, server_kind
from trainingrun.contract.env import ENGINE_URL_ENV, ENGINE_URL_FILE_ENV, ProcessEnv

DEFAULT_REDIS_IMAGE = "redis:7.2-alpine"
GPU_RESOURCE = gang.GPU_RESOURCE


def plan_for(run: TrainingRun, namespace: str, attempt: int) -> RunPlan:
    return build_plan(
        run,
        store_url=store_url(run, namespace),
        config_path=CONFIG_MOUNT_PATH,
        master_addr=master_addr(run, namespace, attempt),
        master_port=DEFAULT_MASTER_PORT,
        attempt=attempt,
        epoch=run_epoch(run),
        extra_env={ENGINE_URL_ENV: server_pods(run).urls(Names(run.metadata.name).engine, namespace,
                                                         run.spec.rollout.engine.replicas),
                   ENGINE_URL_FILE_ENV: engines_path()}
        if engine_is_managed(run) else None,
        engine_replicas=engine_replicas(run),
    )


def engines_path() -> str:
    """Where the rollout pod reads the engine pool's current URLs: the ConfigMap's ENGINES_KEY beside run.yaml."""
    return f"{CONFIG_MOUNT_PATH.rsplit('/', 1)[0]}/{ENGINES_KEY}"


def server_pods(run: TrainingRun) -> ServerPods:
    """How the run's engine type renders its servers (the engine table; only for a run whose engine has servers)."""
    servers = server_kind(run.spec)
    assert servers is not None, f"engine pods of the {run.spec.rollout.engine.type} engine, which has no servers"
    return servers.pods


def _meta(name: str, owner: Owner, labels: dict[str, str], annotations: dict[str, str] | None = None) -> dict:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels,
        "ownerReferences": [owner.reference()],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


def base_labels(run_name: str) -> dict[str, str]:
    return {LABEL_NAME: APP, LABEL_RUN: run_name}


def render_config_map(run: TrainingRun, owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(Names(owner.name).config, owner, {**base_labels(owner.name), LABEL_ROLE: ROLE_CONFIG},
                          {ANNOTATION_CONFIG_HASH: config_hash(run)}),
        "data": config_data(run, owner.namespace),
    }


def render_service(run: TrainingRun, owner: Owner) -> dict[str, Any]:
    """Headless service for trainer rendezvous; not-ready addresses are published so rank 0 resolves at once."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(Names(owner.name).service, owner, {**base_labels(owner.name), LABEL_ROLE: ROLE_TRAINER}),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {**base_labels(owner.name), LABEL_ROLE: ROLE_TRAINER},
            "ports": [{"name": "rendezvous", "port": DEFAULT_MASTER_PORT, "targetPort": DEFAULT_MASTER_PORT}],
        },
    }


def _pod_spec_common(run: TrainingRun, gang_version: str | None = None) -> dict[str, Any]:
    t = run.spec.pod_template
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # rollout and trainers never call the Kubernetes API
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if t.node_selector:
        spec["nodeSelector"] = dict(t.node_selector)
    if t.tolerations:
        spec["tolerations"] = [tol.to_dict() for tol in t.tolerations]
    if t.affinity:
        spec["affinity"] = t.affinity
    if t.priority_class_name:
        spec["priorityClassName"] = t.priority_class_name
    if t.service_account_name:
        spec["serviceAccountName"] = t.service_account_name
    provider = gang.provider(run, gang_version)
    scheduler = run.spec.scheduler_name or (provider.scheduler_name if provider is not None else None)
    if scheduler:
        spec["schedulerName"] = scheduler
    return spec


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _resources(requests: dict, limits: dict, gpus: int) -> dict[str, Any]:
    req, lim = dict(requests), dict(limits)
    if gpus > 0:
        req[GPU_RESOURCE] = gpus
        lim[GPU_RESOURCE] = gpus
    out: dict[str, Any] = {}
    if req:
        out["requests"] = req
    if lim:
        out["limits"] = lim
    return out


def _claimed(resources: dict[str, Any], claims: list) -> dict[str, Any]:
    """A container's resources with its claims of every DRA claim of its pod (`resources.claims`)."""
    return {**resources, "claims": [{"name": c.name} for c in claims]} if claims else resources


def _pod_claims(claims: list) -> dict[str, Any]:
    """The pod's `resourceClaims` (core/v1 PodResourceClaim) for the spec's claims; {} without any."""
    return {"resourceClaims": [c.as_pod_claim() for c in claims]} if claims else {}


def render_process_pod(run: TrainingRun, owner: Owner, process: ProcessPlan, attempt: int, generation: int = 0,
                       gang_version: str | None = None) -> dict[str, Any]:
    """The pod of one process of the plan (rollout or trainer rank); `generation`: the rollout's generation (its
    restarts alone); `gang_version`: the served scheduling.k8s.io version (gang provider kubernetes)."""
    spec = run.spec
    names = Names(owner.name)
    t = spec.pod_template
    labels = {**t.labels, **base_labels(owner.name), LABEL_ROLE: process.role, LABEL_ATTEMPT: str(attempt)}
    annotations = dict(t.annotations)
    if process.rank is not None:
        labels[LABEL_RANK] = str(process.rank)
    env = dict(process.env)
    if process.role == ROLE_ROLLOUT:
        labels[LABEL_ROLE_ATTEMPT] = str(generation)
        env.update(ProcessEnv(role_attempt=generation).to_env())
    provider = gang.provider(run, gang_version)
    group = names.podgroup(attempt)
    for extra_labels, extra_annotations in (
        provider.pod_metadata(group) if provider is not None else ({}, {}),
        gang.kueue_metadata(run, group),
        gang.placement_metadata(run, process.role, process.rank),
    ):
        labels.update(extra_labels)
        annotations.update(extra_annotations)
    claims: list = []
    if process.role == ROLE_TRAINER:
        res, claims = spec.trainer.resources, spec.trainer.resource_claims
        # with DRA claims the GPUs come from them: no device-plugin GPUs besides
        resources = _resources(res.requests, res.limits, 0 if claims else spec.trainer.gpus_per_replica)
    else:
        res = spec.rollout.resources
        resources = _resources(res.requests, res.limits, 0)
    # One /metrics port per worker (gpusPerReplica > 1 runs several): metrics, metrics-1, ... (the PodMonitor keeps
    # every port whose name starts with "metrics").
    ports = [{"name": "metrics" if i == 0 else f"metrics-{i}", "containerPort": port}
             for i, port in enumerate(process.metrics_ports)]
    if process.role == ROLE_TRAINER and process.rank == 0:
        ports.append({"name": "rendezvous", "containerPort": DEFAULT_MASTER_PORT})
    container: dict[str, Any] = {
        "name": process.role,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["trainingrun"],
        "args": list(process.args),
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
        "ports": ports,
        "volumeMounts": [
            {"name": CONFIG_VOLUME, "mountPath": CONFIG_MOUNT_PATH.rsplit("/", 1)[0], "readOnly": True},
            *t.volume_mounts,
        ],
        "securityContext": _container_security(),
    }
    wandb = spec.metrics.wandb
    if process.role == ROLE_TRAINER and wandb is not None and wandb.api_key_secret is not None:
        # W&B online mode: the API key from a Secret (never in the spec or the ConfigMap)
        container["env"].append({"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": wandb.api_key_secret.name, "key": wandb.api_key_secret.key}}})
    if process.role == ROLE_ROLLOUT:
        # the request headers of rewards served over HTTP: from their Secrets (never in the spec or the ConfigMap)
        container["env"].extend({"name": var, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
                                for var, ref in spec.rollout.header_secrets())
    resources = _claimed(resources, claims)
    if resources:
        container["resources"] = resources
    items = [{"key": "run.yaml", "path": "run.yaml"}]
    if process.role == ROLE_ROLLOUT and engine_is_managed(run):  # the pool's URLs, updated in place on a resize
        items.append({"key": ENGINES_KEY, "path": ENGINES_KEY})
    pod_spec = {
        **_pod_spec_common(run, gang_version),
        **(provider.pod_spec(group) if provider is not None else {}),
        "restartPolicy": "Never",  # restarts are the operator's (the failure policy), with attempt/generation labels
        "containers": [container],
        "volumes": [
            {"name": CONFIG_VOLUME, "configMap": {"name": names.config, "items": items}},
            *t.volumes,
        ],
        **_pod_claims(claims),
    }
    if process.role == ROLE_TRAINER and process.workers > 1:
        # G workers in one pod talk through shared memory (NCCL, gloo); the runtime's default /dev/shm is 64 MiB.
        pod_spec["volumes"].append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
        container["volumeMounts"].append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    if process.role == ROLE_TRAINER:
        assert process.rank is not None
        pod_spec["hostname"] = Names.hostname(process.rank, attempt)
        pod_spec["subdomain"] = names.service
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _meta(names.pod(process.role, process.rank, attempt, generation), owner, labels, annotations),
        "spec": pod_spec,
    }


def render_pods(run: TrainingRun, owner: Owner, attempt: int, *, gang_version: str | None = None) -> list[dict[str, Any]]:
    """Rollout pod first, then trainers by rank, for one attempt."""
    plan = plan_for(run, owner.namespace, attempt)
    return [render_process_pod(run, owner, p, attempt, gang_version=gang_version) for p in plan.processes]


def render_store_pod(run: TrainingRun, owner: Owner, image: str = DEFAULT_REDIS_IMAGE) -> dict[str, Any]:
    """The managed Redis pod: restartPolicy Always, no persistence."""
    names = Names(owner.name)
    labels = {**base_labels(owner.name), LABEL_ROLE: ROLE_STORE}
    t = run.spec.pod_template
    common = _pod_spec_common(run)
    common.pop("schedulerName", None)  # the store is not part of the gang
    common["securityContext"] = {**common["securityContext"], "runAsUser": 999, "runAsGroup": 999, "fsGroup": 999}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _meta(names.store, owner, {**t.labels, **labels}, dict(t.annotations) or None),
        "spec": {
            **common,
            "restartPolicy": "Always",
            "containers": [
                {
                    "name": "redis",
                    "image": image,
                    "args": ["--save", "", "--appendonly", "no", "--protected-mode", "no"],
                    "ports": [{"name": "redis", "containerPort": STORE_PORT}],
                    "securityContext": _container_security(),
                    "readinessProbe": {"tcpSocket": {"port": STORE_PORT}, "periodSeconds": 5},
                    "resources": _store_resources(run),
                }
            ],
        },
    }


def render_store_service(run: TrainingRun, owner: Owner) -> dict[str, Any]:
    """The managed Redis pod's Service."""
    labels = {**base_labels(owner.name), LABEL_ROLE: ROLE_STORE}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(Names(owner.name).store, owner, labels),
        "spec": {"selector": labels, "ports": [{"name": "redis", "port": STORE_PORT, "targetPort": STORE_PORT}]},
    }


def render_store(run: TrainingRun, owner: Owner, image: str = DEFAULT_REDIS_IMAGE) -> list[dict[str, Any]]:
    """Managed Redis: its Pod and Service; [] when the store is external."""
    if not store_is_managed(run):
        return []
    return [render_store_pod(run, owner, image), render_store_service(run, owner)]


STORE_DEFAULT_RESOURCES = {"requests": {"cpu": "250m", "memory": "2Gi"}, "limits": {"memory": "2Gi"}}


def _store_resources(run: TrainingRun) -> dict[str, Any]:
    """The managed Redis pod's resources: the spec's, or requests = limits for memory so it is not the first pod
    evicted under memory pressure (it holds every unconsumed rollout and the rollout's resume state)."""
    res = run.spec.store.resources
    return _resources(res.requests, res.limits, 0) or STORE_DEFAULT_RESOURCES


def render_engine_config_map(run: TrainingRun, owner: Owner) -> dict[str, Any]:
    """The files the run's engine servers mount (vllm: the worker extension, `trainingrun.engines.vllm.k8s`)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(Names(owner.name).engine, owner, {**base_labels(owner.name), LABEL_ROLE: ROLE_ENGINE}),
        "data": server_pods(run).config_map_data(),
    }


def render_engine_pod(run: TrainingRun, owner: Owner, replica: int = 0, generation: int = 0,
                      gang_version: str | None = None, node: int = 0) -> dict[str, Any]:
    """The run's engine server `replica` in its `generation` (its engine type's `ServerPods`): restartPolicy Never
    (the operator replaces a failed one: the failure policy, its budget in the run's status), the run's podTemplate
    volumes (model.hf and weightSync.path live there), hostname engine-<i> under the headless Service (the same in
    every generation), in the engines' Kueue pod group and serving gang group. `node`: the pod's node within a
    multi-node replica (0: the leader; its workers get hostname engine-<i>-n<j> and meet at the leader's name)."""
    names = Names(owner.name)
    t = run.spec.pod_template
    labels = {**t.labels, **base_labels(owner.name), LABEL_ROLE: ROLE_ENGINE, LABEL_REPLICA: str(replica),
              LABEL_ENGINE_REPLICA: str(replica), LABEL_ENGINE_NODE: str(node), LABEL_ROLE_ATTEMPT: str(generation)}
    annotations = dict(t.annotations)
    provider = gang.provider(run, gang_version)
    group = gang.engine_group(run, names.engine, replica)  # the pool's, or the multi-node replica's own
    for extra_labels, extra_annotations in (
        provider.pod_metadata(group) if provider is not None else ({}, {}),
        gang.kueue_metadata(run, group, engines=True),
    ):
        labels.update(extra_labels)
        annotations.update(extra_annotations)
    pods = server_pods(run)
    claims = pods.claims(run.spec)
    multi = {} if pods.nodes(run.spec) == 1 else {  # the replica's pods meet at its leader's stable name
        "node": node, "leader": f"{Names.engine_hostname(replica)}.{names.engine}.{owner.namespace}.svc"}
    container = pods.container(run.spec, volume_mounts=list(t.volume_mounts),
                               resources=_claimed(_resources(*pods.resources(run.spec)), claims), **multi)
    container["securityContext"] = _container_security()
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _meta(names.engine_pod(replica, generation, node), owner, labels, annotations or None),
        "spec": {
            **_pod_spec_common(run, gang_version),
            **(provider.pod_spec(group) if provider is not None else {}),
            "restartPolicy": "Never",
            "hostname": Names.engine_hostname(replica, node),
            "subdomain": names.engine,
            "containers": [container],
            "volumes": [*pods.volumes(names.engine), *t.volumes],
            **_pod_claims(claims),
        },
    }


def render_engine_service(run: TrainingRun, owner: Owner) -> dict[str, Any]:
    """The engines' headless Service: a stable name per replica (engine-<i>.R-engine.NS.svc), ready pods only —
    but for multi-node replicas, whose workers resolve their leader before it is ready (it becomes ready only once
    they joined), every pod's name is published at once."""
    labels = {**base_labels(owner.name), LABEL_ROLE: ROLE_ENGINE}
    port = server_pods(run).port
    spec: dict[str, Any] = {"clusterIP": "None", "selector": labels,
                            "ports": [{"name": "http", "port": port, "targetPort": port}]}
    if engine_nodes(run) > 1:
        spec["publishNotReadyAddresses"] = True
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(Names(owner.name).engine, owner, labels),
        "spec": spec,
    }


def render_engine_gang(run: TrainingRun, owner: Owner, kind: str, gang_version: str | None = None,
                       replica: int | None = None) -> dict[str, Any]:
    """The engines' serving `kind` object of the run's gang provider (a PodGroup; with provider kubernetes also a
    Workload), named R-engine: every replica or none, for the run's whole life; with multi-node replicas the one of
    `replica`, R-engine-<i>: its leader and workers or none."""
    provider = gang.provider(run, gang_version)
    assert provider is not None, "an engine gang object without gang scheduling"
    assert kind in provider.kinds, f"{provider.name} creates {provider.kinds}, not {kind}"
    names = Names(owner.name)
    name = names.engine if replica is None else gang.engine_group(run, names.engine, replica)
    return {
        "apiVersion": provider.api_version,
        "kind": kind,
        "metadata": _meta(name, owner, {**base_labels(owner.name), LABEL_ROLE: ROLE_ENGINE}),
        "spec": provider.spec(kind, run, name, engines=True),
    }


def render_engine(run: TrainingRun, owner: Owner) -> list[dict[str, Any]]:
    """The run's engine servers (the plan's engine roles): their ConfigMap, headless Service, serving PodGroup (gang
    scheduling) and one Pod per replica; [] when not managed."""
    if not engine_is_managed(run):
        return []
    out = [render_engine_config_map(run, owner), render_engine_service(run, owner)]
    provider = gang.provider(run)
    if provider is not None:
        out += [render_engine_gang(run, owner, kind, replica=replica)
                for replica, _ in gang.engine_groups(run, Names(owner.name).engine, engine_replicas(run))
                for kind in provider.kinds]
    return out + [render_engine_pod(run, owner, role.replica, node=node)
                  for role in engine_roles(run, engine_replicas(run)) for node in range(engine_nodes(run))]


def render_gang(run: TrainingRun, owner: Owner, kind: str, attempt: int,
                gang_version: str | None = None) -> dict[str, Any] | None:
    """The attempt's `kind` object of its gang provider (`trainingrun.operator.gang`: a PodGroup; with provider
    kubernetes also a Workload), or None without gang scheduling."""
    provider = gang.provider(run, gang_version)
    if provider is None:
        return None
    assert kind in provider.kinds, f"{provider.name} creates {provider.kinds}, not {kind}"
    name = Names(owner.name).podgroup(attempt)
    return {
        "apiVersion": provider.api_version,
        "kind": kind,
        "metadata": _meta(name, owner, {**base_labels(owner.name), LABEL_ATTEMPT: str(attempt)}),
        "spec": provider.spec(kind, run, name),
    }


def render_podgroup(run: TrainingRun, owner: Owner, attempt: int,
                    gang_version: str | None = None) -> dict[str, Any] | None:
    """The attempt's PodGroup (`render_gang`)."""
    return render_gang(run, owner, "PodGroup", attempt, gang_version)


# ------------------------------------------------------------------------------------------------------ dispatch
@dataclass(frozen=True)
class Target:
    """One child to render: the run, its owner, the child, the attempt, and the operator's settings."""

    run: TrainingRun
    owner: Owner
    child: Child
    attempt: int
    redis_image: str = DEFAULT_REDIS_IMAGE
    gang_version: str | None = None  # the served scheduling.k8s.io version (gang provider kubernetes)


def _process_pod(t: Target) -> dict[str, Any]:
    plan = plan_for(t.run, t.owner.namespace, t.attempt)
    process = plan.rollout if t.child.role == ROLE_ROLLOUT else next(p for p in plan.trainers
                                                                     if p.rank == t.child.rank)
    return render_process_pod(t.run, t.owner, process, t.attempt, t.child.generation, t.gang_version)


def _engine_gang(t: Target) -> dict[str, Any]:
    return render_engine_gang(t.run, t.owner, t.child.kind, t.gang_version, t.child.rank)


def _gang(t: Target) -> dict[str, Any]:
    obj = render_gang(t.run, t.owner, t.child.kind, t.attempt, t.gang_version)
    assert obj is not None, f"a {t.child.kind} child without gang scheduling"
    return obj


# (kind, role) of a `Child` -> the function rendering exactly that object
RENDERERS: dict[tuple[str, str | None], Callable[[Target], dict[str, Any]]] = {
    ("ConfigMap", ROLE_CONFIG): lambda t: render_config_map(t.run, t.owner),
    ("Service", ROLE_TRAINER): lambda t: render_service(t.run, t.owner),
    ("Service", ROLE_STORE): lambda t: render_store_service(t.run, t.owner),
    ("Pod", ROLE_STORE): lambda t: render_store_pod(t.run, t.owner, t.redis_image),
    ("ConfigMap", ROLE_ENGINE): lambda t: render_engine_config_map(t.run, t.owner),
    ("Service", ROLE_ENGINE): lambda t: render_engine_service(t.run, t.owner),
    ("Pod", ROLE_ENGINE): lambda t: render_engine_pod(t.run, t.owner, t.child.rank or 0, t.child.generation,
                                                      t.gang_version, t.child.node),
    ("PodGroup", ROLE_ENGINE): _engine_gang,
    ("Workload", ROLE_ENGINE): _engine_gang,
    ("PodGroup", None): _gang,
    ("Workload", None): _gang,
    ("Pod", ROLE_ROLLOUT): _process_pod,
    ("Pod", ROLE_TRAINER): _process_pod,
}


def render_child(run: TrainingRun, owner: Owner, child: Child, attempt: int, *,
                 redis_image: str = DEFAULT_REDIS_IMAGE, gang_version: str | None = None) -> dict[str, Any]:
    """The object of one `Child` of attempt `attempt` (`RENDERERS`)."""
    render = RENDERERS.get((child.kind, child.role))
    if render is None:
        raise ValueError(f"no renderer for {child.key} with role {child.role!r}; known: {sorted(map(str, RENDERERS))}")
    return render(Target(run, owner, child, attempt, redis_image, gang_version))


def render_children(run: TrainingRun, owner: Owner, attempt: int, *, redis_image: str = DEFAULT_REDIS_IMAGE,
                    gang_version: str | None = None) -> list[dict]:
    """Every child of one attempt, in creation order: config, services, store, gang objects, engines, then the
    pods."""
    plan = plan_for(run, owner.namespace, attempt)
    children = base_children(run, attempt)
    children += [engine_child(run, role.replica, 0, node) for role in plan.engines for node in range(engine_nodes(run))]
    children += [Child("Pod", Names(owner.name).pod(p.role, p.rank, attempt), role=p.role, rank=p.rank)
                 for p in plan.processes]
    return [render_child(run, owner, c, attempt, redis_image=redis_image, gang_version=gang_version)
            for c in children]
