"""`trainingrun validate FILE...`: check TrainingRun manifests offline, as the API server would.

Each file is read and decoded by the manifest YAML decoder (`trainingrun.api.yamlcodec`: limits, duplicate keys, no
coercion) and every document is checked by the CRD's own checks (`trainingrun.api.checks`: OpenAPI schema, CEL rules
after defaulting, the strict models). One line per error, with the line and column of the field where it is known:

    FILE:LINE:COL: FIELD.PATH: what was wrong (allowed: what is allowed)

`trainingrun run`, the trainer, the rollout and the operator load manifests through the same checks
(`trainingrun.api.manifest`), so they accept and refuse exactly what this command does.

Exit 0 when every document is valid, 1 otherwise, 2 without the `validate` extra (jsonschema, cel-python).
"""

from __future__ import annotations

import argparse
import sys

from trainingrun.api.checks import extras_installed
from trainingrun.api.manifest import problems
from trainingrun.api.yamlcodec import ManifestError, parse_yaml, read_text


def validate_text(text: str | bytes, source: str = "<stdin>") -> list[str]:
    """Error lines for a YAML stream (empty list when every document is a valid TrainingRun)."""
    try:
        docs = parse_yaml(text, source)
    except ManifestError as exc:
        return exc.lines
    if not docs:
        return [f"{source}: no YAML document found (expected a TrainingRun manifest)"]
    return [line for doc in docs for line in problems(doc)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="TrainingRun YAML files ('-' reads standard input)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing when valid")


def run(args: argparse.Namespace) -> int:
    if not extras_installed():
        print("trainingrun validate needs the 'validate' extra (jsonschema, cel-python): "
              "pip install 'trainingrun[validate]'", file=sys.stderr)
        return 2
    failed = False
    for name in args.files:
        try:
            text = read_text(name)
        except ManifestError as exc:
            for line in exc.lines:
                print(line, file=sys.stderr)
            failed = True
            continue
        lines = validate_text(text, name)
        for line in lines:
            print(line, file=sys.stderr)
        if lines:
            failed = True
        elif not args.quiet:
            print(f"{name}: valid")
    return 1 if failed else 0
