"""The generated CRD: in sync with the models, structural, valid for Kubernetes, and CEL rules that hold."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError

from trainingrun.api import models
from trainingrun.api.crd import crd, crd_yaml, spec_schema
from trainingrun.api.checks import apply_defaults, evaluate_rule
from trainingrun.api.spec.base import ApiModel, Rule
from trainingrun.api.spec.cluster import FailureRule, KueueTopology, PodTemplateOverrides, VolcanoTopology
from trainingrun.api.spec.engine import EngineSpec, VLLMSettings
from trainingrun.api.spec.model import MoESpec, ModelSpec
from trainingrun.api.spec.rollout import (
    AgentSpec,
    EnvironmentSpec,
    EvalSpec,
    JudgeSpec,
    RemoteRewardSpec,
    GenerateSource,
    PromptsSpec,
    RewardSpec,
    RolloutSpec,
    SourceSpec,
    StepPolicy,
    SyntheticPrompts,
    SyntheticSource,
)
from trainingrun.api.spec.services import StoreSpec
from trainingrun.api.spec.trainer import LoRASpec, OptimizerSpec, RecomputeSpec, RolloutCorrectionSpec, TrainerSpec

ROOT = Path(__file__).resolve().parents[2]


def test_api_constants_keep_the_contract():
    """design.md's CRD and pod-label contract, written out literally once: every other module uses the constants."""
    from trainingrun.api import constants as c

    assert (c.GROUP, c.VERSION, c.KIND, c.PLURAL, c.SHORT_NAME) == (
        "trainingrun.dev", "v1alpha1", "TrainingRun", "trainingruns", "tr")
    assert c.API_VERSION == "trainingrun.dev/v1alpha1" and c.CRD_NAME == "trainingruns.trainingrun.dev"
    assert (c.LABEL_NAME, c.APP, c.LABEL_RUN, c.LABEL_ROLE, c.LABEL_RANK) == (
        "app.kubernetes.io/name", "trainingrun", "trainingrun.dev/run", "trainingrun.dev/role", "trainingrun.dev/rank")
    generated = crd()
    assert generated["metadata"]["name"] == c.CRD_NAME and generated["spec"]["versions"][0]["name"] == c.VERSION
    assert models.TrainingRun.model_fields["api_version"].default == c.API_VERSION


def test_checked_in_crd_is_in_sync():
    assert (ROOT / "crds/trainingrun.yaml").read_text() == crd_yaml(), "run `make crd` and commit crds/trainingrun.yaml"



def _subclasses(cls: type) -> set[type]:
    return {sub for child in cls.__subclasses__() for sub in {child, *_subclasses(child)}}


def test_all_models_are_every_model_of_the_api():
    """ALL_MODELS (whose CEL rules the CRD carries) is derived from the spec and the status: every ApiModel the
    package defines is in it once (VLLMSettings, which a hand-kept list had missed, too), and nothing else."""
    defined = {c for c in _subclasses(ApiModel) if c.__module__.startswith("trainingrun.")}
    assert len(set(models.ALL_MODELS)) == len(models.ALL_MODELS)
    assert set(models.ALL_MODELS) == defined, (set(models.ALL_MODELS) ^ defined)
    assert {VLLMSettings, models.TrainingRunSpec, models.TrainingRunStatus, models.Condition} <= set(models.ALL_MODELS)


def test_two_models_of_one_name_are_refused(monkeypatch):
    """The CRD finds a model's rules by its schema title (the class name): a second model of that name is an error,
    not a rule silently attached to the wrong object or to none."""
    from trainingrun.api import crd as crd_module

    class SamplingSpec(ApiModel):  # the name of trainingrun.api.spec.rollout.SamplingSpec
        CEL_RULES = (Rule(name="r", rule="true", message="m"),)

    monkeypatch.setattr(crd_module, "ALL_MODELS", (*models.ALL_MODELS, SamplingSpec))
    with pytest.raises(ValueError, match="SamplingSpec"):
        crd_module.spec_schema()

@pytest.mark.parametrize("version", ["1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0"])
def test_crd_passes_kubernetes_validate(version):
    kubernetes_validate.validate(crd(), version, strict=True)


def walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from walk(node[key], f"{path}[{key}]")


def test_crd_schema_is_structural():
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in walk(schema):
        assert not {"$ref", "anyOf", "oneOf", "allOf", "$defs", "title"} & set(node), path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        if node.get("type") == "object" and path != ".metadata":  # metadata's schema is the API server's own
            assert "properties" in node or "additionalProperties" in node or node.get(
                "x-kubernetes-preserve-unknown-fields"
            ), path


