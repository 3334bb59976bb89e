"""What a decoded TrainingRun document must hold, checked offline as the API server would: the CRD's OpenAPI schema
(types, bounds, enums, required fields; unknown fields rejected as `kubectl apply`'s strict field validation does)
and its `x-kubernetes-validations` CEL rules, evaluated with a real CEL engine (cel-python) on the object after
defaulting, as the API server does, then the strict models. `validate_document` returns one `Problem` per error,
naming the field path — and, for a document the API server would admit, one per role whose memory plan does not fit
its GPUs (`kind` "memory", `api.memory`); the manifest loader (`trainingrun.api.manifest`) and `trainingrun validate`
(`trainingrun.api.validate`) turn them into `FILE:LINE:COL: FIELD.PATH: message` lines.

The schema and CEL checks need the `validate` extra (jsonschema, cel-python); the models are always checked.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from trainingrun.api.constants import API_VERSION, KIND
from trainingrun.api.crd import spec_schema
from trainingrun.api.memory import plan_problems
from trainingrun.api.models import parse_trainingrun
from trainingrun.api.spec.engine import VLLM_CPU_HEAD_DIMS
from trainingrun.api.yamlcodec import dotted
from trainingrun.modeling.architecture import check_parallel
from trainingrun.modeling.lora_targets import LoRASettings, check_adapter, check_lora


@dataclass(frozen=True)
class Problem:
    parts: tuple[str | int, ...]  # field path, e.g. ("spec", "trainer", "replicas")
    message: str
    kind: str = "spec"  # "spec": the API server would refuse it; "memory": admitted, but its memory plan does not fit

    @property
    def path(self) -> str:
        """Dotted field path, e.g. spec.trainer.replicas or spec.podTemplate.volumes[0]."""
        return dotted(self.parts)

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.parts else self.message


# ------------------------------------------------------------------------------------------------ schema helpers
@lru_cache(maxsize=1)
def _schemas() -> tuple[dict[str, Any], dict[str, Any]]:
    """(CRD spec schema as served, the same made strict for validation)."""
    served = spec_schema()
    return served, _strict(copy.deepcopy(served))


def _strict(node: dict[str, Any]) -> dict[str, Any]:
    """Unknown fields are errors (strict field validation), except under preserve-unknown-fields."""
    if node.get("type") == "object" and "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        node["additionalProperties"] = False
    for child in node.get("properties", {}).values():
        _strict(child)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            _strict(node[key])
    if node.get("x-kubernetes-int-or-string"):
        node["type"] = ["integer", "string"]
    return node


def _allowed(error: Any) -> str:
    """What the schema allows at the failing keyword, in words."""
    schema = error.schema
    kw = error.validator
    if kw == "enum":
        return "one of " + ", ".join(repr(v) for v in schema["enum"])
    if kw == "type":
        t = schema["type"]
        return " or ".join(t) if isinstance(t, list) else t
    if kw in ("minimum", "maximum"):
        parts = []
        if "minimum" in schema:
            parts.append((">" if schema.get("exclusiveMinimum") else ">=") + f" {schema['minimum']}")
        if "maximum" in schema:
            parts.append(("<" if schema.get("exclusiveMaximum") else "<=") + f" {schema['maximum']}")
        return f"{schema.get('type', 'number')} " + " and ".join(parts)
    if kw == "minLength":
        return f"at least {schema['minLength']} characters"
    if kw == "maxLength":
        return f"at most {schema['maxLength']} characters"
    if kw == "pattern":
        return f"a string matching {schema['pattern']}"
    if kw == "additionalProperties":
        return "fields " + ", ".join(sorted(schema.get("properties", {})))
    if kw == "required":
        return "the field must be set"
    if kw in ("maxItems", "maxProperties"):
        return f"at most {schema[kw]} entries"
    return str(error.validator_value)


def _schema_problems(spec: Any) -> list[Problem]:
    import jsonschema  # deferred: the optional `validate` extra

    _, strict = _schemas()
    validator = jsonschema.Draft4Validator(strict)
    problems = []
    for error in sorted(validator.iter_errors(spec), key=lambda e: (list(map(str, e.absolute_path)), e.message)):
        parts = ("spec", *error.absolute_path)
        if error.validator == "additionalProperties":
            unknown = sorted(set(error.instance) - set(error.schema.get("properties", {})))
            for field in unknown:
                problems.append(Problem((*parts, field), f"unknown field (allowed: {_allowed(error)})"))
            continue
        if error.validator == "required":
            missing = error.message.split("'")[1] if "'" in error.message else error.message
            problems.append(Problem((*parts, missing), "required field is missing"))
            continue
        got = error.instance
        shown = json.dumps(got) if not isinstance(got, (dict, list)) else type(got).__name__
        message = error.message
        if error.validator == "type":
            message = f"{_type_name(got)}, not {_allowed(error)}{_bool_hint(got, error.schema)}"
        problems.append(Problem(parts, f"invalid value {shown}: {message} (allowed: {_allowed(error)})"))
    return problems


def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "a mapping",
            list: "a list", type(None): "null"}.get(type(value), type(value).__name__)


def _bool_hint(value: Any, schema: dict[str, Any]) -> str:
    if isinstance(value, bool) and schema.get("type") == "string":
        return " (YAML reads an unquoted y/n/yes/no/on/off/true/false as a boolean: quote it)"
    if isinstance(value, str) and schema.get("type") in ("integer", "number"):
        return " (numbers are not quoted; a quoted value is a string and is not converted)"
    return ""


# --------------------------------------------------------------------------------------------- defaults and CEL
def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Fill in schema defaults as the API server does before CEL rules run."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for name, sub in schema["properties"].items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = apply_defaults(out[name], sub)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(v, schema["items"]) for v in value]
    return value


def to_cel(value: Any, schema: dict[str, Any]) -> Any:
    """A CEL value typed by the schema (a `number` field holding 1 is the double 1.0, as in the API server)."""
    import celpy  # deferred: the optional `validate` extra

    t = schema.get("type")
    if isinstance(value, bool):
        return celpy.celtypes.BoolType(value)
    if t == "number" and isinstance(value, (int, float)):
        return celpy.celtypes.DoubleType(float(value))
    if isinstance(value, int):
        return celpy.celtypes.IntType(value)
    if isinstance(value, float):
        return celpy.celtypes.DoubleType(value)
    if isinstance(value, str):
        return celpy.celtypes.StringType(value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else {}
        return celpy.celtypes.MapType(
            {celpy.celtypes.StringType(k): to_cel(v, props.get(k, extra)) for k, v in value.items()}
        )
    if isinstance(value, list):
        items = schema.get("items", {}) if isinstance(schema.get("items"), dict) else {}
        return celpy.celtypes.ListType([to_cel(v, items) for v in value])
    if value is None:
        return None
    raise TypeError(f"cannot express {value!r} in CEL")


@lru_cache(maxsize=256)
def _program(rule: str) -> Any:
    import celpy  # deferred: the optional `validate` extra

    env = celpy.Environment()
    return env.program(env.compile(rule))


def is_transition_rule(rule: str) -> bool:
    """A rule over `oldSelf` (the stored object): the API server runs it on updates only."""
    return re.search(r"\boldSelf\b", rule) is not None


def evaluate_rule(rule: str, obj: Any, schema: dict[str, Any], *, old: Any = None) -> bool:
    """Evaluate one CEL rule with `self` = obj (and `oldSelf` = old, for a transition rule); raises ValueError when
    the rule cannot be evaluated."""
    import celpy  # deferred: the optional `validate` extra

    bindings = {"self": to_cel(obj, schema)}
    if old is not None:
        bindings["oldSelf"] = to_cel(old, schema)
    result = _program(rule).evaluate(bindings)
    if isinstance(result, celpy.CELEvalError):
        raise ValueError(f"rule {rule!r} could not be evaluated: {result}")
    return bool(result)


def _cel_problems(value: Any, schema: dict[str, Any], path: tuple[str | int, ...],
                  broken: frozenset[tuple[str | int, ...]] = frozenset()) -> list[Problem]:
    """CEL failures under `path`. Rules of an object holding a schema error (a path in `broken`) are not run: the
    API server reports the schema error, and a rule over a mistyped field would only add noise."""
    if any(b[: len(path)] == path for b in broken):
        if isinstance(value, dict):
            return [p for name, sub in schema.get("properties", {}).items() if name in value
                    for p in _cel_problems(value[name], sub, (*path, name), broken)]
        return []
    problems = []
    if isinstance(value, dict):
        for rule in schema.get("x-kubernetes-validations", []):
            if is_transition_rule(rule["rule"]):
                continue  # a document alone has no stored version to compare with
            try:
                ok = evaluate_rule(rule["rule"], value, schema)
            except ValueError as exc:
                problems.append(Problem(path, str(exc)))
                continue
            if not ok:
                extra = tuple(p for p in rule.get("fieldPath", "").split(".") if p)
                problems.append(Problem((*path, *extra), f"{rule['message']} (rule: {rule['rule']})"))
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                problems.extend(_cel_problems(value[name], sub, (*path, name)))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problems.extend(_cel_problems(item, schema["items"], (*path, i)))
    return problems


# ------------------------------------------------------------------------------------------------ one document
_NAME_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def extras_installed() -> bool:
    """Whether the `validate` extra (jsonschema, cel-python) is importable."""
    try:  # deferred: the optional `validate` extra
        import celpy  # noqa: F401
        import jsonschema  # noqa: F401
    except ImportError:
        return False
    return True


def validate_document(doc: Any) -> list[Problem]:
    """Every problem of one decoded manifest (empty when valid): top-level fields and metadata, the CRD schema and
    CEL rules (when the `validate` extra is installed), then the strict models (always)."""
    if not isinstance(doc, dict):
        return [Problem((), f"a TrainingRun must be a mapping, got {type(doc).__name__}")]
    problems = []
    expected = API_VERSION
    if doc.get("apiVersion") != expected:
        problems.append(Problem(("apiVersion",), f"must be {expected!r}, got {doc.get('apiVersion')!r}"))
    if doc.get("kind") != KIND:
        problems.append(Problem(("kind",), f"must be {KIND!r}, got {doc.get('kind')!r}"))
    for field in sorted(set(doc) - {"apiVersion", "kind", "metadata", "spec", "status"}):
        problems.append(Problem((field,), "unknown field (allowed: apiVersion, kind, metadata, spec, status)"))
    meta = doc.get("metadata")
    if not isinstance(meta, dict):
        problems.append(Problem(("metadata",), "required mapping with at least `name`"))
    else:
        name = meta.get("name")
        if not isinstance(name, str) or not re.match(_NAME_RE, name) or len(name) > 63:
            problems.append(
                Problem(("metadata", "name"), f"invalid name {name!r} (allowed: a DNS label: lower-case letters, "
                        "digits, '-', at most 63 characters, starting and ending alphanumeric)")
            )
    if "spec" not in doc:
        problems.append(Problem(("spec",), "required field is missing"))
        return problems
    spec = doc["spec"]
    if extras_installed():
        schema_problems = _schema_problems(spec)
        problems.extend(schema_problems)
        if isinstance(spec, dict):
            served, _ = _schemas()
            broken = frozenset(p.parts for p in schema_problems)
            problems.extend(_cel_problems(apply_defaults(spec, served), served, ("spec",), broken))
    if not problems:
        problems.extend(_model_problems(doc))
    return problems


def _model_problems(doc: dict[str, Any]) -> list[Problem]:
    """The strict pydantic models hold the same rules; anything they still reject is reported too (and they are
    the only check where the `validate` extra is not installed). Then the rules that need the resolved model, and
    last the memory plan."""
    try:
        run = parse_trainingrun(doc)
    except ValidationError as exc:
        return [Problem(tuple(e["loc"]), e["msg"]) for e in exc.errors()]
    return _architecture_problems(run) or memory_problems(run)


def memory_problems(run: Any) -> list[Problem]:
    """A role whose memory plan (`api.memory`, `trainingrun plan`) does not fit its GPUs, at the budget field
    (spec.trainer.gpuMemoryGiB, spec.rollout.engine.vllm.gpuMemoryGiB), the message naming the role, the terms that
    overflow and the fields to change. A `model.hf` model is planned where its config.json is readable."""
    return [Problem(tuple(field.split(".")), message, kind="memory")
            for field, message in plan_problems(run)]


def _architecture_problems(run: Any) -> list[Problem]:
    """The rules that need the resolved model: the parallel sizes against it (`modeling.architecture.check_parallel`,
    which every trainer applies at start-up too), and the head dimension the run's own vLLM engines on CPUs take
    (`engine_problems`). Here for a model the spec resolves by itself (a preset or explicit sizes) and for a
    `model.hf` directory whose config.json is readable here (`trainingrun validate` and the launcher run where the
    model is; elsewhere — the operator — it is checked where it is read). Not CEL: presets and config.json are
    what the API server does not have."""
    model = run.spec.model
    readable = model.hf is not None and (Path(model.hf) / "config.json").is_file()
    try:
        arch = model.resolved(read_hf=readable)
    except ValueError:
        return []  # reported where the model is resolved (the trainer, the operator's checks)
    if arch is None:
        return []
    ts = run.spec.trainer
    try:
        check_parallel(arch, ts.tensor_parallel_size, ts.expert_parallel_size)
    except ValueError as exc:
        field, _, message = str(exc).partition(": ")
        return [Problem(("spec", *field.split(".")), message)]
    return lora_problems(run.spec, arch) + engine_problems(run.spec, arch)


def lora_problems(run_spec: Any, arch: Any) -> list[Problem]:
    """`spec.trainer.lora` against the model (`modeling.lora_targets.check_lora`, which the trainer applies at
    start-up too): the rank within every targeted projection, `experts` only on a mixture of experts; and
    `spec.model.adapter` against them where the directory is readable (`check_adapter`)."""
    trainer = run_spec.trainer
    if trainer.lora is None:
        return []
    adapter = run_spec.model.adapter
    try:
        check_lora(lora_settings(trainer.lora), arch)
        if adapter is not None and Path(adapter).is_dir():  # where the directory is (validate, the launcher)
            check_adapter(adapter, lora_settings(trainer.lora), arch)
    except ValueError as exc:
        field, _, message = str(exc).partition(": ")
        return [Problem(("spec", *field.split(".")), message)]
    return []


def lora_settings(lora: Any) -> LoRASettings:
    """`spec.trainer.lora` (api.spec.trainer.LoRASpec) as `modeling.lora_targets.LoRASettings`."""
    return LoRASettings.from_spec(lora)


def engine_problems(spec: Any, arch: Any) -> list[Problem]:
    """The run's own vLLM servers without GPUs run vLLM's CPU attention, which takes only the head dimensions of
    `VLLM_CPU_HEAD_DIMS`: another model loads, then kills the engine at its first request (docs/vllm.md)."""
    e = spec.rollout.engine
    if spec.rollout.source.type != "generate" or e.type != "vllm" or e.url is not None or e.vllm.gpus > 0:
        return []
    if arch.head_dim in VLLM_CPU_HEAD_DIMS:
        return []
    where = "spec.model.hf" if spec.model.hf is not None else "spec.model"
    return [Problem(tuple(where.split(".")),
                    f"head dimension {arch.head_dim} (hidden size {arch.hidden_size}, {arch.num_attention_heads} "
                    f"attention heads): vLLM's CPU attention (rollout.engine.vllm.gpus 0) takes only head dimensions "
                    f"{', '.join(map(str, VLLM_CPU_HEAD_DIMS))}; choose such a model, or give the engine GPUs "
                    "(rollout.engine.vllm.gpus)")]
