"""Reading TrainingRun manifests: one strict, bounded loader for every entry point.

`trainingrun run`, the trainer and rollout programs (which read the run's YAML) and the operator (which reads the API
server's JSON) load manifests here, and `trainingrun validate` checks them with the same two parts, so a manifest
one of them accepts is accepted by all, and one they refuse is refused with the same one-line errors:

    FILE:LINE:COLUMN: FIELD.PATH: what is wrong (allowed: what is allowed)

  decoding     `trainingrun.api.yamlcodec`: YAML as the Kubernetes API server decodes it (limits, duplicate keys,
               scalar semantics, no coercion), with the position of every field
  checking     `trainingrun.api.checks`: the CRD's OpenAPI schema and CEL rules (when the `validate` extra is
               installed), then always the strict pydantic models (`replicas: true`, `replicas: "2"` and
               `clipGrad: "1e309"` are errors everywhere)

A child process of a local run (the rollout, a trainer) reads the `run.yaml` its launcher wrote after checking it:
when the file's SHA-256 is the one the launcher put in `TRAININGRUN_CONFIG_SHA256` (and no overrides are given),
`load_file` runs the strict models only — the CRD schema, CEL rules and memory plan were run on those exact bytes
(about 0.5 s of CPU per process, most of it building the CEL parser). Any other content is checked in full.

Here: the one TrainingRun of a stream (`select_trainingrun`), `--trainers`-style overrides applied before the checks
(`apply_overrides`), and the checks' problems as error lines that carry the line and column of the offending field.
"""

from __future__ import annotations

import copy
import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from trainingrun.api.checks import validate_document
from trainingrun.api.constants import KIND
from trainingrun.api.models import TrainingRun, parse_trainingrun
from trainingrun.api.yamlcodec import Document, ManifestError, dotted, parse_yaml, read_text
from trainingrun.contract.env import CONFIG_SHA256_ENV


def problems(doc: Document) -> list[str]:
    """Every problem of one decoded document as `FILE:LINE:COL: FIELD: message` lines (empty when valid)."""
    return [line for _, line in problem_lines(doc)]


def problem_lines(doc: Document) -> list[tuple[str, str]]:
    """(kind, line) per problem: kind "spec" (the API server would refuse it) or "memory" (its memory plan does not
    fit, `trainingrun.api.memory`)."""
    return [(p.kind, f"{doc.where(p.parts)}: {p}") for p in validate_document(doc.value)]


def apply_overrides(value: Any, overrides: Mapping[str, Any] | None) -> Any:
    """`value` with each `dotted.path: value` of `overrides` set (missing mappings on the way are created);
    ManifestError when a path runs through something that is not a mapping."""
    if not overrides:
        return value
    out = copy.deepcopy(value)
    for key, new in overrides.items():
        parts = key.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            if not isinstance(node, dict):
                raise ManifestError([f"{key}: {'.'.join(parts[:i]) or 'the document'} is not a mapping"])
            node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ManifestError([f"{key}: {'.'.join(parts[:-1]) or 'the document'} is not a mapping"])
        node[parts[-1]] = new
    return out


def select_trainingrun(docs: list[Document], source: str) -> Document:
    """The one TrainingRun of a stream; ManifestError when there is none or more than one."""
    runs = [d for d in docs if isinstance(d.value, dict) and d.value.get("kind") == KIND]
    if len(runs) == 1:
        return runs[0]
    if not docs:
        raise ManifestError([f"{source}: no YAML document found (expected a TrainingRun manifest)"])
    if len(docs) == 1:
        return docs[0]  # not kind TrainingRun: validation names what is wrong
    raise ManifestError([f"{source}: expected exactly one TrainingRun document, found {len(runs)}"])


def load_document(doc: Document, overrides: Mapping[str, Any] | None = None, *,
                  checked: bool = False) -> TrainingRun:
    """A TrainingRun from one decoded document (with `overrides` applied first); ManifestError with every problem.
    `checked`: these exact bytes passed every check in the launcher (module docstring): the strict models only."""
    if overrides:
        doc = Document(apply_overrides(doc.value, overrides), doc.source, doc.index, doc.count, doc.positions)
    lines = [] if checked and not overrides else problems(doc)
    if lines:
        raise ManifestError(lines)
    try:
        return parse_trainingrun(doc.value)
    except ValidationError as exc:  # the checks above include the models: only reachable if they disagree
        raise ManifestError([f"{doc.where(e['loc'])}: {dotted(e['loc'])}: {e['msg']}" for e in exc.errors()]) from None


def load_text(text: str | bytes, source: str = "<stdin>", *,
              overrides: Mapping[str, Any] | None = None, checked: bool = False) -> TrainingRun:
    """The single TrainingRun in a YAML text; ManifestError with one line per problem (`checked`: see
    `load_document`)."""
    return load_document(select_trainingrun(parse_yaml(text, source), source), overrides, checked=checked)


def load_file(path: str | Path, *, overrides: Mapping[str, Any] | None = None) -> TrainingRun:
    """The single TrainingRun in a YAML file ('-': standard input); ManifestError with one line per problem. A file
    whose bytes this process's launcher checked (`checked_by_launcher`) gets the strict models only."""
    text = read_text(path)
    return load_text(text, str(path), overrides=overrides, checked=checked_by_launcher(text))


def sha256_of(text: str | bytes) -> str:
    """The hex SHA-256 of a manifest's bytes (UTF-8 for a str), as `TRAININGRUN_CONFIG_SHA256` carries it."""
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def checked_by_launcher(text: str | bytes) -> bool:
    """Whether `text` is exactly the manifest this process's launcher checked (`TRAININGRUN_CONFIG_SHA256`)."""
    expected = os.environ.get(CONFIG_SHA256_ENV)
    return bool(expected) and sha256_of(text) == expected
