"""Group scheduling and placement of a run's pods, as small pluggable renderers (pure, like `render`).

Gang scheduling (`spec.gangScheduling`): per attempt, the objects of one provider named `R-a<k>`, holding the rollout
and every trainer (minMember / minCount = replicas + 1), so the scheduler places all of them or none. A provider is a
`GangProvider`: the API and kinds it creates (`kinds`, in creation order), their specs (`spec`), the pod
labels/annotations and pod spec fields that tie a pod to its group, and the schedulerName its pods need when the
spec sets none. `provider(run, kubernetes_version)` picks one; adding a scheduler is adding a provider here (and its
RBAC rule in `rbac.GANG_RULES`).

  volcano       scheduling.volcano.sh/v1beta1 PodGroup with minMember, minResources, queue
                (spec.gangScheduling.queue), priorityClassName (spec.podTemplate.priorityClassName) and, with
                spec.placement.<role>.volcano, a subGroupPolicy per role (networkTopology mode and highest tier, pods
                per sub-group, selected by the role label); pods annotated scheduling.k8s.io/group-name; schedulerName
                volcano
  coscheduling  scheduler-plugins' scheduling.x-k8s.io/v1alpha1 PodGroup with minMember and minResources; pods
                labelled scheduling.x-k8s.io/pod-group; the scheduler profile that runs the plugin is
                spec.schedulerName
  kubernetes    Kubernetes' own gang scheduling (KEP-4671), scheduling.k8s.io in the version the cluster serves —
                v1beta1 (1.37+) or v1alpha2 (1.36 with the GenericWorkload feature gate), found by discovery
                (`served_version`): a Workload with one PodGroupTemplate (gang minCount, the run's priority class,
                disruption mode "all pods together": the gang is preempted whole, never pod by pod) and a PodGroup
                created from it; pods linked by spec.schedulingGroup.podGroupName; the default scheduler

The run's own engine servers (`rollout.engine.replicas` pods, rendered by the engine table's `ServerPods`) are a
serving group of their own: the provider's objects named `R-engine` (PodGroup minMember / Workload minCount =
replicas, minResources = their requests) and, with Kueue, the pod group `R-engine` in the same LocalQueue. With
multi-node replicas (rollout.engine.vllm.nodes N > 1) one gang per replica instead, `R-engine-<i>` (`engine_group`):
its leader and workers, minMember / minCount / Kueue total count = N, minResources = N pods' requests — a replica
is placed whole or not at all, and one replaced or added never waits for the others. Not the
attempt's group: the engines outlive attempts (a restarted trainer group keeps them, and their minutes of model
loading), while an attempt's PodGroup and Kueue workload end with it. So the engines' GPUs are inside the run's Kueue
quota and gang-scheduled, without tying their lifetime to an attempt's.

Kueue (`spec.queueName`, `kueue_metadata`): Kueue's plain-pod integration admits a group of pods as one workload
when each carries the label kueue.x-k8s.io/queue-name (the LocalQueue), the label kueue.x-k8s.io/pod-group-name (the
group: per attempt, so a restarted group is a new workload) and the annotation
kueue.x-k8s.io/pod-group-total-count (how many pods the group has). Kueue's webhook gates such pods
(schedulingGates kueue.x-k8s.io/admission) until the workload is admitted. When an attempt ends (restart, suspend,
failure, success with the rollout still running) the operator annotates the pods it deletes with
kueue.x-k8s.io/retriable-in-group: "false" so Kueue finishes that workload and frees its quota instead of waiting
for replacement pods; a rollout restarted alone is such a replacement (same group, never annotated). Kueue preempting
the group marks the pods TerminationTarget (StoppedByKueue): a disruption.

Placement (`spec.placement.<role>`, `placement_metadata`): Kueue's Topology Aware Scheduling annotations on the
role's pods (kueue.x-k8s.io/podset-required-topology, -preferred-topology, -slice-required-topology + -slice-size),
trainers labelled with their rank as kueue.x-k8s.io/pod-group-pod-index so Kueue places consecutive ranks together;
or Volcano's network topology (the PodGroup's subGroupPolicy, above).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from trainingrun.api.constants import GROUP, KIND, LABEL_ROLE, ROLE_ROLLOUT, ROLE_TRAINER
from trainingrun.api.models import TrainingRun
from trainingrun.engines.table import server_kind

GPU_RESOURCE = "nvidia.com/gpu"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_RETRIABLE_ANNOTATION = "kueue.x-k8s.io/retriable-in-group"
KUEUE_POD_INDEX_LABEL = "kueue.x-k8s.io/pod-group-pod-index"
KUEUE_REQUIRED_TOPOLOGY = "kueue.x-k8s.io/podset-required-topology"
KUEUE_PREFERRED_TOPOLOGY = "kueue.x-k8s.io/podset-preferred-topology"
KUEUE_SLICE_TOPOLOGY = "kueue.x-k8s.io/podset-slice-required-topology"
KUEUE_SLICE_SIZE = "kueue.x-k8s.io/podset-slice-size"

SCHEDULING_GROUP = "scheduling.k8s.io"
# the versions of scheduling.k8s.io whose Workload + PodGroup this operator renders, most preferred first
SCHEDULING_VERSIONS = ("v1beta1", "v1alpha2")
TEMPLATE = "group"  # the one PodGroupTemplate of a run's Workload


def group_size(run: TrainingRun, *, engines: bool = False) -> int:
    """The pods of one attempt's gang: the rollout and every trainer; with `engines` the engines' serving group:
    every engine replica, or with multi-node replicas one replica's pods (rollout.engine.vllm.nodes)."""
    if not engines:
        return run.spec.trainer.replicas + 1
    nodes = _pods_per_replica(run)
    return nodes if nodes > 1 else run.spec.rollout.engine.replicas


