"""The operator's vocabulary: who owns a run's children, what they are called, which of them a run has, and the few
values derived from a run that several modules need (its store URL, its epoch, the hash of its ConfigMap). Pure, no
I/O; `status` decides with it, `render` renders with it, `checks` checks with it, `handlers` acts with it.

  Owner          the TrainingRun that owns the children (the ownerReference every child carries)
  Names          the children's names: R-config, R-trainers, R-store, R-engine (the engines' ConfigMap, headless
                 Service and serving gang objects; R-engine-<i> the gang of multi-node replica i), R-a<k> (PodGroup, Workload), pods R-rollout-a<k>,
                 R-trainer-<i>-a<k> and R-engine-<i> (engine replica i), trainer hostnames trainer-<i>-a<k>, engine
                 hostnames engine-<i>; a worker pod j of a multi-node engine replica (rollout.engine.vllm.nodes)
                 R-engine-<i>-n<j>, hostname engine-<i>-n<j>; a rollout or engine pod restarted alone carries its
                 generation: R-rollout-a<k>-r<g>, R-engine-<i>-r<g>, R-engine-<i>-n<j>-r<g>
  Child          one child by kind, name and role (the role label of the object: config, trainer, store, engine,
                 rollout; a PodGroup has none), rank (trainer pods; an engine's replica) and generation
  base_children  what an attempt's pods need before they are created, in creation order
  engine_child   the engine pod of one replica's node in one generation (engine_replicas: how many replicas the run
                 has; engine_nodes: pods per replica, a leader and its workers)
  store_url      the run's store as the pods see it; run_epoch its creation time; config_hash the ConfigMap's content
  config_data    the ConfigMap's keys: run.yaml, and `engines` (the engine pool's URLs, one a line, that the rollout
                 re-reads: a resize reaches it without a restart)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from trainingrun.api.constants import (
    API_VERSION,
    APP,
    LABEL_NAME,
    LABEL_ROLE,
    LABEL_RUN,
    GROUP_ROLES,
    KIND,
    ROLE_CONFIG,
    ROLE_ENGINE,
    ROLE_STORE,
    ROLE_TRAINER,
)
from trainingrun.api.models import TrainingRun
from trainingrun.api.yamlcodec import dump_yaml
from trainingrun.engines.table import own_servers, server_kind
from trainingrun.operator import gang
from trainingrun.operator.observe import parse_time
from trainingrun.plan import engine_name

STORE_PORT = 6379
CONFIG_VOLUME = "config"  # pod volume of the run's ConfigMap (reserved: podTemplate.volumes may not use it)
SHM_VOLUME = "dshm"  # memory-backed /dev/shm of multi-worker trainer pods (reserved too)


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
        """The engines' ConfigMap, headless Service and serving gang objects."""
        return f"{self.run}-engine"

    def podgroup(self, attempt: int) -> str:
        return f"{self.run}-a{attempt}"

    def is_podgroup(self, name: str) -> bool:
        """Whether `name` is one of this run's gang objects (of any attempt, or the engines' serving groups)."""
        prefix = f"{self.run}-a"
        return self.is_engine_group(name) or (name.startswith(prefix) and name[len(prefix):].isdigit())

    def is_engine_group(self, name: str) -> bool:
        """Whether `name` is an engines' serving group: R-engine, or R-engine-<i> (one per multi-node replica)."""
        prefix = f"{self.engine}-"
        return name == self.engine or (name.startswith(prefix) and name[len(prefix):].isdigit())

    def pod(self, role: str, rank: int | None, attempt: int, generation: int = 0) -> str:
        """A rollout or trainer pod of attempt `attempt`; a rollout restarted alone gets `-r<generation>`."""
        base = f"{self.run}-{role}-a{attempt}" if rank is None else f"{self.run}-{role}-{rank}-a{attempt}"
        return base if generation == 0 else f"{base}-r{generation}"

    def engine_pod(self, replica: int, generation: int = 0, node: int = 0) -> str:
        """Engine replica `replica`: R-engine-<i> (as the local launcher's engine-<i>; its leader), R-engine-<i>-n<j>
        its worker j, `-r<generation>` once it was restarted alone (a replacement never waits for its predecessor's
        name)."""
        base = f"{self.engine}-{replica}" + (f"-n{node}" if node else "")
        return base if generation == 0 else f"{base}-r{generation}"

    @staticmethod
    def engine_hostname(replica: int, node: int = 0) -> str:
        """Engine replica i's hostname under the headless Service: engine-<i>.R-engine.NS.svc (its leader), the same
        in every generation (the rollout's URL of it never changes): the plan's name of the replica; its worker j:
        engine-<i>-n<j>."""
        return engine_name(replica) + (f"-n{node}" if node else "")

    @staticmethod
    def hostname(rank: int, attempt: int) -> str:
        """A trainer pod's hostname: per attempt, so the rendezvous name never resolves to an older attempt's pod."""
        return f"trainer-{rank}-a{attempt}"


@dataclass(frozen=True)
class Child:
    """One child object of a run, by kind and name; `role` is the role label the object carries (None: a PodGroup),
    `rank` a trainer pod's rank."""

    kind: str  # ConfigMap, Service, Pod, PodGroup, Workload
    name: str
    role: str | None = None
    rank: int | None = None  # a trainer's rank; an engine's replica
    generation: int = 0  # rollout and engine pods: the role's generation (restarts of the role alone)
    node: int = 0  # engine pods: the node within the replica (0: the leader)

    @property
    def key(self) -> str:
        return f"{self.kind}/{self.name}"

    @property
    def group_pod(self) -> bool:
        """A rollout or trainer pod of the attempt (the others are what those pods need, or outlive attempts)."""
        return self.kind == "Pod" and self.role in GROUP_ROLES


