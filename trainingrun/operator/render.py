"""Pure render functions: a TrainingRun (+ its owner identity and attempt) → the plain dicts of its children.

Nothing here talks to the API server; `trainingrun.operator.handlers` creates what is missing. Every child carries an
owner reference to its TrainingRun (controller: true), so deleting the run garbage-collects them.

Children of a run `R` in namespace `NS`:
  ConfigMap  R-config           the run manifest as YAML, mounted at `trainingrun.plan.CONFIG_MOUNT_PATH`; annotated
                                with a hash of it (`config_hash`), so a changed spec (a resize) is noticed
  Service    R-trainers         headless; trainer pods of attempt k set hostname trainer-<rank>-a<k> + subdomain
                                R-trainers, so MASTER_ADDR = trainer-0-a<k>.R-trainers.NS.svc is the current
                                attempt's trainer 0 and never a pod of an older attempt still terminating
  Pod        R-rollout-a<k>     the rollout (attempt k)
  Pod        R-trainer-<i>-a<k> trainer rank i (attempt k)
  Pod+Svc    R-store            Redis, only with `store.managed: true` (or no store configured)
  PodGroup   R-a<k>             only with `gangScheduling.enabled` (`trainingrun.operator.gang`), per attempt
  CM+Pod+Svc R-engine           the run's own vLLM server, only with `rollout.engine.type: vllm` and no `engine.url`
                                (`trainingrun.vllm.k8s`); like the store it outlives attempts
Pod names carry the attempt so a restarted group never collides with pods of the previous attempt still terminating;
every pod's TRAININGRUN_ATTEMPT is its attempt, which the store and checkpoints use to refuse an older attempt's
writes. `Child` names one child for `status.decide`; `render_child` renders it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from trainingrun.api.constants import (
    API_VERSION,
    APP,
    KIND,
    LABEL_ATTEMPT,
    LABEL_NAME,
    LABEL_RANK,
    LABEL_ROLE,
    LABEL_RUN,
    ROLE_CONFIG,
    ROLE_ENGINE,
    ROLE_STORE,
    ROLE_TRAINER,
)
from trainingrun.api.constants import ANNOTATION_CONFIG_HASH
from trainingrun.api.yamlcodec import dump_yaml
from trainingrun.api.models import TrainingRun
from trainingrun.operator import gang
from trainingrun.plan import CONFIG_MOUNT_PATH, DEFAULT_MASTER_PORT, ProcessPlan, RunPlan, build_plan
from trainingrun.vllm import k8s as engine_k8s
from trainingrun.vllm.engine import ENGINE_URL_ENV

STORE_PORT = 6379
DEFAULT_REDIS_IMAGE = "redis:7.2-alpine"
GPU_RESOURCE = gang.GPU_RESOURCE
CONFIG_VOLUME = "config"  # pod volume of the run's ConfigMap (reserved: podTemplate.volumes may not use it)
SHM_VOLUME = "dshm"  # memory-backed /dev/shm of multi-worker trainer pods (reserved too)
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class Owner:
    """Identity of the TrainingRun that owns the children."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True)
class Names:
    """Names of a run's children."""

    run: str

    @property
    def config(self) -> str:
        return f"{self.run}-config"

    @property
    def service(self) -> str:
        return f"{self.run}-trainers"

    @property
    def store(self) -> str:
        return f"{self.run}-store"

    @property
    def engine(self) -> str:
        return f"{self.run}-engine"

    def podgroup(self, attempt: int) -> str:
        return f"{self.run}-a{attempt}"

    def is_podgroup(self, name: str) -> bool:
        """Whether `name` is one of this run's PodGroups (of any attempt)."""
        prefix = f"{self.run}-a"
        return name.startswith(prefix) and name[len(prefix):].isdigit()

    def pod(self, role: str, rank: int | None, attempt: int) -> str:
        return f"{self.run}-{role}-a{attempt}" if rank is None else f"{self.run}-{role}-{rank}-a{attempt}"

    @staticmethod
    def hostname(rank: int, attempt: int) -> str:
        """A trainer pod's hostname: per attempt, so the rendezvous name never resolves to an older attempt's pod."""
        return f"trainer-{rank}-a{attempt}"


@dataclass(frozen=True)
class Child:
    """One child object of a run, by kind and name (pods of the attempt also by role and rank)."""

    kind: str  # ConfigMap, Service, Pod, PodGroup
    name: str
    role: str | None = None
    rank: int | None = None

    @property
    def key(self) -> str:
        return f"{self.kind}/{self.name}"


