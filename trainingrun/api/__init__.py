"""TrainingRun API: the spec and status models, the CRD generated from them, and the one strict manifest loader.

Module map:
  spec/         the spec by section, one module each (its own map: `trainingrun/api/spec/__init__.py`)
  models.py     the whole spec (`TrainingRunSpec`, the rules that span sections) + the status models, `TrainingRun`,
                `parse_trainingrun`, `ALL_MODELS`
  constants.py  the API identity (group, version, kind, plural, short name), label keys, annotation and finalizer
                names
  crd.py        CRD generation from the models (`trainingrun crd`; checked in as crds/trainingrun.yaml)
  yamlcodec.py  the manifest YAML decoder (limits, duplicate keys, Kubernetes scalars, no coercion), `dump_yaml`
  checks.py     the CRD's checks of a decoded document: OpenAPI schema, CEL rules, the strict models
  manifest.py   the one manifest loader of every entry point (`load_file`)
  validate.py   `trainingrun validate FILE...`
  memory.py     a spec's memory plan (the spec → `modeling.memory`'s settings, what does not fit)
  memory_cli.py  `trainingrun plan FILE`

This file: `load_trainingrun` (the loader as every entry point calls it), `describe_errors`, and the names the
programs import from the API."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainingrun.api.manifest import load_file
from trainingrun.api.models import (
    PHASES,
    TERMINAL_PHASES,
    TrainingRun,
    TrainingRunSpec,
    TrainingRunStatus,
    parse_trainingrun,
)
from trainingrun.api.yamlcodec import ManifestError

__all__ = [
    "PHASES",
    "TERMINAL_PHASES",
    "TrainingRun",
    "TrainingRunSpec",
    "TrainingRunStatus",
    "ManifestError",
    "describe_errors",
    "load_trainingrun",
    "parse_trainingrun",
]


def load_trainingrun(path: str | Path, *, overrides: Mapping[str, Any] | None = None) -> TrainingRun:
    """The single TrainingRun in a YAML file, through the one strict loader (`trainingrun.api.manifest`: limits,
    duplicate keys, CRD schema and CEL rules, strict models), with `overrides` (`{"spec.trainer.replicas": 2}`)
    applied before validation. Raises `ManifestError` (a ValueError) whose lines are exactly what
    `trainingrun validate` prints."""
    return load_file(path, overrides=overrides)


def describe_errors(exc: Any, header: str) -> str:
    """A pydantic ValidationError as `header` then one indented `field.path: message` line per error."""
    lines = [header]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        lines.append(f"  {loc}: {err['msg']}")
    return "\n".join(lines)