def store_is_managed(run: TrainingRun) -> bool:
    """In a cluster, a run without `store.url` gets a managed Redis (a file store cannot be shared by pods)."""
    return run.spec.store.managed or run.spec.store.url is None


def engine_is_managed(run: TrainingRun) -> bool:
    """The operator runs the run's engine servers (`trainingrun.engines.table.own_servers`: generated rollouts with
    an engine served by servers, e.g. vllm, and no `engine.url`)."""
    return own_servers(run.spec) > 0


def base_children(run: TrainingRun, attempt: int) -> list[Child]:
    """What the attempt's pods need before they are created, in creation order (plus the managed store's pod)."""
    names = Names(run.metadata.name)
    out = [Child("ConfigMap", names.config, role=ROLE_CONFIG), Child("Service", names.service, role=ROLE_TRAINER)]
    if store_is_managed(run):
        out += [Child("Service", names.store, role=ROLE_STORE), Child("Pod", names.store, role=ROLE_STORE)]
    provider = gang.provider(run)
    if engine_is_managed(run):
        out += [Child("ConfigMap", names.engine, role=ROLE_ENGINE), Child("Service", names.engine, role=ROLE_ENGINE)]
        if provider is not None:  # the engines' own (serving) groups: they outlive attempts
            out += [Child(kind, name, role=ROLE_ENGINE, rank=replica)
                    for replica, name in gang.engine_groups(run, names.engine, engine_replicas(run))
                    for kind in provider.kinds]
    if provider is not None:
        out += [Child(kind, names.podgroup(attempt)) for kind in provider.kinds]
    return out


def engine_replicas(run: TrainingRun) -> int:
    """How many engine pods the operator runs for the run: spec.rollout.engine.replicas (0 when it runs none)."""
    return own_servers(run.spec)


def engine_selector(run_name: str) -> dict[str, str]:
    """The labels of the run's engine pods (status.engineSelector, the scale subresource's selector)."""
    return {LABEL_NAME: APP, LABEL_RUN: run_name, LABEL_ROLE: ROLE_ENGINE}


def engine_nodes(run: TrainingRun) -> int:
    """The pods of one engine replica: a leader (node 0) and its workers (rollout.engine.vllm.nodes; 1 when the run
    runs no engine of its own)."""
    servers = server_kind(run.spec)
    return servers.pods.nodes(run.spec) if servers is not None and engine_is_managed(run) else 1


def engine_child(run: TrainingRun, replica: int, generation: int, node: int = 0) -> Child:
    """The engine pod of `replica`'s `node` in its `generation`."""
    return Child("Pod", Names(run.metadata.name).engine_pod(replica, generation, node), role=ROLE_ENGINE,
                 rank=replica, generation=generation, node=node)


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
    raw = (run.metadata.model_extra or {}).get("creationTimestamp")
    try:
        ts = parse_time(raw) if isinstance(raw, str) else None
    except ValueError:
        return 0
    return max(int(ts.timestamp()), 0) if ts is not None else 0


def master_addr(run: TrainingRun, namespace: str, attempt: int) -> str:
    """Trainer 0 of the attempt, as every trainer of it resolves it (the headless Service's per-attempt hostname)."""
    return f"{Names.hostname(0, attempt)}.{Names(run.metadata.name).service}.{namespace}.svc"


def run_manifest(run: TrainingRun, namespace: str) -> dict[str, Any]:
    """The manifest the pods load from the ConfigMap (`trainingrun.api.load_trainingrun`)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": run.metadata.name, "namespace": namespace},
        "spec": run.spec.to_dict(),
    }


def config_text(run: TrainingRun, namespace: str) -> str:
    """The ConfigMap's run.yaml."""
    return dump_yaml(run_manifest(run, namespace), sort_keys=False)


ENGINES_KEY = "engines"  # the ConfigMap key (and file beside run.yaml) of the engine pool's URLs


def engine_urls(run: TrainingRun, namespace: str) -> list[str]:
    """The URLs of the run's own engine replicas (spec.rollout.engine.replicas of them; [] when it runs none)."""
    servers = server_kind(run.spec)
    if not engine_is_managed(run) or servers is None:
        return []
    return servers.pods.urls(Names(run.metadata.name).engine, namespace, engine_replicas(run)).split(",")


def config_data(run: TrainingRun, namespace: str) -> dict[str, str]:
    """The run's ConfigMap: run.yaml, and with the run's own engines the pool's URLs (ENGINES_KEY), one a line."""
    data = {"run.yaml": config_text(run, namespace)}
    urls = engine_urls(run, namespace)
    if urls:
        data[ENGINES_KEY] = "".join(f"{u}\n" for u in urls)
    return data


def config_hash(run: TrainingRun) -> str:
    """A short hash of the ConfigMap's content (whatever the namespace): a resize changes it, and so does a missing
    `engines` key (a ConfigMap of an operator before it: updated, so a rollout pod that mounts the key can start).
    Without engines of its own, the hash of run.yaml alone (as before)."""
    data = config_data(run, "")
    text = data["run.yaml"] + (f"\n{ENGINES_KEY}:\n{data[ENGINES_KEY]}" if ENGINES_KEY in data else "")
    return hashlib.sha256(text.encode()).hexdigest()[:16]