def base_children(run: TrainingRun, attempt: int) -> list[Child]:
    """What the attempt's pods need before they are created, in creation order (plus the managed store's pod)."""
    names = Names(run.metadata.name)
    out = [Child("ConfigMap", names.config), Child("Service", names.service)]
    if store_is_managed(run):
        out += [Child("Service", names.store), Child("Pod", names.store, role=ROLE_STORE)]
    if engine_is_managed(run):
        out += [Child("ConfigMap", names.engine), Child("Service", names.engine),
                Child("Pod", names.engine, role=ROLE_ENGINE)]
    if gang.provider(run) is not None:
        out.append(Child("PodGroup", names.podgroup(attempt)))
    return out


def store_is_managed(run: TrainingRun) -> bool:
    """In a cluster, a run without `store.url` gets a managed Redis (a file store cannot be shared by pods)."""
    return run.spec.store.managed or run.spec.store.url is None


def engine_is_managed(run: TrainingRun) -> bool:
    """The operator runs the run's vLLM server: generated rollouts with the vllm engine and no `engine.url`."""
    e = run.spec.rollout.engine
    return run.spec.rollout.source.type == "generate" and e.type == "vllm" and not e.url


def store_url(run: TrainingRun, namespace: str) -> str:
    if store_is_managed(run):
        return f"redis://{Names(run.metadata.name).store}.{namespace}.svc:{STORE_PORT}/0"
    url = run.spec.store.url
    assert url is not None
    if url.startswith("redis://") and "prefix=" not in url:
        # An external Redis may serve several runs: give each its own keys (trainingrun.<namespace>.<name>, and the
        # first 8 characters of the run's uid when known, so that a run deleted and re-created with the same name
        # starts a fresh stream instead of being fenced off by the old run's attempts) unless the URL names a prefix.
        prefix = f"trainingrun.{namespace}.{run.metadata.name}"
        uid = (run.metadata.model_extra or {}).get("uid")
        if isinstance(uid, str) and uid:
            prefix += "." + uid[:8]
        url += ("&" if "?" in url else "?") + f"prefix={prefix}"
    return url


def run_epoch(run: TrainingRun) -> int:
    """The run's creation time in unix seconds (metadata.creationTimestamp), 0 when unknown: TRAININGRUN_RUN_EPOCH."""
    from trainingrun.operator.observe import parse_time

    raw = (run.metadata.model_extra or {}).get("creationTimestamp")
    try:
        ts = parse_time(raw) if isinstance(raw, str) else None
    except ValueError:
        return 0
    return max(int(ts.timestamp()), 0) if ts is not None else 0


def master_addr(run: TrainingRun, namespace: str, attempt: int) -> str:
    return f"{Names.hostname(0, attempt)}.{Names(run.metadata.name).service}.{namespace}.svc"


def cluster_errors(run: TrainingRun) -> list[str]:
    """What is wrong with a schema-valid run for running in a cluster: one message per problem, naming the field,
    what was wrong and what is allowed. Empty when the run can be rendered."""
    errors: list[str] = []
    names = Names(run.metadata.name)
    for what, value in (("service", names.service), ("store service", names.store), ("engine service", names.engine)):
        if len(value) > 63 or not _DNS_LABEL.match(value):
            errors.append(
                f"metadata.name: {run.metadata.name!r} gives the {what} name {value!r}, which must be a DNS label "
                f"(at most 63 characters, starting with a letter); use a name of at most {63 - len(value) + len(run.metadata.name)} "
                "characters that starts with a letter"
            )
    try:
        run.spec.model.resolved(read_hf=False)  # the HF directory is on the pods' volume, not here
    except (ValueError, KeyError) as exc:
        errors.append(f"spec.model: {exc} (after applying preset {run.spec.model.preset!r})")
    config_dir = CONFIG_MOUNT_PATH.rsplit("/", 1)[0]
    for i, volume in enumerate(run.spec.pod_template.volumes):
        if volume.get("name") in (CONFIG_VOLUME, SHM_VOLUME):
            errors.append(f"spec.podTemplate.volumes[{i}].name: {volume.get('name')!r} is one of the operator's own "
                          f"volumes ({CONFIG_VOLUME!r}: the run's ConfigMap, {SHM_VOLUME!r}: /dev/shm); use another name")
    for i, mount in enumerate(run.spec.pod_template.volume_mounts):
        if str(mount.get("mountPath", "")).rstrip("/") == config_dir:
            errors.append(f"spec.podTemplate.volumeMounts[{i}].mountPath: {config_dir!r} is where the operator mounts "
                          "the run's manifest; use another path")
    url = run.spec.store.url
    if url is not None and url.startswith("file://"):
        errors.append(
            f"spec.store.url: {url!r} is a file store, which pods cannot share in a cluster; "
            "use a redis:// URL or store.managed: true"
        )
    return errors