def test_crd_names_and_columns():
    spec = crd()["spec"]
    assert spec["group"] == "trainingrun.dev" and spec["names"]["kind"] == "TrainingRun"
    assert spec["names"]["plural"] == "trainingruns" and spec["names"]["shortNames"] == ["tr"]
    assert spec["names"]["categories"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"]["status"] == {}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    for wanted in ("Phase", "Step", "GBS", "Restarts", "Age"):
        assert wanted in columns


def test_crd_scale_subresource_is_the_engine_pool():
    """`kubectl scale tr/NAME --replicas N` and autoscalers resize the run's engine pool: the scale subresource's
    paths exist in the schema, spec replicas is an integer with the engine's bounds, status replicas an integer the
    operator writes, the selector a string."""
    version = crd()["spec"]["versions"][0]
    scale = version["subresources"]["scale"]
    assert scale == {"specReplicasPath": ".spec.rollout.engine.replicas",
                     "statusReplicasPath": ".status.engineReplicas", "labelSelectorPath": ".status.engineSelector"}
    schema = version["schema"]["openAPIV3Schema"]
    spec_node = node_at(schema, scale["specReplicasPath"])
    assert spec_node["type"] == "integer" and spec_node["minimum"] == 1 and spec_node["maximum"] == 256
    assert node_at(schema, scale["statusReplicasPath"])["type"] == "integer"
    assert node_at(schema, scale["labelSelectorPath"])["type"] == "string"


# ---------------------------------------------------------------------------------------------------- CEL rules
def node_at(schema: dict[str, Any], path: str) -> dict[str, Any]:
    node = schema
    for part in filter(None, path.split(".")):
        name, _, rest = part.partition("[")
        node = node["properties"][name]
        if rest:
            node = node[rest.rstrip("]")]
    return node


# (schema path of the rule's object, rule name) -> (passing object, failing object); objects are the node's value.
CASES: dict[tuple[str, str], tuple[dict, dict]] = {
    ("model", "model-source"): ({"preset": "tiny"}, {"numLayers": 2, "hiddenSize": 64}),
    ("model", "heads-divide-hidden-size"): (
        {"preset": "tiny", "hiddenSize": 64, "numAttentionHeads": 4},
        {"preset": "tiny", "hiddenSize": 66, "numAttentionHeads": 4},
    ),
    ("model", "query-groups-divide-heads"): (
        {"preset": "tiny-llama", "numAttentionHeads": 4, "numQueryGroups": 2},
        {"preset": "tiny-llama", "numAttentionHeads": 4, "numQueryGroups": 3},
    ),
    ("model", "hf-alone"): ({"hf": "/models/smollm2", "seqLength": 512}, {"hf": "/models/smollm2", "preset": "tiny"}),
    ("model.moe", "top-k-within-experts"): ({"numExperts": 8, "topK": 2, "ffnHiddenSize": 64},
                                            {"numExperts": 2, "topK": 4, "ffnHiddenSize": 64}),
    # the attention backend and the layer spec it runs in
    ("model", "te-attention-needs-te-layers"): (
        {"preset": "tiny", "attentionBackend": "te", "transformerImpl": "transformer_engine"},
        {"preset": "tiny", "attentionBackend": "te", "transformerImpl": "local"},
    ),
    ("model", "te-layers-need-te-attention"): (
        {"preset": "tiny", "transformerImpl": "transformer_engine"},
        {"preset": "tiny", "attentionBackend": "flash", "precision": "bf16", "transformerImpl": "transformer_engine"},
    ),
    ("model", "flash-needs-half-precision"): (
        {"preset": "tiny", "attentionBackend": "flash", "precision": "bf16"},
        {"preset": "tiny", "attentionBackend": "flash"},
    ),
    ("trainer.performance.recompute", "layers-for-full"): (
        {"granularity": "full", "numLayers": 2}, {"granularity": "selective", "numLayers": 2}),
    ("trainer.performance.recompute", "block-needs-layers"): (
        {"granularity": "full", "method": "block", "numLayers": 1}, {"granularity": "full", "method": "block"}),
    ("trainer.lora", "targets-unique"): ({"rank": 8, "targets": ["mlp_in", "mlp_out"]},
                                         {"rank": 8, "targets": ["mlp_in", "mlp_in"]}),
    ("trainer", "param-gather-overlap-needs-distributed-optimizer"): (
        {"maxTokensPerGPU": 64, "optimizer": {"distributed": True}, "performance": {"overlapParamGather": True}},
        {"maxTokensPerGPU": 64, "performance": {"overlapParamGather": True}},
    ),
    ("", "adapter-needs-lora"): (
        {"model": {"preset": "tiny", "adapter": "/adapters/sft"},
         "trainer": {"maxTokensPerGPU": 64, "lora": {"rank": 8}}},
        {"model": {"preset": "tiny", "adapter": "/adapters/sft"}, "trainer": {"maxTokensPerGPU": 64}},
    ),
    ("", "bf16-grad-reduce-needs-bf16"): (
        {"model": {"preset": "tiny", "precision": "bf16"},
         "trainer": {"maxTokensPerGPU": 64, "performance": {"gradReduceDtype": "bf16"}}},
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64, "performance": {"gradReduceDtype": "bf16"}}},
    ),
    # DRA claims (issue 32): a name of its own, exactly one source
    ("trainer", "resource-claims-named-once-with-one-source"): (
        {"maxTokensPerGPU": 64, "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "h100x8"},
                                                    {"name": "nic", "resourceClaimName": "rdma-0"}]},
        {"maxTokensPerGPU": 64, "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "h100x8"},
                                                    {"name": "gpus", "resourceClaimName": "rdma-0"}]},
    ),
    ("rollout.engine.vllm", "resource-claims-named-once-with-one-source"): (
        {"gpus": 2, "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "h100x2"}]},
        {"gpus": 2, "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "h100x2",
                                        "resourceClaimName": "shared"}]},
    ),
    ("trainer.optimizer", "min-lr-at-most-lr"): ({"lr": 0.01, "minLr": 0.001}, {"lr": 0.001, "minLr": 0.01}),
    ("trainer.optimizer", "warmup-within-decay"): ({"warmupSamples": 10, "decaySamples": 100}, {"warmupSamples": 100, "decaySamples": 10}),
    ("trainer", "one-micro-batching"): ({"replicas": 1, "maxTokensPerGPU": 64}, {"replicas": 1, "maxTokensPerGPU": 64, "microBatchSize": 2}),
    ("trainer", "parallel-sizes-divide-world"): (
        {"replicas": 2, "gpusPerReplica": 4, "tensorParallelSize": 8, "maxTokensPerGPU": 64},
        {"replicas": 3, "tensorParallelSize": 2, "maxTokensPerGPU": 64},
    ),
    ("trainer", "ppo-correction-needs-trainer-old-logprobs"): (
        {"replicas": 1, "maxTokensPerGPU": 64, "lossType": "ppo",
         "policyLoss": {"oldLogprobs": "trainer", "rolloutCorrection": {"type": "tis"}}},
        {"replicas": 1, "maxTokensPerGPU": 64, "lossType": "ppo", "policyLoss": {"rolloutCorrection": {"type": "tis"}}},
    ),
    ("trainer", "sft-has-no-old-policy"): (
        {"replicas": 1, "maxTokensPerGPU": 64, "lossType": "policy_gradient", "policyLoss": {"oldLogprobs": "trainer"}},
        {"replicas": 1, "maxTokensPerGPU": 64, "lossType": "sft", "policyLoss": {"oldLogprobs": "trainer"}},
    ),
    ("trainer", "ratio-options-need-ppo"): (
        {"replicas": 1, "maxTokensPerGPU": 64, "lossType": "ppo", "policyLoss": {"ratioLevel": "sequence",
                                                                                "clipRatioC": 3.0}},
        {"replicas": 1, "maxTokensPerGPU": 64, "lossType": "policy_gradient", "policyLoss": {"ratioLevel": "sequence"}},
    ),
    ("trainer.policyLoss.rolloutCorrection", "lower-threshold-for-mask"): (
        {"type": "mask", "lowerThreshold": 0.5}, {"type": "tis", "lowerThreshold": 0.5}),
    ("trainer.policyLoss.rolloutCorrection", "lower-below-threshold"): (
        {"type": "mask", "threshold": 1.5, "lowerThreshold": 0.9}, {"type": "mask", "threshold": 1.0, "lowerThreshold": 1.0}),
    ("rollout.source.generate", "overlong-buffer-within-max-new-tokens"): (
        {"sampling": {"maxNewTokens": 16}, "reward": {"overlong": {"buffer": 16}}},
        {"reward": {"overlong": {"buffer": 33}}}),
    ("", "policy-options-need-generate"): (
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64, "lossType": "policy_gradient",
                                                  "policyLoss": {"oldLogprobs": "trainer"}},
         "rollout": {"source": {"type": "generate", "generate": {}}}},
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64, "lossType": "policy_gradient",
                                                  "policyLoss": {"oldLogprobs": "trainer"}}},
    ),
    ("", "greedy-groups-never-vary"): (
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64},
         "rollout": {"source": {"type": "generate", "generate": {"sampling": {"temperature": 0.0}}},
                     "filters": {"zeroVariance": False}}},
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64},
         "rollout": {"source": {"type": "generate", "generate": {"sampling": {"temperature": 0.0}}}}},
    ),
    ("trainer", "expert-parallel-divides-data-parallel"): (
        {"replicas": 4, "expertParallelSize": 2, "maxTokensPerGPU": 64},
        {"replicas": 3, "expertParallelSize": 2, "maxTokensPerGPU": 64},
    ),
    # what the trainer's extra passes (the KL reference model, the forward-only pi_old pass) do not run under yet
    ("trainer", "kl-penalty-not-pipelined"): (
        {"replicas": 2, "pipelineParallelSize": 2, "maxTokensPerGPU": 64, "lossType": "ppo", "policyLoss": {"klCoef": 0}},
        {"replicas": 2, "pipelineParallelSize": 2, "maxTokensPerGPU": 64, "lossType": "ppo",
         "policyLoss": {"klCoef": 0.1}},
    ),
    ("trainer", "trainer-old-logprobs-not-pipelined"): (
        {"replicas": 2, "maxTokensPerGPU": 64, "lossType": "policy_gradient", "policyLoss": {"oldLogprobs": "trainer"}},
        {"replicas": 2, "pipelineParallelSize": 2, "maxTokensPerGPU": 64, "lossType": "policy_gradient",
         "policyLoss": {"oldLogprobs": "trainer"}},
    ),
    ("trainer", "trainer-old-logprobs-not-expert-parallel"): (
        {"replicas": 2, "expertParallelSize": 2, "maxTokensPerGPU": 64, "lossType": "policy_gradient",
         "policyLoss": {"oldLogprobs": "engine"}},
        {"replicas": 2, "expertParallelSize": 2, "maxTokensPerGPU": 64, "lossType": "policy_gradient",
         "policyLoss": {"oldLogprobs": "trainer"}},
    ),
    ("", "store-sync-single-stage"): (
        {"model": {"preset": "tiny"}, "trainer": {"replicas": 2, "maxTokensPerGPU": 64},
         "rollout": {"source": {"type": "generate", "generate": {}}}},
        {"model": {"preset": "tiny"}, "trainer": {"replicas": 2, "pipelineParallelSize": 2, "maxTokensPerGPU": 64},
         "rollout": {"source": {"type": "generate", "generate": {}}}},
    ),
    # data-parallel ranks = replicas × max(gpusPerReplica, 1) / (tensorParallelSize × pipelineParallelSize): 4, then 8
    ("", "fixed-steps-fill-the-ranks"): (
        {"model": {"preset": "tiny"}, "trainer": {"replicas": 2, "gpusPerReplica": 8, "tensorParallelSize": 4,
                                                  "maxTokensPerGPU": 64},
         "rollout": {"steps": {"policy": "fixed", "globalBatchSize": 1}, "groupSize": 4, "samplesPerRollout": 8}},
        {"model": {"preset": "tiny"}, "trainer": {"replicas": 2, "gpusPerReplica": 8, "tensorParallelSize": 2,
                                                  "maxTokensPerGPU": 64},
         "rollout": {"steps": {"policy": "fixed", "globalBatchSize": 1}, "groupSize": 4, "samplesPerRollout": 8}},
    ),
    ("rollout.source.synthetic", "min-length-at-most-max"): ({"minLength": 2, "maxLength": 8}, {"minLength": 9, "maxLength": 8}),
    ("rollout.source", "jsonl-settings"): ({"type": "jsonl", "jsonl": {"path": "/x"}}, {"type": "jsonl"}),
    ("rollout.source", "jsonl-only-for-jsonl"): ({"type": "synthetic"}, {"type": "synthetic", "jsonl": {"path": "/x"}}),
    ("rollout.source", "generate-settings"): ({"type": "generate", "generate": {}}, {"type": "generate"}),
    ("rollout.source.generate.prompts", "reasoning-gym-settings"): ({"type": "reasoningGym", "reasoningGym": {"name": "chain_sum"}},
                                             {"type": "reasoningGym"}),
    ("rollout.source.generate.prompts", "jsonl-settings"): ({"type": "jsonl", "jsonl": {"path": "/p.jsonl"}}, {"type": "jsonl"}),
    ("rollout.source.generate.prompts.synthetic", "min-length-at-most-max"): ({"minLength": 1, "maxLength": 3}, {"minLength": 4, "maxLength": 3}),
    ("rollout.source.generate.reward", "function-named"): ({"type": "function", "function": "m:f"}, {"type": "function"}),
    ("rollout.source.generate.environment", "environment-class-named"): (
        {"type": "class", "className": "envs:Maze"}, {"type": "class"}),
    ("rollout.source.generate.environment", "environment-class-only-for-class"): (
        {"type": "calculator"}, {"type": "calculator", "className": "envs:Maze"}),
    ("rollout.source.generate.agent", "agent-command-or-url"): (
        {"command": ["python3", "agent.py"]}, {"command": ["python3", "agent.py"], "url": "http://agents:8000/run"}),
    ("rollout.source.generate", "agent-or-environment"): (
        {"prompts": {"type": "jsonl", "jsonl": {"path": "/p.jsonl"}}, "agent": {"url": "http://agents:8000/run"}},
        {"prompts": {"type": "jsonl", "jsonl": {"path": "/p.jsonl"}}, "agent": {"url": "http://agents:8000/run"},
         "environment": {"type": "calculator"}}),
    ("rollout.source.generate", "agent-without-reward"): (
        {"prompts": {"type": "jsonl", "jsonl": {"path": "/p.jsonl"}}, "agent": {"command": ["./agent"]}},
        {"prompts": {"type": "jsonl", "jsonl": {"path": "/p.jsonl"}}, "agent": {"command": ["./agent"]},
         "reward": {"type": "exact_match"}}),
    ("rollout.source.generate", "agent-needs-text-prompts"): (
        {"prompts": {"type": "reasoningGym", "reasoningGym": {"name": "chain_sum"}}, "agent": {"command": ["./a"]}},
        {"agent": {"command": ["./agent"]}}),
    ("", "agent-needs-hf"): (
        {"model": {"hf": "/models/agent"}, "trainer": {"maxTokensPerGPU": 64},
         "rollout": {"source": {"type": "generate", "generate": {
             "prompts": {"type": "jsonl", "jsonl": {"path": "/p.jsonl"}}, "agent": {"command": ["./agent"]}}}}},
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64},
         "rollout": {"source": {"type": "generate", "generate": {
             "prompts": {"type": "jsonl", "jsonl": {"path": "/p.jsonl"}}, "agent": {"command": ["./agent"]}}}}},
    ),
    ("", "ppo-needs-generate"): (
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64, "lossType": "ppo"},
         "rollout": {"source": {"type": "generate", "generate": {}}}},
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64, "lossType": "ppo"}},
    ),
    # the engine of generated rollouts and how the weights reach it
    ("", "store-sync-needs-megatron"): (
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64},
         "rollout": {"source": {"type": "generate", "generate": {}}}},
        {"model": {"hf": "/models/smollm2"}, "trainer": {"maxTokensPerGPU": 64},
         "rollout": {"source": {"type": "generate", "generate": {}}, "engine": {"type": "vllm"}}},
    ),
    ("", "disk-broadcast-sync-need-vllm"): (
        {"model": {"hf": "/models/smollm2"}, "trainer": {"maxTokensPerGPU": 64},
         "rollout": {"source": {"type": "generate", "generate": {}}, "engine": {"type": "vllm"}},
         "weightSync": {"type": "broadcast"}},
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64},
         "rollout": {"source": {"type": "generate", "generate": {}}}, "weightSync": {"type": "disk"}},
    ),
    ("", "lora-sync-not-broadcast"): (
        {"model": {"hf": "/models/smollm2"}, "trainer": {"maxTokensPerGPU": 64, "lora": {"rank": 8}},
         "rollout": {"source": {"type": "generate", "generate": {}}, "engine": {"type": "vllm"}},
         "weightSync": {"type": "disk"}},
        {"model": {"hf": "/models/smollm2"}, "trainer": {"maxTokensPerGPU": 64, "lora": {"rank": 8}},
         "rollout": {"source": {"type": "generate", "generate": {}}, "engine": {"type": "vllm"}},
         "weightSync": {"type": "broadcast"}},
    ),
    ("", "lora-rank-fits-vllm"): (
        {"model": {"hf": "/models/smollm2"}, "trainer": {"maxTokensPerGPU": 64, "lora": {"rank": 512}},
         "rollout": {"source": {"type": "generate", "generate": {}}, "engine": {"type": "vllm"}},
         "weightSync": {"type": "disk"}},
        {"model": {"hf": "/models/smollm2"}, "trainer": {"maxTokensPerGPU": 64, "lora": {"rank": 1024}},
         "rollout": {"source": {"type": "generate", "generate": {}}, "engine": {"type": "vllm"}},
         "weightSync": {"type": "disk"}},
    ),
    ("", "lora-experts-not-vllm"): (
        {"model": {"hf": "/models/qwen3-moe"}, "trainer": {"maxTokensPerGPU": 64,
                                                            "lora": {"rank": 8, "targets": ["attention_qkv"]}},
         "rollout": {"source": {"type": "generate", "generate": {}}, "engine": {"type": "vllm"}},
         "weightSync": {"type": "disk"}},
        {"model": {"hf": "/models/qwen3-moe"}, "trainer": {"maxTokensPerGPU": 64,
                                                            "lora": {"rank": 8, "targets": ["experts"]}},
         "rollout": {"source": {"type": "generate", "generate": {}}, "engine": {"type": "vllm"}},
         "weightSync": {"type": "disk"}},
    ),
    ("", "routing-replay-needs-megatron-engine"): (
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64, "moe": {"routingReplay": True}},
         "rollout": {"source": {"type": "generate", "generate": {}}}},
        {"model": {"hf": "/models/qwen3-moe"}, "trainer": {"maxTokensPerGPU": 64, "moe": {"routingReplay": True}},
         "rollout": {"source": {"type": "generate", "generate": {}}, "engine": {"type": "vllm"}},
         "weightSync": {"type": "disk"}},
    ),
    ("", "routing-replay-without-partial-rollouts"): (
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64, "moe": {"routingReplay": True}},
         "rollout": {"source": {"type": "generate", "generate": {}}, "overSampling": 0.25}},
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64, "moe": {"routingReplay": True}},
         "rollout": {"source": {"type": "generate", "generate": {}}, "overSampling": 0.25, "partialRollout": True}},
    ),
    ("", "vllm-needs-hf"): (
        {"model": {"hf": "/models/smollm2"}, "trainer": {"maxTokensPerGPU": 64},
         "rollout": {"source": {"type": "generate", "generate": {}}, "engine": {"type": "vllm"}},
         "weightSync": {"type": "disk"}},
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64},
         "rollout": {"source": {"type": "generate", "generate": {}}, "engine": {"type": "vllm"}},
         "weightSync": {"type": "disk"}},
    ),
    # rewards served over HTTP, and the evaluation (its prompts and reward are the same models as the run's)
    **{(f"{at}", "remote-settings"): ({"type": "remote", "remote": {"url": "http://rm:8000/score"}},
                                      {"type": "exact_match", "remote": {"url": "http://rm:8000/score"}})
       for at in ("rollout.source.generate.reward", "rollout.eval.reward")},
    **{(f"{at}", "judge-settings"): ({"type": "judge", "judge": {"url": "http://j:8000/v1", "model": "m"}},
                                     {"type": "judge"})
       for at in ("rollout.source.generate.reward", "rollout.eval.reward")},
    ("rollout.eval.reward", "function-named"): ({"type": "function", "function": "m:f"}, {"type": "function"}),
    **{(f"{at}.{kind}", "header-names"): (
        {"url": "http://s:8000/x", **extra, "headers": {"X-Api-Key": {"name": "s"}}},
        {"url": "http://s:8000/x", **extra, "headers": {"X Api Key": {"name": "s"}}})
       for at in ("rollout.source.generate.reward", "rollout.eval.reward")
       for kind, extra in (("remote", {}), ("judge", {"model": "m"}))},
    ("rollout.eval", "eval-reward-unshaped"): (
        {"intervalRollouts": 4, "prompts": {}, "reward": {"type": "token_match"}},
        {"intervalRollouts": 4, "prompts": {}, "reward": {"type": "token_match", "overlong": {"buffer": 4}}}),
    ("rollout.eval.prompts", "reasoning-gym-settings"): ({"type": "reasoningGym", "reasoningGym": {"name": "x"}},
                                                         {"type": "reasoningGym"}),
    ("rollout.eval.prompts", "jsonl-settings"): ({"type": "jsonl", "jsonl": {"path": "p.jsonl"}}, {"type": "jsonl"}),
    ("rollout.eval.prompts.synthetic", "min-length-at-most-max"): ({"minLength": 2, "maxLength": 3},
                                                                   {"minLength": 4, "maxLength": 3}),
    ("rollout", "eval-needs-generate"): (
        {"source": {"type": "generate", "generate": {}}, "eval": {"intervalRollouts": 4, "prompts": {}}},
        {"source": {"type": "generate", "generate": {"environment": {"type": "calculator"}}},
         "eval": {"intervalRollouts": 4, "prompts": {}}}),
    ("rollout.steps", "batch-size-with-fixed"): ({"policy": "fixed", "globalBatchSize": 8}, {"policy": "dynamic", "globalBatchSize": 8}),
    ("rollout", "whole-groups"): ({"samplesPerRollout": 64, "groupSize": 8}, {"samplesPerRollout": 60, "groupSize": 8}),
    ("rollout", "partial-needs-over-sampling"): ({"overSampling": 0.25, "partialRollout": True},
                                                 {"partialRollout": True}),
    ("rollout", "over-sampling-single-turn"): (
        {"overSampling": 0.25, "source": {"type": "generate", "generate": {}}},
        {"overSampling": 0.25, "source": {"type": "generate", "generate": {"environment": {"type": "calculator"}}}}),
    ("rollout", "over-sampling-not-for-agents"): (
        {"overSampling": 0.25, "source": {"type": "generate", "generate": {}}},
        {"overSampling": 0.25, "source": {"type": "generate", "generate": {
            "prompts": {"type": "jsonl", "jsonl": {"path": "/p.jsonl"}}, "agent": {"command": ["./agent"]}}}}),
    ("rollout", "zero-variance-needs-groups"): ({"samplesPerRollout": 8, "groupSize": 1, "filters": {"zeroVariance": False}},
                                                {"samplesPerRollout": 8, "groupSize": 1}),
    ("rollout.engine", "replicas-of-own-servers"): ({"type": "vllm", "url": "http://a:8000,http://b:8000"},
                                                    {"type": "vllm", "url": "http://a:8000", "replicas": 2}),
    ("rollout.engine.vllm", "concurrency-auto-or-bounded"): ({"concurrency": 8}, {"concurrency": 0}),
    ("rollout.engine", "nodes-of-own-servers"): ({"type": "vllm", "vllm": {"nodes": 2, "gpus": 1}},
                                                 {"type": "vllm", "url": "http://a:8000", "vllm": {"nodes": 2, "gpus": 1}}),
    ("store", "url-or-managed"): ({"url": "redis://r:6379/0"}, {"url": "redis://r:6379/0", "managed": True}),
    ("failurePolicy.rules[items]", "restart-role-names-a-role"): (
        {"roles": ["rollout", "engine"], "action": "RestartRole"}, {"roles": ["trainer"], "action": "RestartRole"}),
    ("placement.trainer.kueue", "required-or-preferred"): ({"required": "rack"}, {"required": "rack", "preferred": "block"}),
    ("placement.trainer.kueue", "slice-level-and-size"): ({"sliceRequired": "nvidia.com/gpu.clique", "sliceSize": 2},
                                                          {"sliceRequired": "nvidia.com/gpu.clique"}),
    ("placement.trainer.volcano", "one-tier"): ({"highestTierAllowed": 1},
                                                {"highestTierAllowed": 1, "highestTierName": "leaf"}),
    ("", "kueue-placement-needs-queue"): (
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64}, "queueName": "team-a",
         "placement": {"trainer": {"kueue": {"required": "rack"}}}},
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64},
         "placement": {"trainer": {"kueue": {"required": "rack"}}}},
    ),
    ("", "volcano-placement-needs-volcano"): (
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64},
         "gangScheduling": {"enabled": True, "provider": "volcano"},
         "placement": {"trainer": {"volcano": {"highestTierAllowed": 1}}}},
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64},
         "gangScheduling": {"enabled": True, "provider": "coscheduling"},
         "placement": {"rollout": {"volcano": {"highestTierAllowed": 1}}}},
    ),
    ("", "slices-divide-the-pods"): (
        {"model": {"preset": "tiny"}, "trainer": {"replicas": 4, "maxTokensPerGPU": 64}, "queueName": "team-a",
         "placement": {"trainer": {"kueue": {"sliceRequired": "nvidia.com/gpu.clique", "sliceSize": 2}}}},
        {"model": {"preset": "tiny"}, "trainer": {"replicas": 3, "maxTokensPerGPU": 64}, "queueName": "team-a",
         "placement": {"trainer": {"kueue": {"sliceRequired": "nvidia.com/gpu.clique", "sliceSize": 2}}}},
    ),
    ("podTemplate", "mounts-name-volumes"): (
        {"volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "c"}}],
         "volumeMounts": [{"name": "ckpt", "mountPath": "/checkpoints"}]},
        {"volumes": [{"name": "ckpt", "emptyDir": {}}], "volumeMounts": [{"name": "data", "mountPath": "/data"}]},
    ),
}

