"""TrainingRun API: spec + status models, manifest loading, CRD generation (`crd`), offline validation (`validate`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from trainingrun.api.models import (
    MODEL_PRESETS,
    PHASES,
    TERMINAL_PHASES,
    TrainingRun,
    TrainingRunSpec,
    TrainingRunStatus,
)

__all__ = [
    "MODEL_PRESETS",
    "PHASES",
    "TERMINAL_PHASES",
    "TrainingRun",
    "TrainingRunSpec",
    "TrainingRunStatus",
    "describe_errors",
    "load_trainingrun",
    "parse_trainingrun",
]


def parse_trainingrun(doc: dict[str, Any]) -> TrainingRun:
    """A TrainingRun from a parsed manifest; raises pydantic.ValidationError on bad input."""
    return TrainingRun.model_validate(doc)


def load_trainingrun(path: str | Path) -> TrainingRun:
    """The single TrainingRun in a YAML file. Raises ValueError with the file name on anything wrong; use
    `trainingrun validate` for a full, per-field report."""
    path = Path(path)
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read TrainingRun: {exc}") from exc
    runs = [d for d in docs if isinstance(d, dict) and d.get("kind") == "TrainingRun"]
    if len(runs) != 1:
        raise ValueError(f"{path}: expected exactly one TrainingRun document, found {len(runs)}")
    from pydantic import ValidationError

    try:
        return parse_trainingrun(runs[0])
    except ValidationError as exc:
        raise ValueError(
            describe_errors(exc, f"{path}: invalid TrainingRun (run `trainingrun validate {path}` for details):")
        ) from None


def describe_errors(exc: Any, header: str) -> str:
    """A pydantic ValidationError as `header` then one indented `field.path: message` line per error."""
    lines = [header]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        lines.append(f"  {loc}: {err['msg']}")
    return "\n".join(lines)