def run_manifest(run: TrainingRun, namespace: str) -> dict[str, Any]:
    """The manifest the pods load from the ConfigMap (`trainingrun.api.load_trainingrun`)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": run.metadata.name, "namespace": namespace},
        "spec": run.spec.to_dict(),
    }


def plan_for(run: TrainingRun, namespace: str, attempt: int) -> RunPlan:
    return build_plan(
        run,
        store_url=store_url(run, namespace),
        config_path=CONFIG_MOUNT_PATH,
        master_addr=master_addr(run, namespace, attempt),
        master_port=DEFAULT_MASTER_PORT,
        attempt=attempt,
        epoch=run_epoch(run),
        extra_env={ENGINE_URL_ENV: engine_k8s.engine_url(Names(run.metadata.name).engine, namespace)}
        if engine_is_managed(run) else None,
    )


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


def _config_text(run: TrainingRun, namespace: str) -> str:
    return dump_yaml(run_manifest(run, namespace), sort_keys=False)


def config_hash(run: TrainingRun) -> str:
    """A short hash of the run's manifest (the ConfigMap's content, whatever the namespace)."""
    return hashlib.sha256(_config_text(run, "").encode()).hexdigest()[:16]


def render_config_map(run: TrainingRun, owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(Names(owner.name).config, owner, {**base_labels(owner.name), LABEL_ROLE: ROLE_CONFIG},
                          {ANNOTATION_CONFIG_HASH: config_hash(run)}),
        "data": {"run.yaml": _config_text(run, owner.namespace)},
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


def _pod_spec_common(run: TrainingRun) -> dict[str, Any]:
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
    provider = gang.provider(run)
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


def render_process_pod(run: TrainingRun, owner: Owner, process: ProcessPlan, attempt: int) -> dict[str, Any]:
    """The pod of one process of the plan (rollout or trainer rank)."""
    spec = run.spec
    names = Names(owner.name)
    t = spec.pod_template
    labels = {**t.labels, **base_labels(owner.name), LABEL_ROLE: process.role, LABEL_ATTEMPT: str(attempt)}
    annotations = dict(t.annotations)
    if process.rank is not None:
        labels[LABEL_RANK] = str(process.rank)
    provider = gang.provider(run)
    for extra_labels, extra_annotations in (
        provider.pod_metadata(names.podgroup(attempt)) if provider is not None else ({}, {}),
        gang.kueue_metadata(run, names.podgroup(attempt)),
    ):
        labels.update(extra_labels)
        annotations.update(extra_annotations)
    if process.role == ROLE_TRAINER:
        res = spec.trainer.resources
        resources = _resources(res.requests, res.limits, spec.trainer.gpus_per_replica)
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
        "env": [{"name": k, "value": v} for k, v in sorted(process.env.items())],
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
    if resources:
        container["resources"] = resources
    pod_spec = {
        **_pod_spec_common(run),
        "restartPolicy": "Never",  # restarts are the operator's: the whole group, with an attempt label
        "containers": [container],
        "volumes": [
            {"name": CONFIG_VOLUME, "configMap": {"name": names.config, "items": [{"key": "run.yaml", "path": "run.yaml"}]}},
            *t.volumes,
        ],
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
        "metadata": _meta(names.pod(process.role, process.rank, attempt), owner, labels, annotations),
        "spec": pod_spec,
    }


def render_pods(run: TrainingRun, owner: Owner, attempt: int) -> list[dict[str, Any]]:
    """Rollout pod first, then trainers by rank, for one attempt."""
    plan = plan_for(run, owner.namespace, attempt)
    return [render_process_pod(run, owner, p, attempt) for p in plan.processes]


def render_store(run: TrainingRun, owner: Owner, image: str = DEFAULT_REDIS_IMAGE) -> list[dict[str, Any]]:
    """Managed Redis: a Pod (restartPolicy Always, no persistence) and its Service; [] when the store is external."""
    if not store_is_managed(run):
        return []
    names = Names(owner.name)
    labels = {**base_labels(owner.name), LABEL_ROLE: ROLE_STORE}
    t = run.spec.pod_template
    common = _pod_spec_common(run)
    common.pop("schedulerName", None)  # the store is not part of the gang
    common["securityContext"] = {**common["securityContext"], "runAsUser": 999, "runAsGroup": 999, "fsGroup": 999}
    pod = {
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
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(names.store, owner, labels),
        "spec": {"selector": labels, "ports": [{"name": "redis", "port": STORE_PORT, "targetPort": STORE_PORT}]},
    }
    return [pod, service]


STORE_DEFAULT_RESOURCES = {"requests": {"cpu": "250m", "memory": "2Gi"}, "limits": {"memory": "2Gi"}}


def render_engine(run: TrainingRun, owner: Owner) -> list[dict[str, Any]]:
    """The run's vLLM server (`trainingrun.vllm.k8s`): its worker-extension ConfigMap, Pod (restartPolicy Always,
    the run's podTemplate volumes: model.hf and weightSync.path live there) and Service; [] when not managed."""
    if not engine_is_managed(run):
        return []
    names = Names(owner.name)
    labels = {**base_labels(owner.name), LABEL_ROLE: ROLE_ENGINE}
    t = run.spec.pod_template
    v = run.spec.rollout.engine.vllm
    common = _pod_spec_common(run)
    common.pop("schedulerName", None)  # a service of the run, not part of the attempt's gang
    container = engine_k8s.engine_container(run.spec, volume_mounts=list(t.volume_mounts),
                                            resources=_resources(v.resources.requests, v.resources.limits, v.gpus))
    container["securityContext"] = _container_security()
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(names.engine, owner, labels),
        "data": engine_k8s.extension_config_map_data(),
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _meta(names.engine, owner, {**t.labels, **labels}, dict(t.annotations) or None),
        "spec": {
            **common,
            "restartPolicy": "Always",
            "containers": [container],
            "volumes": [engine_k8s.extension_volume(names.engine), *t.volumes],
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(names.engine, owner, labels),
        "spec": {"selector": labels, "ports": [{"name": "http", "port": engine_k8s.ENGINE_PORT,
                                                 "targetPort": engine_k8s.ENGINE_PORT}]},
    }
    return [config_map, pod, service]