MODEL_OF = {
    "model": ModelSpec, "model.moe": MoESpec, "trainer.optimizer": OptimizerSpec, "trainer": TrainerSpec,
    "trainer.performance.recompute": RecomputeSpec, "trainer.lora": LoRASpec,
    "rollout.source.synthetic": SyntheticSource, "rollout.source": SourceSpec,
    "rollout.steps": StepPolicy, "rollout": RolloutSpec, "store": StoreSpec,
    "rollout.engine": EngineSpec, "rollout.engine.vllm": VLLMSettings,
    "podTemplate": PodTemplateOverrides, "rollout.source.generate.prompts": PromptsSpec,
    "rollout.source.generate.prompts.synthetic": SyntheticPrompts,
    "rollout.source.generate.reward": RewardSpec, "": models.TrainingRunSpec,
    "rollout.eval.reward": RewardSpec, "rollout.eval": EvalSpec, "rollout.eval.prompts": PromptsSpec,
    "rollout.eval.prompts.synthetic": SyntheticPrompts,
    **{f"{at}.{kind}": model for at in ("rollout.source.generate.reward", "rollout.eval.reward")
       for kind, model in (("remote", RemoteRewardSpec), ("judge", JudgeSpec))},
    "trainer.policyLoss.rolloutCorrection": RolloutCorrectionSpec,
    "rollout.source.generate": GenerateSource,
    "rollout.source.generate.environment": EnvironmentSpec,
    "rollout.source.generate.agent": AgentSpec,
    "failurePolicy.rules[items]": FailureRule, "placement.trainer.kueue": KueueTopology,
    "placement.rollout.kueue": KueueTopology, "placement.trainer.volcano": VolcanoTopology,
    "placement.rollout.volcano": VolcanoTopology,
}

