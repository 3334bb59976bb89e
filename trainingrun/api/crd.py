"""The TrainingRun CustomResourceDefinition, generated from the pydantic models.

`trainingrun crd` prints it; `crds/trainingrun.yaml` is its checked-in copy (a test keeps them identical).

pydantic's JSON schema is turned into a *structural* OpenAPI v3 schema, as apiextensions.k8s.io/v1 requires: `$ref`s
inlined, `anyOf [X, null]` of optional fields collapsed to X, int-or-string quantities marked
`x-kubernetes-int-or-string`, free-form objects marked `x-kubernetes-preserve-unknown-fields`, and each model's
CEL rules (`CEL_RULES`, of every model in `models.ALL_MODELS`) attached as `x-kubernetes-validations` to the object
they constrain.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import yaml

from trainingrun.api.constants import APP, CRD_NAME, GROUP, KIND, LABEL_NAME, LIST_KIND, PLURAL, SHORT_NAME, SINGULAR, VERSION
from trainingrun.api.models import ALL_MODELS, TrainingRunSpec, TrainingRunStatus

# JSON-schema keywords kept in the structural schema; everything else pydantic emits (title, ...) is dropped.
_KEEP = {
    "type", "description", "properties", "required", "items", "enum", "default", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "additionalProperties",
    "minItems", "maxItems", "minProperties", "maxProperties", "format", "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
}

# CEL cost estimation needs bounds on strings, lists and maps reached by rules; these caps apply to every
# unbounded string / list / map in the schema (generous, far above any real TrainingRun).
MAX_STRING = 4096
MAX_ITEMS = 256
MAX_PROPERTIES = 256


def _rules_by_title() -> dict[str, list[dict[str, Any]]]:
    """Each model's CEL rules by its schema title (the class name): two models of one name would share a title."""
    names = [model.__name__ for model in ALL_MODELS]
    if len(set(names)) != len(names):
        raise ValueError(f"two API models share a name: {sorted(n for n in set(names) if names.count(n) > 1)}")
    out = {}
    for model in ALL_MODELS:
        if model.CEL_RULES:
            out[model.__name__] = [r.model_dump(exclude_none=True, exclude={"name"}) for r in model.CEL_RULES]
    return out


def _convert(node: Any, defs: dict[str, Any], rules: dict[str, list[dict[str, Any]]]) -> Any:
    """Structural OpenAPI v3 from one pydantic JSON-schema node."""
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        target = dict(defs[name])
        target.setdefault("title", name)
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _convert(merged, defs, rules)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        types = sorted(o.get("type", "") for o in options)
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if types == ["integer", "string"]:  # a Kubernetes quantity
            out = {"x-kubernetes-int-or-string": True}
            for key in ("description", "default"):
                if key in rest:
                    out[key] = rest[key]
            return out
        if len(options) != 1:
            raise ValueError(f"cannot express anyOf {node['anyOf']} in a structural schema")
        merged = {**options[0], **rest}
        if rest.get("default", "unset") is None:
            merged.pop("default")
        return _convert(merged, defs, rules)

    title = node.get("title")
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key not in _KEEP:
            continue
        if key == "properties":
            out[key] = {k: _convert(v, defs, rules) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _convert(value, defs, rules)
        elif key == "default" and isinstance(value, (dict, list)) and not value:
            continue  # empty containers: nothing to default
        else:
            out[key] = copy.deepcopy(value)

    # JSON Schema's numeric exclusive bounds → OpenAPI v3.0's boolean form.
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(out.get(exclusive), (int, float)) and not isinstance(out[exclusive], bool):
            out[bound] = out.pop(exclusive)
            out[exclusive] = True
    if out.get("type") == "object" and "properties" not in out:
        extra = out.get("additionalProperties")
        if extra is True or extra is None or extra == {}:
            out.pop("additionalProperties", None)
            out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("type") == "object" and "properties" in out:
        out.pop("additionalProperties", None)  # extra=forbid: unknown fields are pruned by the API server
    if out.get("type") == "string" and "maxLength" not in out and "enum" not in out:
        out["maxLength"] = MAX_STRING
    if out.get("type") == "array" and "maxItems" not in out:
        out["maxItems"] = MAX_ITEMS
    if out.get("type") == "object" and "additionalProperties" in out:
        out.setdefault("maxProperties", MAX_PROPERTIES)
    if title in rules and node.get("type") == "object":
        out["x-kubernetes-validations"] = copy.deepcopy(rules[title])  # a model used twice: no YAML aliases
    order = {key: i for i, key in enumerate(("type", "description"))}
    return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))


def spec_schema() -> dict[str, Any]:
    """Structural OpenAPI v3 schema of `spec`."""
    raw = TrainingRunSpec.model_json_schema(by_alias=True)
    raw["title"] = "TrainingRunSpec"
    return _convert(raw, raw.get("$defs", {}), _rules_by_title())


def status_schema() -> dict[str, Any]:
    raw = TrainingRunStatus.model_json_schema(by_alias=True)
    return _convert(raw, raw.get("$defs", {}), {})


def openapi_schema() -> dict[str, Any]:
    """The version's openAPIV3Schema (the whole object)."""
    return {
        "type": "object",
        "description": "A post-training run whose global batch size may vary from step to step.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
    }


# The scale subresource (`kubectl scale tr/NAME --replicas N`, autoscalers): the run's engine pool.
SCALE = {"specReplicasPath": ".spec.rollout.engine.replicas", "statusReplicasPath": ".status.engineReplicas",
         "labelSelectorPath": ".status.engineSelector"}


def crd() -> dict[str, Any]:
    """The whole CustomResourceDefinition object."""
    columns = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Run phase."},
        {"name": "Step", "type": "integer", "jsonPath": ".status.step", "description": "Optimizer steps done."},
        {"name": "GBS", "type": "integer", "jsonPath": ".status.lastGlobalBatchSize",
         "description": "Samples in the last step."},
        {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "description": "Group restarts."},
        {"name": "Progress", "type": "integer", "jsonPath": ".status.progress.percentage",
         "description": "Rollouts trained, in percent."},
        {"name": "ETA", "type": "integer", "jsonPath": ".status.progress.estimatedRemainingSeconds", "priority": 1,
         "description": "Estimated seconds left."},
        {"name": "Samples", "type": "integer", "jsonPath": ".status.samplesConsumed", "priority": 1,
         "description": "Samples trained on."},
        {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1,
         "description": "Last message."},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {LABEL_NAME: APP, "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": LIST_KIND,
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": [SHORT_NAME],
                "categories": ["all", APP],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}, "scale": SCALE},
                    "additionalPrinterColumns": columns,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


HEADER = "# Generated by `trainingrun crd` from trainingrun/api/ (models.py, spec/). Do not edit; run `make crd`.\n"


def crd_yaml() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=120, allow_unicode=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", "-o", metavar="FILE", help="write to FILE instead of standard output")


def run(args: argparse.Namespace) -> int:
    text = crd_yaml()
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        print(text, end="")
    return 0
