"""TrainingRun spec and status models (`trainingrun.dev/v1alpha1`).

These pydantic models are the single source of the API: the CRD's OpenAPI schema is generated from them
(`trainingrun.api.crd`), and the cross-field rules are written once per model as CEL in `CEL_RULES` (they become the
CRD's `x-kubernetes-validations`) and mirrored in Python by the model validators, so a spec loaded by the local
launcher, the rollout or the trainer is held to the same rules as one admitted by the API server. A test evaluates
every CEL rule with a real CEL engine beside its Python twin on passing and failing objects.

The spec's sections live in `trainingrun.api.spec` (`base`: `ApiModel`, `Rule` and the shared types; `model`,
`trainer`, `rollout`, `engine`, `services`, `cluster`); this module holds what joins them: `TrainingRunSpec` with the
rules that span sections, the status, the whole `TrainingRun` and `parse_trainingrun`, and `ALL_MODELS` (every model
of the API, found from the spec and the status).

Field names are camelCase, as in every Kubernetes API; Python attribute names are snake_case.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainingrun.api.constants import API_VERSION, KIND, MANAGED_BY_OPERATOR
from trainingrun.api.spec.base import INT64_MAX, MAX_SECONDS, MAX_SEED, ApiModel, Rule
from trainingrun.api.spec.cluster import FailurePolicy, GangScheduling, Placement, PodTemplateOverrides
from trainingrun.api.spec.engine import WeightSyncSpec
from trainingrun.api.spec.model import ModelSpec
from trainingrun.api.spec.rollout import RolloutSpec
from trainingrun.api.spec.services import MetricsSpec, StoreSpec
from trainingrun.api.spec.trainer import TrainerSpec

__all__ = [
    "ALL_MODELS", "MESSAGE_MAX_LENGTH", "PHASES", "TERMINAL_PHASES", "Condition", "ObjectMeta", "PaceAnchor", "Phase",
    "ProgressStatus", "RoleRestartStatus", "TrainingRun", "TrainingRunSpec", "TrainingRunStatus", "parse_trainingrun",
]


# CEL terms of the spec's rules below. The API server defaults fields before it evaluates rules, but an object that is
# left out (rollout, rollout.engine, weightSync) has no defaults inside it: each term guards for that.
_GENERATED = "has(self.rollout) && has(self.rollout.source) && self.rollout.source.type == 'generate'"
_VLLM = "has(self.rollout.engine) && self.rollout.engine.type == 'vllm'"
_SYNC = "(has(self.weightSync) ? self.weightSync.type : 'store')"
# spec.rollout.engine.replicas of `obj` (self or oldSelf) with its default (1) where rollout or engine is unset
_ENGINE_REPLICAS = ("((has({obj}.rollout) && has({obj}.rollout.engine) && has({obj}.rollout.engine.replicas)) ? "
                    "{obj}.rollout.engine.replicas : 1)")
_PLACED = "(has(self.placement) && has(self.placement.{role}) && has(self.placement.{role}.{kind}))"


class TrainingRunSpec(ApiModel):
    """Desired state of a TrainingRun."""

    CEL_RULES = (
        Rule(
            name="ppo-needs-generate",
            rule="self.trainer.lossType != 'ppo' || (has(self.rollout) && has(self.rollout.source) && "
            "self.rollout.source.type == 'generate')",
            message="trainer.lossType ppo needs generated rollouts (rollout.source.type generate): it compares the "
            "trainer's log-probabilities with the generator's",
            fieldPath=".trainer.lossType",
        ),
        # The engine of generated rollouts and how the trained weights reach it (the engine table's publishers,
        # `trainingrun.engines.table`): store for the megatron engine; disk or broadcast for vllm, which loads them as
        # a Hugging Face model (so it needs model.hf).
        Rule(
            name="store-sync-needs-megatron",
            rule=f"!({_GENERATED}) || {_SYNC} != 'store' || !({_VLLM})",
            message="weightSync.type store reaches the megatron engine only; with rollout.engine.type vllm set "
            "weightSync.type disk or broadcast",
            fieldPath=".weightSync.type",
        ),
        Rule(
            name="disk-broadcast-sync-need-vllm",
            rule=f"!({_GENERATED}) || !({_SYNC} in ['disk', 'broadcast']) || ({_VLLM})",
            message="weightSync.type disk and broadcast reach the vllm engine only; with rollout.engine.type megatron "
            "set weightSync.type store",
            fieldPath=".weightSync.type",
        ),
        Rule(
            name="policy-options-need-generate",
            rule=f"({_GENERATED}) || !has(self.trainer.policyLoss) || (self.trainer.policyLoss.oldLogprobs == "
            "'engine' && (!has(self.trainer.policyLoss.rolloutCorrection) || "
            "self.trainer.policyLoss.rolloutCorrection.type == 'none'))",
            message="trainer.policyLoss.oldLogprobs trainer and rolloutCorrection compare with the engine's "
            "log-probabilities: they need generated rollouts (rollout.source.type generate)",
            fieldPath=".trainer.policyLoss",
        ),
        Rule(
            name="greedy-groups-never-vary",
            rule=f"!({_GENERATED}) || !has(self.rollout.source.generate.sampling) || "
            "self.rollout.source.generate.sampling.temperature > 0.0 || self.rollout.groupSize < 2 || "
            "(has(self.rollout.filters) && !self.rollout.filters.zeroVariance)",
            message="rollout.source.generate.sampling.temperature 0 (greedy) gives every completion of a group the "
            "same tokens and reward, so with groupSize > 1 the zero-variance filter drops every group and the run "
            "can never train; set temperature > 0, groupSize 1, or rollout.filters.zeroVariance false",
            fieldPath=".rollout.source.generate.sampling.temperature",
        ),
        Rule(
            name="routing-replay-needs-megatron-engine",
            rule="!has(self.trainer.moe) || !has(self.trainer.moe.routingReplay) || !self.trainer.moe.routingReplay"
            f" || (({_GENERATED}) && !({_VLLM}))",
            message="trainer.moe.routingReplay needs generated rollouts (rollout.source.type generate) with "
            "rollout.engine.type megatron: it records the experts each generated token was routed to (the vllm engine "
            "does not hand them over yet)",
            fieldPath=".trainer.moe.routingReplay",
        ),
        Rule(
            name="routing-replay-without-partial-rollouts",
            rule="!has(self.trainer.moe) || !has(self.trainer.moe.routingReplay) || !self.trainer.moe.routingReplay"
            " || !has(self.rollout.partialRollout) || !self.rollout.partialRollout",
            message="trainer.moe.routingReplay with rollout.partialRollout: a continued completion's experts are not "
            "recorded across the cut yet, so its routes could not be replayed; set one of them false",
            fieldPath=".trainer.moe.routingReplay",
        ),
        Rule(
            name="adapter-needs-lora",
            rule="!has(self.model.adapter) || has(self.trainer.lora)",
            message="model.adapter starts LoRA adapters from a PEFT directory: set trainer.lora (its rank, alpha and "
            "targets as the adapter's), or remove model.adapter",
            fieldPath=".model.adapter",
        ),
        # A LoRA run's weight sync sends the adapters only (`engines/vllm/publish.py`, AdapterPublisher): to the
        # vllm engine as a PEFT directory per version (disk), which vLLM serves as a LoRA adapter.
        Rule(
            name="lora-sync-not-broadcast",
            rule=f"!has(self.trainer.lora) || !({_GENERATED}) || {_SYNC} != 'broadcast'",
            message="weightSync.type broadcast with trainer.lora: a LoRA run syncs its adapters only, as a PEFT "
            "directory vLLM loads as a LoRA adapter; set weightSync.type disk",
            fieldPath=".weightSync.type",
        ),
        Rule(
            name="lora-rank-fits-vllm",
            rule=f"!has(self.trainer.lora) || !({_GENERATED}) || !({_VLLM}) || self.trainer.lora.rank <= 512",
            message="trainer.lora.rank above 512 with rollout.engine.type vllm: vLLM serves LoRA adapters of rank "
            "≤ 512 (--max-lora-rank); allowed: a rank ≤ 512, or rollout.engine.type megatron",
            fieldPath=".trainer.lora.rank",
        ),
        # vLLM 0.32 serves LoRA on fused MoE experts only through its Triton kernels (no CPU path: the CPU punica
        # wrapper has no add_lora_fused_moe), and its loading of PEFT's target_parameters adapters is untested here.
        Rule(
            name="lora-experts-not-vllm",
            rule=f"!has(self.trainer.lora) || !has(self.trainer.lora.targets) || "
            f"!self.trainer.lora.targets.exists(t, t == 'experts') || !({_GENERATED}) || !({_VLLM})",
            message="trainer.lora.targets experts with rollout.engine.type vllm: vLLM does not serve adapters on a "
            "mixture of experts' experts here (docs/vllm.md); allowed: targets without experts, or "
            "rollout.engine.type megatron",
            fieldPath=".trainer.lora.targets",
        ),
        Rule(
            name="bf16-grad-reduce-needs-bf16",
            rule="!has(self.trainer.performance) || !has(self.trainer.performance.gradReduceDtype)"
            " || self.trainer.performance.gradReduceDtype != 'bf16'"
            " || (has(self.model.precision) && self.model.precision == 'bf16')",
            message="trainer.performance.gradReduceDtype bf16 reduces gradients in the parameters' type: set "
            "model.precision bf16, or gradReduceDtype fp32",
            fieldPath=".trainer.performance.gradReduceDtype",
        ),
        Rule(
            name="store-sync-single-stage",
            rule=f"!({_GENERATED}) || {_SYNC} != 'store' || self.trainer.pipelineParallelSize == 1",
            message="weightSync.type store publishes trainer rank 0's state dict, which holds one pipeline stage when "
            "trainer.pipelineParallelSize > 1; allowed: pipelineParallelSize 1 with store, or the vllm engine "
            "(weightSync.type disk or broadcast), whose publishers gather the stages",
            fieldPath=".weightSync.type",
        ),
        # Synthetic groups hold groupSize samples each, so a fixed step's size is known here: every data-parallel
        # rank needs a sample of every step (the rollout checks the other sources' steps as it forms them).
        Rule(
            name="fixed-steps-fill-the-ranks",
            rule="!has(self.rollout) || !has(self.rollout.steps) || self.rollout.steps.policy != 'fixed'"
            " || !has(self.rollout.steps.globalBatchSize)"
            " || (has(self.rollout.source) && self.rollout.source.type != 'synthetic')"
            " || self.rollout.steps.globalBatchSize * self.rollout.groupSize >= (self.trainer.replicas"
            " * (self.trainer.gpusPerReplica > 0 ? self.trainer.gpusPerReplica : 1))"
            " / (self.trainer.tensorParallelSize * self.trainer.pipelineParallelSize)",
            message="rollout.steps.globalBatchSize groups of rollout.groupSize synthetic samples per step are fewer "
            "than the data-parallel ranks (trainer.replicas × max(gpusPerReplica, 1) / (tensorParallelSize × "
            "pipelineParallelSize)), and each rank needs a sample of every step; allowed: globalBatchSize × groupSize "
            ">= the data-parallel ranks",
            fieldPath=".rollout.steps.globalBatchSize",
        ),
        Rule(
            name="vllm-needs-hf",
            rule=f"!({_GENERATED}) || !({_VLLM}) || has(self.model.hf)",
            message="rollout.engine.type vllm loads Hugging Face weights: set model.hf to a Hugging Face directory "
            "(in a cluster on a volume of podTemplate, which the engine pod mounts too)",
            fieldPath=".model.hf",
        ),
        Rule(
            name="agent-needs-hf",
            rule=f"!({_GENERATED}) || !has(self.rollout.source.generate) || !has(self.rollout.source.generate.agent) "
            "|| has(self.model.hf)",
            message="rollout.source.generate.agent: the gateway renders the agent's chat messages with the model's "
            "chat template: set model.hf to a Hugging Face directory whose tokenizer has one",
            fieldPath=".model.hf",
        ),
        # A transition rule (oldSelf: the stored object on an update): the controller that owns a run is chosen when
        # it is created. No Python twin: a single object has no old version.
        Rule(
            name="managed-by-immutable",
            rule="has(self.managedBy) == has(oldSelf.managedBy) && (!has(self.managedBy) || self.managedBy == "
            "oldSelf.managedBy)",
            message="spec.managedBy is immutable: it cannot be set, changed or removed after the run is created",
            fieldPath=".managedBy",
        ),
        # A transition rule: Kueue admitted the engines as one pod group of a fixed size (pod-group-total-count), so
        # a run in a queue keeps its engine pool's size (docs/operator.md, "Resizing the engine pool").
        Rule(
            name="engine-replicas-fixed-under-kueue",
            rule="!has(self.queueName) || !has(oldSelf.queueName) || "
            f"{_ENGINE_REPLICAS.format(obj='self')} == {_ENGINE_REPLICAS.format(obj='oldSelf')}",
            message="spec.rollout.engine.replicas cannot change while Kueue manages the run (spec.queueName): Kueue "
            "admitted its engines as one pod group of that size; create a new TrainingRun to change it",
            fieldPath=".rollout.engine.replicas",
        ),
        Rule(
            name="kueue-placement-needs-queue",
            rule=f"has(self.queueName) || !({_PLACED.format(role='trainer', kind='kueue')} || "
            f"{_PLACED.format(role='rollout', kind='kueue')})",
            message="placement.<role>.kueue is Kueue's Topology Aware Scheduling: set queueName (a LocalQueue whose "
            "ClusterQueue has a topology-aware ResourceFlavor)",
            fieldPath=".placement",
        ),
        Rule(
            name="volcano-placement-needs-volcano",
            rule="(has(self.gangScheduling) && self.gangScheduling.enabled && has(self.gangScheduling.provider) && "
            f"self.gangScheduling.provider == 'volcano') || !({_PLACED.format(role='trainer', kind='volcano')} || "
            f"{_PLACED.format(role='rollout', kind='volcano')})",
            message="placement.<role>.volcano is Volcano's network topology: set gangScheduling.enabled with provider "
            "volcano",
            fieldPath=".placement",
        ),
        Rule(
            name="slices-divide-the-pods",
            rule="!has(self.placement) || !has(self.placement.trainer) || ((!has(self.placement.trainer.kueue) || "
            "!has(self.placement.trainer.kueue.sliceSize) || self.trainer.replicas % "
            "self.placement.trainer.kueue.sliceSize == 0) && (!has(self.placement.trainer.volcano) || "
            "!has(self.placement.trainer.volcano.subGroupSize) || self.trainer.replicas % "
            "self.placement.trainer.volcano.subGroupSize == 0))",
            message="placement.trainer.kueue.sliceSize and placement.trainer.volcano.subGroupSize must divide "
            "trainer.replicas (every slice is full)",
            fieldPath=".placement.trainer",
        ),
    )

    image: str = Field("ghcr.io/trainingrun/trainer-te:0.1.0", min_length=1, description="Image of rollout and trainers.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent", description="Pull policy.")
    seed: int = Field(1234, ge=0, le=MAX_SEED, description="Seed of data, model init and sampling.")
    model: ModelSpec = Field(..., description="Model to train.")
    trainer: TrainerSpec = Field(..., description="Trainer pods.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Rollout pod.")
    store: StoreSpec = Field(default_factory=StoreSpec, description="Shared store.")
    metrics: MetricsSpec = Field(default_factory=MetricsSpec, description="Metrics.")
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec,
                                        description="Weights to the engine (generated rollouts).")
    failure_policy: FailurePolicy = Field(default_factory=FailurePolicy, description="Restarts and hang detection.")
    suspend: bool = Field(False, description="Delete the pods and keep the run (resume from checkpoint on false).")
    active_deadline_seconds: int | None = Field(None, ge=1, le=MAX_SECONDS, description="Fail the run after this long running.")
    ttl_seconds_after_finished: int | None = Field(None, ge=0, le=MAX_SECONDS, description="Delete the run this long after it ends.")
    scheduler_name: str | None = Field(None, description="Pod schedulerName (e.g. volcano).")
    queue_name: str | None = Field(
        None, min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="Kueue LocalQueue in the run's namespace: the rollout and trainer pods of each attempt carry "
        "Kueue's pod-group labels (kueue.x-k8s.io/queue-name, pod-group-name, pod-group-total-count), so Kueue admits "
        "them as one workload; until then they wait, gated, and the run is Pending (WaitingForAdmission).")
    gang_scheduling: GangScheduling = Field(default_factory=GangScheduling, description="Gang scheduling.")
    placement: Placement = Field(default_factory=Placement, description="Topology-aware placement per role (Kueue "
                                 "topology annotations or Volcano network topology).")
    managed_by: str | None = Field(
        None, min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*"
        r"[A-Za-z0-9])?$",
        description=f"The controller that runs this TrainingRun (a domain-prefixed path); unset or "
        f"{MANAGED_BY_OPERATOR!r}: the trainingrun operator; anything else (e.g. kueue.x-k8s.io/multikueue): the "
        "operator creates nothing and writes no status. Immutable.")
    pod_template: PodTemplateOverrides = Field(
        default_factory=PodTemplateOverrides, description="Pod settings for every pod of the run."
    )

    @model_validator(mode="after")
    def _rules(self) -> TrainingRunSpec:
        generated = self.rollout.source.type == "generate"
        if self.trainer.loss_type == "ppo" and not generated:
            raise ValueError(self.cel_rule("ppo-needs-generate").message)
        vllm, sync = self.rollout.engine.type == "vllm", self.weight_sync.type
        if generated and sync == "store" and vllm:
            raise ValueError(self.cel_rule("store-sync-needs-megatron").message)
        if generated and sync in ("disk", "broadcast") and not vllm:
            raise ValueError(self.cel_rule("disk-broadcast-sync-need-vllm").message)
        if self.trainer.moe.routing_replay and not (generated and not vllm):
            raise ValueError(self.cel_rule("routing-replay-needs-megatron-engine").message)
        if self.trainer.moe.routing_replay and self.rollout.partial_rollout:
            raise ValueError(self.cel_rule("routing-replay-without-partial-rollouts").message)
        if generated and vllm and self.model.hf is None:
            raise ValueError(self.cel_rule("vllm-needs-hf").message)
        agent = self.rollout.source.generate is not None and self.rollout.source.generate.agent is not None
        if generated and agent and self.model.hf is None:
            raise ValueError(self.cel_rule("agent-needs-hf").message)
        placed = {(role, kind) for role in ("rollout", "trainer") for kind in ("kueue", "volcano")
                  if getattr(getattr(self.placement, role), kind) is not None}
        if placed & {("rollout", "kueue"), ("trainer", "kueue")} and self.queue_name is None:
            raise ValueError(self.cel_rule("kueue-placement-needs-queue").message)
        gang = self.gang_scheduling
        if placed & {("rollout", "volcano"), ("trainer", "volcano")} and not (gang.enabled and gang.provider == "volcano"):
            raise ValueError(self.cel_rule("volcano-placement-needs-volcano").message)
        t = self.placement.trainer
        sizes = [x for x in (t.kueue.slice_size if t.kueue else None, t.volcano.sub_group_size if t.volcano else None)
                 if x is not None]
        if any(self.trainer.replicas % size for size in sizes):
            raise ValueError(self.cel_rule("slices-divide-the-pods").message)
        pl = self.trainer.policy_loss
        if not generated and (pl.old_logprobs != "engine" or pl.rollout_correction.type != "none"):
            raise ValueError(self.cel_rule("policy-options-need-generate").message)
        gen = self.rollout.source.generate
        if generated and gen is not None and gen.sampling.temperature <= 0 and self.rollout.group_size >= 2 \
                and self.rollout.filters.zero_variance:
            raise ValueError(self.cel_rule("greedy-groups-never-vary").message)
        if self.model.adapter is not None and self.trainer.lora is None:
            raise ValueError(self.cel_rule("adapter-needs-lora").message)
        if self.trainer.lora is not None and generated and sync == "broadcast":
            raise ValueError(self.cel_rule("lora-sync-not-broadcast").message)
        if self.trainer.lora is not None and generated and vllm and self.trainer.lora.rank > 512:
            raise ValueError(self.cel_rule("lora-rank-fits-vllm").message)
        if self.trainer.lora is not None and generated and vllm and "experts" in self.trainer.lora.targets:
            raise ValueError(self.cel_rule("lora-experts-not-vllm").message)
        if self.trainer.performance.grad_reduce_dtype == "bf16" and self.model.precision != "bf16":
            raise ValueError(self.cel_rule("bf16-grad-reduce-needs-bf16").message)
        if generated and self.weight_sync.type == "store" and self.trainer.pipeline_parallel_size > 1:
            raise ValueError(self.cel_rule("store-sync-single-stage").message)
        steps = self.rollout.steps
        if steps.policy == "fixed" and steps.global_batch_size is not None and self.rollout.source.type == "synthetic" \
                and steps.global_batch_size * self.rollout.group_size < self.trainer.data_parallel_size:
            raise ValueError(self.cel_rule("fixed-steps-fill-the-ranks").message)
        return self


# -------------------------------------------------------------------------------------------------------- status
Phase = Literal["Pending", "Running", "Restarting", "Succeeded", "Failed", "Suspended"]
PHASES: tuple[str, ...] = ("Pending", "Running", "Restarting", "Succeeded", "Failed", "Suspended")
TERMINAL_PHASES: frozenset[str] = frozenset({"Succeeded", "Failed"})


# Longest status.message / condition message the CRD admits; the operator cuts longer ones to fit (a status patch
# with a longer one would be refused as a whole).
MESSAGE_MAX_LENGTH = 4096


class Condition(ApiModel):
    """A Kubernetes condition (metav1.Condition conventions): one per type, keyed by type."""

    type: str = Field(..., max_length=316, pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                      r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
                      description="Running, Restarting, Suspended, Succeeded, Failed (lifecycle: one is True at a "
                      "time), PodsReady (False while Pending: why), ProgressUnknown (True while the store's progress "
                      "cannot be read), EnginePoolResizing (True while the engine pool's size differs from "
                      "spec.rollout.engine.replicas).")
    status: Literal["True", "False", "Unknown"] = Field(..., description="True, False or Unknown.")
    observed_generation: int | None = Field(None, ge=0, le=INT64_MAX,
                                            description="The spec generation the condition was set from.")
    reason: str | None = Field(None, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
                               description="CamelCase reason.")
    message: str | None = Field(None, max_length=MESSAGE_MAX_LENGTH, description="Human-readable detail.")
    last_transition_time: str | None = Field(None, description="RFC 3339 time of the last change of status.")


class RoleRestartStatus(ApiModel):
    """Restarts of one replica of a role that restarts alone (the rollout, an engine replica): the role's budget is
    counted here, in the run's status, never in a child (a deleted pod never resets it)."""

    role: Literal["rollout", "engine"] = Field(..., description="The role.")
    replica: int = Field(0, ge=0, le=4096, description="The replica (engines); 0 for the rollout.")
    restarts: int = Field(0, ge=0, le=INT64_MAX, description="Restarts counted against failurePolicy.roles.<role>.")
    uncounted: int = Field(0, ge=0, le=INT64_MAX, description="Restarts that used no budget (disruptions, Ignore "
                           "rules); restarts + uncounted is the replica's current pod generation.")
    last_failure: str | None = Field(None, max_length=MESSAGE_MAX_LENGTH, description="What failed last time.")
    last_restart_time: str | None = Field(None, description="When the last restart was decided (RFC 3339).")
    backoff_seconds: int = Field(0, ge=0, le=MAX_SECONDS, description="The wait after lastRestartTime before the "
                                 "replacement is created.")
    replacing: bool = Field(False, description="The replacement pod of the current generation was not seen yet.")
    down: bool = Field(False, description="An engine replica out of the pool: it failed with "
                       "failurePolicy.roles.engine's budget spent while other replicas served; not replaced again "
                       "(the run fails once no replica is left).")


