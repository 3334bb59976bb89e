"""Group scheduling of a run's pods, as small pluggable renderers (pure, like `render`).

Gang scheduling (`spec.gangScheduling`): one PodGroup per attempt, named `R-a<k>`, holding the rollout and every
trainer (minMember = replicas + 1, minResources = the sum of their requests), so the scheduler places all of them or
none. A provider is a `GangProvider`: the PodGroup API it creates, the pod labels/annotations that tie a pod to its
group, and the schedulerName its pods need when the spec sets none. `PROVIDERS` maps `spec.gangScheduling.provider`
to one; adding a scheduler is adding a provider here (and its RBAC rule in `rbac.GANG_RULES`).

  volcano       scheduling.volcano.sh/v1beta1 PodGroup with minMember, minResources, queue
                (spec.gangScheduling.queue) and priorityClassName (spec.podTemplate.priorityClassName); pods
                annotated scheduling.k8s.io/group-name; schedulerName volcano
  coscheduling  scheduler-plugins' scheduling.x-k8s.io/v1alpha1 PodGroup with minMember and minResources; pods
                labelled scheduling.x-k8s.io/pod-group; the scheduler profile that runs the plugin is
                spec.schedulerName

The run's own vLLM engines (`rollout.engine.replicas` pods, `trainingrun.vllm.k8s`) are a serving group of their
own: PodGroup `R-engine` (minMember = replicas, minResources = their requests) and, with Kueue, the pod group
`R-engine` in the same LocalQueue. Not the attempt's group: the engines outlive attempts (a restarted trainer group
keeps them, and their minutes of model loading), while an attempt's PodGroup and Kueue workload end with it. So the
engines' GPUs are inside the run's Kueue quota and gang-scheduled, without tying their lifetime to an attempt's.

Kueue (`spec.queueName`, `kueue_metadata`): Kueue's plain-pod integration admits a group of pods as one workload
when each carries the label kueue.x-k8s.io/queue-name (the LocalQueue), the label kueue.x-k8s.io/pod-group-name (the
group: per attempt, so a restarted group is a new workload) and the annotation
kueue.x-k8s.io/pod-group-total-count (how many pods the group has). Kueue's webhook gates such pods
(schedulingGates kueue.x-k8s.io/admission) until the workload is admitted. When an attempt ends (restart, suspend,
failure, success with the rollout still running) the operator annotates the pods it deletes with
kueue.x-k8s.io/retriable-in-group: "false" so Kueue finishes that workload and frees its quota instead of waiting
for replacement pods. Kueue preempting the group marks the pods TerminationTarget (StoppedByKueue): a disruption.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from trainingrun.api.models import TrainingRun

GPU_RESOURCE = "nvidia.com/gpu"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_RETRIABLE_ANNOTATION = "kueue.x-k8s.io/retriable-in-group"


@dataclass(frozen=True)
class GangProvider:
    """How one gang scheduler groups pods."""

    name: str
    api_version: str
    scheduler_name: str | None  # pods' schedulerName when spec.schedulerName is unset
    group_label: str | None = None  # pod label naming the group
    group_annotation: str | None = None  # pod annotation naming the group

    def podgroup_spec(self, run: TrainingRun, *, engines: bool = False) -> dict[str, Any]:
        """The attempt's PodGroup (rollout + trainers), or with `engines` the engines' serving group."""
        spec: dict[str, Any] = {"minMember": run.spec.rollout.engine.replicas if engines
                                else run.spec.trainer.replicas + 1}
        resources = engine_min_resources(run) if engines else min_resources(run)
        if resources:
            spec["minResources"] = resources
        return spec

    def pod_metadata(self, group: str) -> tuple[dict[str, str], dict[str, str]]:
        """(labels, annotations) that put a pod into PodGroup `group`."""
        labels = {self.group_label: group} if self.group_label else {}
        annotations = {self.group_annotation: group} if self.group_annotation else {}
        return labels, annotations


@dataclass(frozen=True)
class VolcanoProvider(GangProvider):
    def podgroup_spec(self, run: TrainingRun, *, engines: bool = False) -> dict[str, Any]:
        spec = super().podgroup_spec(run, engines=engines)
        if run.spec.gang_scheduling.queue:
            spec["queue"] = run.spec.gang_scheduling.queue
        if run.spec.pod_template.priority_class_name:
            spec["priorityClassName"] = run.spec.pod_template.priority_class_name
        return spec


PROVIDERS: dict[str, GangProvider] = {
    "volcano": VolcanoProvider(name="volcano", api_version="scheduling.volcano.sh/v1beta1", scheduler_name="volcano",
                               group_annotation="scheduling.k8s.io/group-name"),
    "coscheduling": GangProvider(name="coscheduling", api_version="scheduling.x-k8s.io/v1alpha1",
                                 scheduler_name=None, group_label="scheduling.x-k8s.io/pod-group"),
}


def provider(run: TrainingRun) -> GangProvider | None:
    gang = run.spec.gang_scheduling
    return PROVIDERS[gang.provider] if gang.enabled else None


def min_resources(run: TrainingRun) -> dict[str, str]:
    """The sum of the requests of the rollout and every trainer pod (requests default to limits, as in a Pod)."""
    t, r = run.spec.trainer, run.spec.rollout
    pods = [({**t.resources.limits, **t.resources.requests}, t.replicas), ({**r.resources.limits,
                                                                           **r.resources.requests}, 1)]
    if t.gpus_per_replica > 0:
        pods[0][0][GPU_RESOURCE] = t.gpus_per_replica
    return _sum_requests(pods)


def engine_min_resources(run: TrainingRun) -> dict[str, str]:
    """The sum of the requests of the run's engine pods (their GPUs included)."""
    v = run.spec.rollout.engine.vllm
    requests = {**v.resources.limits, **v.resources.requests}
    if v.gpus > 0:
        requests[GPU_RESOURCE] = v.gpus
    return _sum_requests([(requests, run.spec.rollout.engine.replicas)])


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
    total = run.spec.rollout.engine.replicas if engines else run.spec.trainer.replicas + 1
    return ({KUEUE_QUEUE_LABEL: run.spec.queue_name, KUEUE_GROUP_LABEL: group},
            {KUEUE_TOTAL_ANNOTATION: str(total)})