def engine_group(run: TrainingRun, engine: str, replica: int) -> str:
    """The name of the engines' serving group that holds `replica` (`engine`: the R-engine name): R-engine for the
    whole pool, R-engine-<i> per multi-node replica."""
    return f"{engine}-{replica}" if _pods_per_replica(run) > 1 else engine


def engine_groups(run: TrainingRun, engine: str, replicas: int) -> list[tuple[int | None, str]]:
    """(replica or None for the whole pool, name) of every engines' serving group of a run with `replicas`."""
    if _pods_per_replica(run) > 1:
        return [(i, f"{engine}-{i}") for i in range(replicas)]
    return [(None, engine)]


def _pods_per_replica(run: TrainingRun) -> int:
    servers = server_kind(run.spec)
    return servers.pods.nodes(run.spec) if servers is not None else 1


@dataclass(frozen=True)
class GangProvider:
    """How one gang scheduler groups pods."""

    name: str
    api_version: str
    scheduler_name: str | None  # pods' schedulerName when spec.schedulerName is unset
    group_label: str | None = None  # pod label naming the group
    group_annotation: str | None = None  # pod annotation naming the group
    kinds: tuple[str, ...] = ("PodGroup",)  # the objects of one attempt, in creation order

    def spec(self, kind: str, run: TrainingRun, group: str, *, engines: bool = False) -> dict[str, Any]:
        """The spec of the `kind` object named `group`: the attempt's (rollout + trainers), or with `engines` the
        engines' serving group."""
        spec: dict[str, Any] = {"minMember": group_size(run, engines=engines)}
        resources = engine_min_resources(run) if engines else min_resources(run)
        if resources:
            spec["minResources"] = resources
        return spec

    def pod_metadata(self, group: str) -> tuple[dict[str, str], dict[str, str]]:
        """(labels, annotations) that put a pod into group `group`."""
        labels = {self.group_label: group} if self.group_label else {}
        annotations = {self.group_annotation: group} if self.group_annotation else {}
        return labels, annotations

    def pod_spec(self, group: str) -> dict[str, Any]:
        """Pod spec fields that put a pod into group `group`."""
        return {}


