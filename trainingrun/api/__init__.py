"""TrainingRun API: spec + status models (`models`), identity and label names (`constants`), CRD generation (`crd`),
the manifest YAML decoder (`yamlcodec`), the CRD's checks of a decoded document (`checks`), the one manifest loader
(`manifest`), `trainingrun validate` (`validate`), and a spec's memory plan (`memory`) with `trainingrun plan`
(`memory_cli`)."""

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
