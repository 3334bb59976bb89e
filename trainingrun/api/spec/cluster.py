"""How a run lives in a cluster: its failure policy (`spec.failurePolicy`: restarts, rules, role budgets), the pod
settings of every pod (`spec.podTemplate`), gang scheduling and topology-aware placement (Kueue, Volcano)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from trainingrun.api.spec.base import INT64_MAX, MAX_SECONDS, ApiModel, Rule


class FailureRule(ApiModel):
    """One rule of the failure policy (`trainingrun.failure_policy`): `action` for a failure that matches every
    condition given (a condition left out matches anything); the first rule that matches decides."""

    CEL_RULES = (
        Rule(
            name="restart-role-names-a-role",
            rule="self.action != 'RestartRole' || (has(self.roles) && size(self.roles) > 0 && !('trainer' in "
            "self.roles))",
            message="action RestartRole restarts the rollout or one engine replica alone: give roles [rollout] and/or "
            "[engine]; the trainers are one torch.distributed group fenced by the attempt number, so a trainer failure "
            "restarts the group (RestartGroup), fails the run (FailRun) or uses no restart (Ignore)",
            fieldPath=".roles",
        ),
    )

    name: str | None = Field(None, min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                             description="A name for events and messages (optional).")
    roles: list[Literal["rollout", "trainer", "engine"]] = Field(
        default_factory=list, max_length=3, description="The failed process's role; empty: any role.")
    exit_codes: list[Annotated[int, Field(ge=1, le=255)]] = Field(
        default_factory=list, max_length=32, description="Exit codes as a container reports them (a process killed "
        "by signal N: 128 + N, e.g. 137 for SIGKILL); empty: any code.")
    reasons: list[Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z][A-Za-z0-9]*$")]] = Field(
        default_factory=list, max_length=32, description="Any of these reasons: the container's (OOMKilled, Error, "
        "...), the pod's (Evicted, DeadlineExceeded, ...), a disruption condition's (DisruptionTarget, "
        "EvictionByEvictionAPI, PreemptionByScheduler, TerminationTarget, ...) or the policy's own (Disrupted, "
        "Deleted, ProgressDeadlineExceeded, Signal); empty: any reason.")
    action: Literal["RestartGroup", "RestartRole", "FailRun", "Ignore"] = Field(
        ..., description="RestartGroup: the rollout and the trainers restart as the next attempt (maxRestarts); "
        "RestartRole: the rollout or the failed engine replica restarts alone (the role's budget); FailRun: the run "
        "fails; Ignore: restarted as the role's default does, using no budget.")

    @model_validator(mode="after")
    def _rules(self) -> FailureRule:
        if self.action == "RestartRole" and (not self.roles or "trainer" in self.roles):
            raise ValueError(self.cel_rule("restart-role-names-a-role").message)
        return self


class RoleBudget(ApiModel):
    """Restarts of one role alone (RestartRole): how many, and the backoff before each."""

    max_restarts: int | None = Field(
        None, ge=0, le=1000, description="Restarts of this role alone (all its replicas together) before the run "
        "fails; unset: failurePolicy.maxRestarts.")
    backoff_seconds: int | None = Field(
        None, ge=0, le=86400, description="Wait before such a restart, doubling like the group's; unset: "
        "failurePolicy.backoffSeconds.")


class RoleBudgets(ApiModel):
    """The budgets of the roles that restart alone."""

    rollout: RoleBudget = Field(default_factory=RoleBudget, description="The rollout process (pod).")
    engine: RoleBudget = Field(default_factory=RoleBudget, description="The run's vLLM server(s).")


class FailurePolicy(ApiModel):
    """What happens when a pod fails or the run stops making progress (`trainingrun.failure_policy`)."""

    max_restarts: int = Field(
        3, ge=0, le=1000, description="Whole-group restarts after application failures before the run is Failed; "
        "evicted or preempted pods restart the group without using one (counted in status.disruptions).")
    backoff_seconds: int = Field(
        10, ge=0, le=86400, description="Wait before a restart: backoffSeconds after a disruption; after the n-th "
        "counted restart backoffSeconds × 2^(n-1), at most max(backoffSeconds, 360).")
    progress_deadline_seconds: int | None = Field(
        None, ge=1, le=MAX_SECONDS,
        description="No new step for this long counts as a failure (hang detection); time in which the operator could "
        "not read progress from the store does not count. Unset: off."
    )
    terminating_timeout_seconds: int = Field(
        120, ge=0, le=MAX_SECONDS, description="How long pods of an older attempt that are still terminating (e.g. on a "
        "lost node) may delay a restart; after it they no longer block the next attempt (the message names them).")
    rules: list[FailureRule] = Field(
        default_factory=list, max_length=32, description="Rules by role, exit code and reason, tried in order before "
        "the default rules (a disruption uses no restart; exit code 78 fails the run; the rollout and an engine "
        "restart alone; anything else restarts the group); the first that matches decides.")
    roles: RoleBudgets = Field(default_factory=RoleBudgets, description="Budgets of restarting one role alone.")


class Toleration(ApiModel):
    """A pod toleration (core/v1 Toleration)."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)