# Transition rules (over oldSelf: run by the API server on updates only; a single object has no Python twin):
# (path, rule name) -> (the stored object, an update the rule admits, an update it refuses).
TRANSITION_CASES: dict[tuple[str, str], tuple[dict, dict, dict]] = {
    ("", "managed-by-immutable"): (
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64}, "managedBy": "kueue.x-k8s.io/multikueue"},
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64, "replicas": 4},
         "managedBy": "kueue.x-k8s.io/multikueue"},
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64}, "managedBy": "trainingrun.dev/operator"},
    ),
    ("", "engine-replicas-fixed-under-kueue"): (
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64}, "queueName": "team-a",
         "rollout": {"engine": {"type": "vllm", "replicas": 2}}},
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64, "replicas": 4}, "queueName": "team-a",
         "rollout": {"engine": {"type": "vllm", "replicas": 2}}},
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64}, "queueName": "team-a",
         "rollout": {"engine": {"type": "vllm", "replicas": 3}}},
    ),
}


def all_rules() -> list[tuple[str, str, str]]:
    """(path, name, rule) of every rule in the CRD: each rule of a node is its model's rule of that name."""
    out = []
    for path, node in walk(spec_schema()):
        served = node.get("x-kubernetes-validations", [])
        if not served:
            continue
        model = MODEL_OF[path.lstrip(".")]
        assert [r["rule"] for r in served] == [r.rule for r in model.CEL_RULES], path
        names = [r.name for r in model.CEL_RULES]
        assert len(set(names)) == len(names), f"{model.__name__}: rule names repeat: {names}"
        out += [(path.lstrip("."), name, r["rule"]) for name, r in zip(names, served)]
    return out