@dataclass(frozen=True)
class VolcanoProvider(GangProvider):
    def spec(self, kind: str, run: TrainingRun, group: str, *, engines: bool = False) -> dict[str, Any]:
        spec = super().spec(kind, run, group, engines=engines)
        if run.spec.gang_scheduling.queue:
            spec["queue"] = run.spec.gang_scheduling.queue
        if run.spec.pod_template.priority_class_name:
            spec["priorityClassName"] = run.spec.pod_template.priority_class_name
        policies = []
        for role in (ROLE_ROLLOUT, ROLE_TRAINER) if not engines else ():
            topo = getattr(run.spec.placement, role).volcano
            if topo is None:
                continue
            network: dict[str, Any] = {"mode": topo.mode}
            if topo.highest_tier_allowed is not None:
                network["highestTierAllowed"] = topo.highest_tier_allowed
            if topo.highest_tier_name is not None:
                network["highestTierName"] = topo.highest_tier_name
            pods = run.spec.trainer.replicas if role == ROLE_TRAINER else 1
            policies.append({"name": role, "networkTopology": network, "subGroupSize": topo.sub_group_size or pods,
                             "labelSelector": {"matchLabels": {LABEL_ROLE: role}}})
        if policies:
            spec["subGroupPolicy"] = policies
        return spec


@dataclass(frozen=True)
class KubernetesProvider(GangProvider):
    """scheduling.k8s.io's Workload + PodGroup (see the module docstring); `api_version` is the served one."""

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]

    def _policy(self, run: TrainingRun, engines: bool) -> dict[str, Any]:
        """What the template and the PodGroup both carry: the gang, the priority class, whole-gang disruption."""
        out: dict[str, Any] = {"schedulingPolicy": {"gang": {"minCount": group_size(run, engines=engines)}},
                               # v1beta1: a union {all: {}} | {single: {}}; v1alpha2: "PodGroup" | "Pod"
                               "disruptionMode": {"all": {}} if self.version == "v1beta1" else "PodGroup"}
        if run.spec.pod_template.priority_class_name:
            out["priorityClassName"] = run.spec.pod_template.priority_class_name
        return out

    def spec(self, kind: str, run: TrainingRun, group: str, *, engines: bool = False) -> dict[str, Any]:
        if kind == "Workload":
            return {"controllerRef": {"apiGroup": GROUP, "kind": KIND, "name": run.metadata.name},
                    "podGroupTemplates": [{"name": TEMPLATE, **self._policy(run, engines)}]}
        ref = ({"workloadRef": {"workloadName": group, "templateName": TEMPLATE}} if self.version == "v1beta1" else
               {"podGroupTemplateRef": {"workload": {"workloadName": group, "podGroupTemplateName": TEMPLATE}}})
        return {**ref, **self._policy(run, engines)}

    def pod_spec(self, group: str) -> dict[str, Any]:
        return {"schedulingGroup": {"podGroupName": group}}


PROVIDERS: dict[str, GangProvider] = {
    "volcano": VolcanoProvider(name="volcano", api_version="scheduling.volcano.sh/v1beta1", scheduler_name="volcano",
                               group_annotation="scheduling.k8s.io/group-name"),
    "coscheduling": GangProvider(name="coscheduling", api_version="scheduling.x-k8s.io/v1alpha1",
                                 scheduler_name=None, group_label="scheduling.x-k8s.io/pod-group"),
}


def provider(run: TrainingRun, kubernetes_version: str | None = None) -> GangProvider | None:
    """The run's gang provider (None without gang scheduling). `kubernetes_version`: the scheduling.k8s.io version
    the cluster serves (`served_version`; the provider kubernetes renders it, v1beta1 when not known)."""
    gang = run.spec.gang_scheduling
    if not gang.enabled:
        return None
    if gang.provider == "kubernetes":
        version = kubernetes_version or SCHEDULING_VERSIONS[0]
        return KubernetesProvider(name="kubernetes", api_version=f"{SCHEDULING_GROUP}/{version}", scheduler_name=None,
                                  kinds=("Workload", "PodGroup"))
    return PROVIDERS[gang.provider]


def served_version(resources: Mapping[str, Sequence[str]]) -> str | None:
    """The scheduling.k8s.io version to use, from discovery: {version: the resource names it serves} (what
    /apis/scheduling.k8s.io/<version> lists). The first of SCHEDULING_VERSIONS serving both workloads and
    podgroups; None when none does."""
    for version in SCHEDULING_VERSIONS:
        if {"workloads", "podgroups"} <= set(resources.get(version, ())):
            return version
    return None