class PaceAnchor(ApiModel):
    """The progress the pace (for estimatedRemainingSeconds) is measured from: the first record of an attempt."""

    attempt: int = Field(0, ge=0, le=INT64_MAX, description="The trainers' attempt of that record.")
    rollouts_done: int = Field(0, ge=0, le=INT64_MAX, description="Rollouts done then.")
    time: str = Field(..., description="When that record was written (RFC 3339).")


class ProgressStatus(ApiModel):
    """How far the run is, from the trainers' progress record (`trainingrun.contract.progress`)."""

    percentage: int = Field(0, ge=0, le=100, description="Rollouts trained, in percent of rollout.numRollouts.")
    estimated_remaining_seconds: int | None = Field(
        None, ge=0, le=INT64_MAX, description="At this attempt's pace so far; unset until it is known.")
    rollouts_done: int = Field(0, ge=0, le=INT64_MAX, description="Rollouts trained (the one in training counts).")
    rollouts_total: int = Field(0, ge=0, le=INT64_MAX, description="spec.rollout.numRollouts.")
    updated_at: str | None = Field(None, description="When the trainers wrote the record (RFC 3339).")
    pace_from: PaceAnchor | None = Field(None, description="What the pace is measured from.")


class TrainingRunStatus(ApiModel):
    """Observed state of a TrainingRun, written by the operator from what it observes."""

    phase: Phase | None = Field(None, description="Pending, Running, Restarting, Succeeded, Failed or Suspended.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Conditions, one per type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    restarts: int = Field(0, ge=0, le=INT64_MAX, description="Whole-group restarts after application failures so far.")
    disruptions: int = Field(0, ge=0, le=INT64_MAX, description="Whole-group restarts after evicted, preempted or lost "
                             "pods (not counted against maxRestarts).")
    attempt: int = Field(0, ge=0, le=INT64_MAX, description="Current attempt (pods carry it as a label).")
    trainer_replicas: int | None = Field(None, ge=1, le=4096, description="Trainer pods of the current attempt "
                                         "(spec.trainer.replicas when it started).")
    step: int = Field(0, ge=0, le=INT64_MAX, description="Optimizer steps completed.")
    samples_consumed: int = Field(0, ge=0, le=INT64_MAX, description="Samples trained on so far.")
    last_global_batch_size: int = Field(0, ge=0, le=INT64_MAX, description="Samples in the last step.")
    rollout: int = Field(0, ge=0, le=INT64_MAX, description="Rollouts consumed.")
    start_time: str | None = Field(None, description="When the run started (RFC 3339).")
    completion_time: str | None = Field(None, description="When the run ended (RFC 3339).")
    observed_generation: int | None = Field(None, ge=0, le=INT64_MAX,
                                            description="The spec generation this status reflects.")
    message: str | None = Field(None, max_length=MESSAGE_MAX_LENGTH,
                                description="Last important message (e.g. why the run failed).")
    role_restarts: list[RoleRestartStatus] = Field(
        default_factory=list, max_length=4097, description="Restarts of the rollout and of each engine replica "
        "alone (failurePolicy RestartRole), one entry per replica that restarted.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["role", "replica"]})
    progress: ProgressStatus | None = Field(None, description="Percentage, rollouts done of the total and an "
                                            "estimate of the time left, from the trainers' progress record.")
    engine_replicas: int | None = Field(None, ge=0, le=256, description="The engine pool's size as the operator "
                                        "runs it (the scale subresource's status replicas): it reaches "
                                        "spec.rollout.engine.replicas once every added replica's pod exists and every "
                                        "removed one's pod is gone.")
    engine_selector: str | None = Field(None, max_length=1024, description="The label selector of the run's engine "
                                        "pods (the scale subresource's labelSelectorPath, for autoscalers).")


class ObjectMeta(BaseModel):
    """The part of metadata this package reads; the rest passes through."""

    model_config = ConfigDict(extra="allow")
    name: str = Field("run", min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class TrainingRun(BaseModel):
    """A whole TrainingRun manifest."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    api_version: Literal[API_VERSION] = Field(API_VERSION, alias="apiVersion")  # type: ignore[valid-type]
    kind: Literal[KIND] = KIND  # type: ignore[valid-type]
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: TrainingRunSpec
    status: TrainingRunStatus | None = None


def parse_trainingrun(doc: dict[str, Any]) -> TrainingRun:
    """A TrainingRun from a decoded manifest (plain JSON values), validated strictly: no type coercion (`true` or
    `"2"` is not an integer), as the CRD's schema; raises pydantic.ValidationError on bad input."""
    return TrainingRun.model_validate(doc, strict=True)


def _models_under(*roots: type[BaseModel]) -> tuple[type[ApiModel], ...]:
    """Every ApiModel reachable from `roots` through their fields' annotations (`X | None`, `list[X]`,
    `dict[str, X]`, `Annotated[X, ...]` are looked through), each once, in the order first met."""
    found: dict[type[ApiModel], None] = {}

    def visit(annotation: Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if annotation in found:
                return
            if issubclass(annotation, ApiModel):
                found[annotation] = None
            for field in annotation.model_fields.values():
                visit(field.annotation)
            return
        for arg in get_args(annotation):
            visit(arg)

    for root in roots:
        visit(root)
    return tuple(found)


# Every model of the API: what the CRD is generated from (`trainingrun.api.crd` attaches each one's CEL_RULES to its
# object). Derived from the fields, so a model the spec or the status reaches cannot be left out.
ALL_MODELS: tuple[type[ApiModel], ...] = _models_under(TrainingRunSpec, TrainingRunStatus)