def test_every_cel_rule_has_a_case():
    # the same model's rules under several paths (placement.rollout.* and placement.trainer.*) are one case each
    rules = {(path.replace("placement.rollout.", "placement.trainer."), name) for path, name, _ in all_rules()}
    cases = set(CASES) | set(TRANSITION_CASES)
    assert rules == cases, f"rules without a test case: {rules - cases}; stale cases: {cases - rules}"


@pytest.mark.parametrize("path,name", sorted(TRANSITION_CASES))
def test_transition_rule_admits_and_refuses_updates(path, name):
    schema = node_at(spec_schema(), path)
    rule = MODEL_OF[path].cel_rule(name).rule
    assert rule in [r["rule"] for r in schema["x-kubernetes-validations"]]
    old, good, bad = (apply_defaults(x, schema) for x in TRANSITION_CASES[(path, name)])
    assert evaluate_rule(rule, good, schema, old=old) is True
    assert evaluate_rule(rule, bad, schema, old=old) is False
    assert evaluate_rule(rule, old, schema, old=bad) is False  # and back
    if name == "managed-by-immutable":
        # unset on both sides, or set to the same value: admitted; set or removed later: refused
        bare = {k: v for k, v in old.items() if k != "managedBy"}
        assert evaluate_rule(rule, bare, schema, old=bare) is True
        assert evaluate_rule(rule, old, schema, old=bare) is False
        assert evaluate_rule(rule, bare, schema, old=old) is False
    if name == "engine-replicas-fixed-under-kueue":
        # without a queue the pool resizes (2 -> 3 admitted); an engine left unset counts as its default, 1
        free = {k: v for k, v in old.items() if k != "queueName"}
        free_bad = {k: v for k, v in bad.items() if k != "queueName"}
        assert evaluate_rule(rule, free_bad, schema, old=free) is True
        bare = {k: v for k, v in old.items() if k != "rollout"}
        one = {**bare, "rollout": {**bare.get("rollout", {}), "engine": {"type": "vllm", "replicas": 1}}}
        assert evaluate_rule(rule, apply_defaults(one, schema), schema, old=bare) is True
        assert evaluate_rule(rule, bad, schema, old=bare) is False
    # an object on its own (a create, `trainingrun validate`) is never checked against a transition rule
    from trainingrun.api.checks import is_transition_rule

    assert is_transition_rule(rule)
    transitions = {r.name for r in models.TrainingRunSpec.CEL_RULES if is_transition_rule(r.rule)}
    assert transitions == {n for p, n in TRANSITION_CASES if p == ""}


