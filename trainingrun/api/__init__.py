"""TrainingRun API: spec + status models, manifest loading, CRD generation (`crd`), offline validation (`validate`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainingrun.api.manifest import ManifestError
from trainingrun.api.models import (
    PHASES,
    TERMINAL_PHASES,
    TrainingRun,
    TrainingRunSpec,
    TrainingRunStatus,
)

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


def parse_trainingrun(doc: dict[str, Any]) -> TrainingRun:
    """A TrainingRun from a decoded manifest (plain JSON values), validated strictly: no type coercion (`true` or
    `"2"` is not an integer), as the CRD's schema; raises pydantic.ValidationError on bad input."""
    return TrainingRun.model_validate(doc, strict=True)


def load_trainingrun(path: str | Path, *, overrides: Mapping[str, Any] | None = None) -> TrainingRun:
    """The single TrainingRun in a YAML file, through the one strict loader (`trainingrun.api.manifest`: limits,
    duplicate keys, CRD schema and CEL rules, strict models), with `overrides` (`{"spec.trainer.replicas": 2}`)
    applied before validation. Raises `ManifestError` (a ValueError) whose lines are exactly what
    `trainingrun validate` prints."""
    from trainingrun.api.manifest import load_file

    return load_file(path, overrides=overrides)


def describe_errors(exc: Any, header: str) -> str:
    """A pydantic ValidationError as `header` then one indented `field.path: message` line per error."""
    lines = [header]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        lines.append(f"  {loc}: {err['msg']}")
    return "\n".join(lines)