class PodTemplateOverrides(ApiModel):
    """Pod settings applied to every pod of the run (rollout and trainers)."""

    CEL_RULES = (
        Rule(
            name="mounts-name-volumes",
            rule="(!has(self.volumes) || self.volumes.all(v, has(v.name))) && (!has(self.volumeMounts) ||"
            " self.volumeMounts.all(m, has(m.name) && has(m.mountPath) && has(self.volumes)"
            " && self.volumes.exists(v, has(v.name) && v.name == m.name)))",
            message="every volume needs a name; every volumeMount needs name and mountPath, and names a volume "
            "of podTemplate.volumes",
            fieldPath=".volumeMounts",
        ),
    )

    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Pod tolerations.")
    affinity: dict[str, Any] | None = Field(None, description="Pod affinity (core/v1 Affinity), passed through.")
    priority_class_name: str | None = Field(None, description="Pod priorityClassName.")
    service_account_name: str | None = Field(None, description="Pod serviceAccountName.")
    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra pod annotations.")
    volumes: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Pod volumes (core/v1 Volume), e.g. a ReadWriteMany claim for checkpoints or rollout data.",
    )
    volume_mounts: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Mounts (core/v1 VolumeMount) added to every container, e.g. at trainer.checkpoint.path.",
    )

    @model_validator(mode="after")
    def _rules(self) -> PodTemplateOverrides:
        names = {v.get("name") for v in self.volumes}
        if None in names or not all(
            m.get("name") in names and m.get("mountPath") for m in self.volume_mounts
        ):
            raise ValueError(self.cel_rule("mounts-name-volumes").message)
        return self


class GangScheduling(ApiModel):
    """Schedule the rollout and trainer pods of an attempt together (`trainingrun.operator.gang`)."""

    enabled: bool = Field(False, description="Group the rollout and trainer pods of each attempt.")
    provider: Literal["volcano", "coscheduling", "kubernetes"] = Field(
        "volcano", description="volcano: Volcano's PodGroup; coscheduling: scheduler-plugins' PodGroup; kubernetes: "
        "Kubernetes' own Workload and PodGroup (scheduling.k8s.io v1beta1 or v1alpha2, whichever the cluster serves).")
    queue: str | None = Field(
        None, min_length=1, max_length=253,
        description="Volcano queue of the PodGroup (unset: Volcano's default queue); not used by the others.")


class KueueTopology(ApiModel):
    """Kueue's Topology Aware Scheduling for one role's pods (with spec.queueName): each level is a node label key of
    the cluster's Kueue Topology (e.g. cloud.google.com/gce-topology-block, or nvidia.com/gpu.clique for an NVLink
    domain)."""

    CEL_RULES = (
        Rule(name="required-or-preferred", rule="!(has(self.required) && has(self.preferred))",
             message="set placement.<role>.kueue.required or .preferred, not both"),
        Rule(name="slice-level-and-size", rule="has(self.sliceRequired) == has(self.sliceSize)",
             message="placement.<role>.kueue.sliceRequired and sliceSize go together: each slice of sliceSize pods "
             "(by rank) is placed inside one domain of the sliceRequired level"),
    )

    required: str | None = Field(None, min_length=1, max_length=253, description="All the role's pods inside one "
                                 "domain of this level, or none runs (kueue.x-k8s.io/podset-required-topology).")
    preferred: str | None = Field(None, min_length=1, max_length=253, description="Inside one domain of this level "
                                  "when it fits, else the next level up (kueue.x-k8s.io/podset-preferred-topology).")
    slice_required: str | None = Field(None, min_length=1, max_length=253, description="Each slice of sliceSize pods "
                                       "inside one domain of this level (kueue.x-k8s.io/podset-slice-required-"
                                       "topology), e.g. one model replica's trainer pods in one NVLink domain.")
    slice_size: int | None = Field(None, ge=1, le=4096, description="Pods per slice (kueue.x-k8s.io/podset-slice-"
                                   "size); trainers are ordered by rank, so a slice is consecutive ranks.")

    @model_validator(mode="after")
    def _rules(self) -> KueueTopology:
        if self.required is not None and self.preferred is not None:
            raise ValueError(self.cel_rule("required-or-preferred").message)
        if (self.slice_required is None) != (self.slice_size is None):
            raise ValueError(self.cel_rule("slice-level-and-size").message)
        return self


class VolcanoTopology(ApiModel):
    """Volcano's network topology for one role's pods (with gangScheduling provider volcano): a sub-group of the
    attempt's PodGroup whose pods stay within one HyperNode tier."""

    CEL_RULES = (
        Rule(name="one-tier", rule="!(has(self.highestTierAllowed) && has(self.highestTierName))",
             message="set placement.<role>.volcano.highestTierAllowed or highestTierName, not both"),
    )

    mode: Literal["hard", "soft"] = Field("hard", description="hard: the pods must stay within the tier; soft: "
                                          "preferred.")
    highest_tier_allowed: int | None = Field(None, ge=0, le=64, description="The highest HyperNode tier the pods may "
                                             "span (1: one leaf switch).")
    highest_tier_name: str | None = Field(None, min_length=1, max_length=253,
                                          description="The highest tier by its name.")
    sub_group_size: int | None = Field(None, ge=1, le=4096, description="Pods per sub-group kept within the tier "
                                       "(consecutive ranks); unset: all the role's pods together.")

    @model_validator(mode="after")
    def _rules(self) -> VolcanoTopology:
        if self.highest_tier_allowed is not None and self.highest_tier_name is not None:
            raise ValueError(self.cel_rule("one-tier").message)
        return self


class RolePlacement(ApiModel):
    """Topology-aware placement of one role's pods: Kueue's or Volcano's (`trainingrun.operator.gang`)."""

    kueue: KueueTopology | None = Field(None, description="Kueue Topology Aware Scheduling (needs spec.queueName).")
    volcano: VolcanoTopology | None = Field(None, description="Volcano network topology (needs gangScheduling "
                                            "provider volcano).")


class Placement(ApiModel):
    """Topology-aware placement per role."""

    rollout: RolePlacement = Field(default_factory=RolePlacement, description="The rollout pod.")
    trainer: RolePlacement = Field(default_factory=RolePlacement, description="The trainer pods.")