@pytest.mark.parametrize("path,name", sorted(CASES))
def test_cel_rule_passes_and_fails_like_its_python_twin(path, name):
    schema = node_at(spec_schema(), path)
    model = MODEL_OF[path]
    rule = model.cel_rule(name).rule
    assert rule in [r["rule"] for r in schema["x-kubernetes-validations"]]
    good, bad = CASES[(path, name)]
    # The CEL engine, on the defaulted object as the API server sees it.
    assert evaluate_rule(rule, apply_defaults(good, schema), schema) is True
    assert evaluate_rule(rule, apply_defaults(bad, schema), schema) is False
    # The pydantic model holds the same rule.
    model.model_validate(copy.deepcopy(good))
    with pytest.raises(ValidationError) as err:
        model.model_validate(copy.deepcopy(bad))
    assert model.cel_rule(name).message in str(err.value)


@pytest.mark.parametrize("value,admitted", [("auto", True), (1, True), (4096, True), (0, False), (4097, False),
                                            ("fast", False), ("64", False)])
def test_engine_concurrency_is_auto_or_a_bounded_integer(value, admitted):
    """rollout.engine.vllm.concurrency is int-or-string in the CRD: its CEL rule and the model admit exactly 'auto'
    and 1..4096; unset, it defaults to auto."""
    schema = node_at(spec_schema(), "rollout.engine.vllm")
    assert schema["properties"]["concurrency"].get("x-kubernetes-int-or-string") is True
    assert apply_defaults({}, schema)["concurrency"] == "auto" and VLLMSettings().concurrency == "auto"
    rule = VLLMSettings.cel_rule("concurrency-auto-or-bounded").rule
    assert evaluate_rule(rule, apply_defaults({"concurrency": value}, schema), schema) is admitted
    if admitted:
        assert VLLMSettings.model_validate({"concurrency": value}, strict=True).concurrency == value
    else:
        with pytest.raises(ValidationError):
            VLLMSettings.model_validate({"concurrency": value}, strict=True)


