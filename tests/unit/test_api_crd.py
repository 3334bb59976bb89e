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
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    for wanted in ("Phase", "Step", "GBS", "Restarts", "Age"):
        assert wanted in columns


# ---------------------------------------------------------------------------------------------------- CEL rules
def node_at(schema: dict[str, Any], path: str) -> dict[str, Any]:
    node = schema
    for part in filter(None, path.split(".")):
        node = node["properties"][part]
    return node


# rule owner model -> (schema path, rule index) -> (passing object, failing object); objects are the node's value.
CASES: dict[tuple[str, int], tuple[dict, dict]] = {
    ("model", 0): ({"preset": "tiny"}, {"numLayers": 2, "hiddenSize": 64}),
    ("model", 1): (
        {"preset": "tiny", "hiddenSize": 64, "numAttentionHeads": 4},
        {"preset": "tiny", "hiddenSize": 66, "numAttentionHeads": 4},
    ),
    ("model", 2): (
        {"preset": "tiny-llama", "numAttentionHeads": 4, "numQueryGroups": 2},
        {"preset": "tiny-llama", "numAttentionHeads": 4, "numQueryGroups": 3},
    ),
    ("model", 3): ({"hf": "/models/smollm2", "seqLength": 512}, {"hf": "/models/smollm2", "preset": "tiny"}),
    ("trainer.optimizer", 0): ({"lr": 0.01, "minLr": 0.001}, {"lr": 0.001, "minLr": 0.01}),
    ("trainer.optimizer", 1): ({"warmupSamples": 10, "decaySamples": 100}, {"warmupSamples": 100, "decaySamples": 10}),
    ("trainer", 0): ({"replicas": 1, "maxTokensPerGPU": 64}, {"replicas": 1, "maxTokensPerGPU": 64, "microBatchSize": 2}),
    ("trainer", 1): (
        {"replicas": 2, "gpusPerReplica": 4, "tensorParallelSize": 8, "maxTokensPerGPU": 64},
        {"replicas": 3, "tensorParallelSize": 2, "maxTokensPerGPU": 64},
    ),
    ("rollout.source.synthetic", 0): ({"minLength": 2, "maxLength": 8}, {"minLength": 9, "maxLength": 8}),
    ("rollout.source", 0): ({"type": "jsonl", "jsonl": {"path": "/x"}}, {"type": "jsonl"}),
    ("rollout.source", 1): ({"type": "synthetic"}, {"type": "synthetic", "jsonl": {"path": "/x"}}),
    ("rollout.source", 2): ({"type": "generate", "generate": {}}, {"type": "generate"}),
    ("rollout.source.generate.prompts", 0): ({"type": "reasoningGym", "reasoningGym": {"name": "chain_sum"}},
                                             {"type": "reasoningGym"}),
    ("rollout.source.generate.prompts", 1): ({"type": "jsonl", "jsonl": {"path": "/p.jsonl"}}, {"type": "jsonl"}),
    ("rollout.source.generate.prompts.synthetic", 0): ({"minLength": 1, "maxLength": 3}, {"minLength": 4, "maxLength": 3}),
    ("rollout.source.generate.reward", 0): ({"type": "function", "function": "m:f"}, {"type": "function"}),
    ("", 0): (
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64, "lossType": "ppo"},
         "rollout": {"source": {"type": "generate", "generate": {}}}},
        {"model": {"preset": "tiny"}, "trainer": {"maxTokensPerGPU": 64, "lossType": "ppo"}},
    ),
    ("rollout.steps", 0): ({"policy": "fixed", "globalBatchSize": 8}, {"policy": "dynamic", "globalBatchSize": 8}),
    ("rollout", 0): ({"samplesPerRollout": 64, "groupSize": 8}, {"samplesPerRollout": 60, "groupSize": 8}),
    ("store", 0): ({"url": "redis://r:6379/0"}, {"url": "redis://r:6379/0", "managed": True}),
    ("podTemplate", 0): (
        {"volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "c"}}],
         "volumeMounts": [{"name": "ckpt", "mountPath": "/checkpoints"}]},
        {"volumes": [{"name": "ckpt", "emptyDir": {}}], "volumeMounts": [{"name": "data", "mountPath": "/data"}]},
    ),
}

MODEL_OF = {
    "model": models.ModelSpec, "trainer.optimizer": models.OptimizerSpec, "trainer": models.TrainerSpec,
    "rollout.source.synthetic": models.SyntheticSource, "rollout.source": models.SourceSpec,
    "rollout.steps": models.StepPolicy, "rollout": models.RolloutSpec, "store": models.StoreSpec,
    "podTemplate": models.PodTemplateOverrides, "rollout.source.generate.prompts": models.PromptsSpec,
    "rollout.source.generate.prompts.synthetic": models.SyntheticPrompts,
    "rollout.source.generate.reward": models.RewardSpec, "": models.TrainingRunSpec,
}


def all_rules() -> list[tuple[str, int, str]]:
    out = []
    for path, node in walk(spec_schema()):
        for i, rule in enumerate(node.get("x-kubernetes-validations", [])):
            out.append((path.lstrip("."), i, rule["rule"]))
    return out


def test_every_cel_rule_has_a_case():
    rules = {(path, i) for path, i, _ in all_rules()}
    assert rules == set(CASES), f"rules without a test case: {rules - set(CASES)}; stale cases: {set(CASES) - rules}"


@pytest.mark.parametrize("path,index", sorted(CASES))
def test_cel_rule_passes_and_fails_like_its_python_twin(path, index):
    schema = node_at(spec_schema(), path)
    rule = schema["x-kubernetes-validations"][index]["rule"]
    good, bad = CASES[(path, index)]
    # The CEL engine, on the defaulted object as the API server sees it.
    assert evaluate_rule(rule, apply_defaults(good, schema), schema) is True
    assert evaluate_rule(rule, apply_defaults(bad, schema), schema) is False
    # The pydantic model holds the same rule.
    model = MODEL_OF[path]
    model.model_validate(copy.deepcopy(good))
    with pytest.raises(ValidationError) as err:
        model.model_validate(copy.deepcopy(bad))
    assert model.CEL_RULES[index].message in str(err.value)


def test_number_fields_are_doubles_in_cel():
    # lr: 1 arrives as an int in YAML; the API server types it as a double, so `minLr <= lr` compares doubles.
    schema = node_at(spec_schema(), "trainer.optimizer")
    obj = apply_defaults({"lr": 1, "minLr": 0}, schema)
    assert evaluate_rule(schema["x-kubernetes-validations"][0]["rule"], obj, schema)


def test_crd_yaml_round_trips():
    text = crd_yaml()
    assert yaml.safe_load(text) == crd()