def not_served_message(run: TrainingRun) -> str:
    """Why the provider's objects cannot be created, for a cluster that does not serve its API."""
    p = provider(run)
    assert p is not None
    if p.name == "kubernetes":
        return (f"spec.gangScheduling.provider kubernetes: this cluster serves no {SCHEDULING_GROUP} Workload and "
                f"PodGroup in {' or '.join(SCHEDULING_VERSIONS)} (Kubernetes 1.37+, or 1.36 with the GenericWorkload "
                "feature gate and the scheduling.k8s.io/v1alpha2 API enabled); the run waits until it does (or turn "
                "gang scheduling off, or pick provider volcano or coscheduling)")
    return (f"the PodGroup API {p.api_version} is not served by this cluster (spec.gangScheduling: install "
            f"{p.name} or turn gang scheduling off)")


def min_resources(run: TrainingRun) -> dict[str, str]:
    """The sum of the requests of the rollout and every trainer pod (requests default to limits, as in a Pod)."""
    t, r = run.spec.trainer, run.spec.rollout
    pods = [({**t.resources.limits, **t.resources.requests}, t.replicas), ({**r.resources.limits,
                                                                           **r.resources.requests}, 1)]
    if t.gpus_per_replica > 0 and not t.resource_claims:  # DRA claims: the scheduler counts the claimed devices
        pods[0][0][GPU_RESOURCE] = t.gpus_per_replica
    return _sum_requests(pods)


def engine_min_resources(run: TrainingRun) -> dict[str, str]:
    """The sum of the requests of the run's engine pods (their GPUs included)."""
    servers = server_kind(run.spec)
    assert servers is not None, "engine pods of an engine in the rollout process"
    requests, limits, gpus = servers.pods.resources(run.spec)
    requests = {**limits, **requests}
    if gpus > 0:
        requests[GPU_RESOURCE] = gpus
    return _sum_requests([(requests, group_size(run, engines=True))])


def _sum_requests(pods: list[tuple[dict, int]]) -> dict[str, str]:
    from kubernetes.utils.quantity import parse_quantity  # deferred: kubernetes (the operator only)

    total: dict[str, Decimal] = {}
    for requests, count in pods:
        for name, quantity in requests.items():
            total[name] = total.get(name, Decimal(0)) + parse_quantity(quantity) * count
    return {name: _quantity(value) for name, value in sorted(total.items())}


def _quantity(value: Decimal) -> str:
    """A quantity string: whole numbers as they are, fractions in milli-units (cpu 2.5 → 2500m)."""
    if value == value.to_integral_value():
        return str(int(value))
    return f"{int((value * 1000).to_integral_value())}m"


def kueue_metadata(run: TrainingRun, group: str, *, engines: bool = False) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) of Kueue's plain-pod group integration (the attempt's group, or with `engines` the
    engines' own); empty without spec.queueName."""
    if not run.spec.queue_name:
        return {}, {}
    return ({KUEUE_QUEUE_LABEL: run.spec.queue_name, KUEUE_GROUP_LABEL: group},
            {KUEUE_TOTAL_ANNOTATION: str(group_size(run, engines=engines))})


def placement_metadata(run: TrainingRun, role: str, rank: int | None) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) of Kueue's Topology Aware Scheduling for a pod of `role` (spec.placement.<role>.kueue;
    empty without it): the topology annotations, and a trainer's rank as its index in the pod group."""
    topo = getattr(run.spec.placement, role).kueue if role in (ROLE_ROLLOUT, ROLE_TRAINER) else None
    if topo is None:
        return {}, {}
    annotations = {key: value for key, value in ((KUEUE_REQUIRED_TOPOLOGY, topo.required),
                                                 (KUEUE_PREFERRED_TOPOLOGY, topo.preferred),
                                                 (KUEUE_SLICE_TOPOLOGY, topo.slice_required)) if value}
    if topo.slice_size is not None:
        annotations[KUEUE_SLICE_SIZE] = str(topo.slice_size)
    labels = {KUEUE_POD_INDEX_LABEL: str(rank)} if role == ROLE_TRAINER and rank is not None else {}
    return labels, annotations