def test_number_fields_are_doubles_in_cel():
    # lr: 1 arrives as an int in YAML; the API server types it as a double, so `minLr <= lr` compares doubles.
    schema = node_at(spec_schema(), "trainer.optimizer")
    obj = apply_defaults({"lr": 1, "minLr": 0}, schema)
    assert evaluate_rule(OptimizerSpec.cel_rule("min-lr-at-most-lr").rule, obj, schema)


def test_crd_yaml_round_trips():
    text = crd_yaml()
    assert yaml.safe_load(text) == crd()


def test_engine_rules_bind_generated_rollouts_only():
    """Replayed rollouts use no engine and sync no weights: whatever rollout.engine and weightSync say is admitted,
    by the CRD's rules and by their Python twins alike."""
    schema = spec_schema()
    replay = {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64},
              "rollout": {"source": {"type": "synthetic"}, "engine": {"type": "vllm"}}, "weightSync": {"type": "store"}}
    for name in ("store-sync-needs-megatron", "disk-broadcast-sync-need-vllm", "vllm-needs-hf"):
        assert evaluate_rule(models.TrainingRunSpec.cel_rule(name).rule, apply_defaults(replay, schema), schema)
    models.TrainingRunSpec.model_validate(replay)
    # an absent rollout (the API server defaults nothing inside it) is not an error of the rules either
    bare = {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64}}
    for rule in models.TrainingRunSpec.CEL_RULES:
        old = apply_defaults(bare, schema) if "oldSelf" in rule.rule else None
        assert evaluate_rule(rule.rule, apply_defaults(bare, schema), schema, old=old), rule.name
