"""`trainingrun validate FILE...`: check TrainingRun manifests offline, as the API server would.

Each file is read and decoded by the manifest YAML decoder (`trainingrun.api.yamlcodec`: limits, duplicate keys, no
coercion) and every document is checked by the CRD's own checks (`trainingrun.api.checks`: OpenAPI schema, CEL rules
after defaulting, the strict models). One line per error, with the line and column of the field where it is known:

    FILE:LINE:COL: FIELD.PATH: what was wrong (allowed: what is allowed)

`trainingrun run`, the trainer, the rollout and the operator load manifests through the same checks
(`trainingrun.api.manifest`), so they accept and refuse exactly what this command does.

A document the API server would admit is also held to its memory plan (`trainingrun.api.memory`, what `trainingrun
plan` prints): a role whose GPUs cannot hold it is refused at its budget field, naming the role, the terms that
overflow and the fields that change them:

    FILE:LINE:COL: spec.trainer.gpuMemoryGiB: the trainer does not fit: 130.81 GiB per GPU against 24.00 GiB, ...

Exit 0 when every document is valid; 1 when a document has an error of the spec (schema, CEL rules, models), whatever
else; 78 (EX_CONFIG, `contract.errors.EXIT_CONFIG_ERROR`) when the only errors are memory plans that do not fit —
the run is well-formed but cannot run on the GPUs it names, as the trainer would exit 78 at start-up; 2 without the
`validate` extra (jsonschema, cel-python).
"""

from __future__ import annotations

import argparse
import sys

from trainingrun.api.checks import extras_installed
from trainingrun.api.manifest import problem_lines
from trainingrun.api.yamlcodec import ManifestError, parse_yaml, read_text
from trainingrun.contract.errors import EXIT_CONFIG_ERROR


def validate_text(text: str | bytes, source: str = "<stdin>") -> list[str]:
    """Error lines for a YAML stream (empty list when every document is a valid TrainingRun)."""
    return [line for _, line in validate_kinds(text, source)]


def validate_kinds(text: str | bytes, source: str = "<stdin>") -> list[tuple[str, str]]:
    """(kind, line) per error of a YAML stream: kind "memory" for a memory plan that does not fit, else "spec"."""
    try:
        docs = parse_yaml(text, source)
    except ManifestError as exc:
        return [("spec", line) for line in exc.lines]
    if not docs:
        return [("spec", f"{source}: no YAML document found (expected a TrainingRun manifest)")]
    return [item for doc in docs for item in problem_lines(doc)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="TrainingRun YAML files ('-' reads standard input)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing when valid")


def run(args: argparse.Namespace) -> int:
    if not extras_installed():
        print("trainingrun validate needs the 'validate' extra (jsonschema, cel-python): "
              "pip install 'trainingrun[validate]'", file=sys.stderr)
        return 2
    kinds: set[str] = set()
    for name in args.files:
        try:
            text = read_text(name)
        except ManifestError as exc:
            for line in exc.lines:
                print(line, file=sys.stderr)
            kinds.add("spec")
            continue
        found = validate_kinds(text, name)
        for kind, line in found:
            print(line, file=sys.stderr)
            kinds.add(kind)
        if not found and not args.quiet:
            print(f"{name}: valid")
    if "spec" in kinds:
        return 1
    return EXIT_CONFIG_ERROR if kinds else 0
