"""Offline validation: the invalid corpus, the examples, and the CLI's exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainingrun.api import load_trainingrun
from trainingrun.api.validate import validate_text

ROOT = Path(__file__).resolve().parents[2]
CORPUS = sorted((ROOT / "tests/data/invalid").glob("*.yaml"))
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def expected_field(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name} lacks its '# expect: FIELD' header"
    return first.removeprefix("# expect: ")


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 30


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_invalid_manifest_is_rejected_naming_the_field(path: Path):
    lines = validate_text(path.read_text(), path.name)
    assert lines, f"{path.name} was accepted"
    field = expected_field(path)
    assert any(field in line for line in lines), f"no error names {field!r}: {lines}"
    assert all(line.startswith(path.name) for line in lines)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_are_valid(path: Path):
    assert validate_text(path.read_text(), path.name) == []
    load_trainingrun(path)  # and the models accept them


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainingrun", "validate", *args],
        capture_output=True, text=True, input=stdin, cwd=ROOT, timeout=60,
    )


def test_cli_exit_codes_and_no_traceback():
    bad = run_cli(*map(str, CORPUS))
    assert bad.returncode == 1
    assert "Traceback" not in bad.stderr
    # one line per error, each naming its file; every corpus file is reported
    reported = {line.split(":")[0].split("#")[0] for line in bad.stderr.splitlines()}
    assert reported == {str(p) for p in CORPUS}

    good = run_cli(str(ROOT / "examples/tiny.yaml"))
    assert good.returncode == 0, good.stderr
    assert "valid" in good.stdout


def test_cli_reads_stdin_and_reports_missing_files(tmp_path):
    text = (ROOT / "examples/tiny.yaml").read_text()
    assert run_cli("-", stdin=text).returncode == 0
    missing = run_cli(str(tmp_path / "nope.yaml"))
    assert missing.returncode == 1
    assert "nope.yaml: cannot read" in missing.stderr


def test_multi_document_stream_reports_each_document():
    good = (ROOT / "examples/tiny.yaml").read_text()
    doc = yaml.safe_load(good)
    doc["spec"]["trainer"]["replicas"] = 0
    second = yaml.safe_dump(doc, sort_keys=False)
    lines = validate_text(good + "---\n" + second, "runs.yaml")
    # the line and column of the field in the second document
    line_no = len(good.splitlines()) + 1 + second.splitlines().index("    replicas: 0") + 1
    assert lines and all(line.startswith(f"runs.yaml:{line_no}:5: spec.trainer.replicas:") for line in lines), lines


def test_message_says_what_is_allowed():
    text = (ROOT / "tests/data/invalid/bad-loss-type.yaml").read_text()
    (line,) = validate_text(text, "f")
    assert "'sft'" in line and "'policy_gradient'" in line and "'ppo'" in line and "'dpo'" in line