def _store_resources(run: TrainingRun) -> dict[str, Any]:
    """The managed Redis pod's resources: the spec's, or requests = limits for memory so it is not the first pod
    evicted under memory pressure (it holds every unconsumed rollout and the rollout's resume state)."""
    res = run.spec.store.resources
    return _resources(res.requests, res.limits, 0) or STORE_DEFAULT_RESOURCES


def render_podgroup(run: TrainingRun, owner: Owner, attempt: int) -> dict[str, Any] | None:
    """The attempt's PodGroup for its rollout + trainer pods (`trainingrun.operator.gang`), or None without gang
    scheduling."""
    provider = gang.provider(run)
    if provider is None:
        return None
    return {
        "apiVersion": provider.api_version,
        "kind": "PodGroup",
        "metadata": _meta(Names(owner.name).podgroup(attempt), owner,
                          {**base_labels(owner.name), LABEL_ATTEMPT: str(attempt)}),
        "spec": provider.podgroup_spec(run),
    }


def render_child(run: TrainingRun, owner: Owner, child: Child, attempt: int, *,
                 redis_image: str = DEFAULT_REDIS_IMAGE) -> dict[str, Any]:
    """The object of one `Child` of attempt `attempt`."""
    names = Names(owner.name)
    if child.kind in ("ConfigMap", "Service") and child.name == names.engine or child.role == ROLE_ENGINE:
        return next(o for o in render_engine(run, owner) if o["kind"] == child.kind)
    if child.kind == "ConfigMap":
        return render_config_map(run, owner)
    if child.kind == "Service":
        if child.name == names.service:
            return render_service(run, owner)
        return next(o for o in render_store(run, owner, redis_image) if o["kind"] == "Service")
    if child.kind == "PodGroup":
        pg = render_podgroup(run, owner, attempt)
        assert pg is not None, "a PodGroup child without gang scheduling"
        return pg
    if child.role == ROLE_STORE:
        return next(o for o in render_store(run, owner, redis_image) if o["kind"] == "Pod")
    plan = plan_for(run, owner.namespace, attempt)
    process = next(p for p in plan.processes if (p.role, p.rank) == (child.role, child.rank))
    return render_process_pod(run, owner, process, attempt)


def render_children(run: TrainingRun, owner: Owner, attempt: int, *, redis_image: str = DEFAULT_REDIS_IMAGE) -> list[dict]:
    """Every child of one attempt, in creation order: config, services, store, podgroup, then the pods."""
    children = base_children(run, attempt)
    children += [Child("Pod", Names(owner.name).pod(p.role, p.rank, attempt), role=p.role, rank=p.rank)
                 for p in plan_for(run, owner.namespace, attempt).processes]
    return [render_child(run, owner, c, attempt, redis_image=redis_image) for c in children]
