#!/usr/bin/env python3
"""The release's one version, checked before anything is pushed (run by .github/workflows/release.yml).

A release publishes the images `<registry>/operator`, `<registry>/trainer` and `<registry>/trainer-te` (the
Dockerfile's targets) and the Helm chart `oci://<registry>/charts/trainingrun`, all under one version. `<registry>`
is the one the chart names: the directory of `image.repository` in charts/trainingrun/values.yaml. This script fails,
naming each file and value, unless
  - pyproject.toml's version, Chart.yaml's `version` and its `appVersion` are one version, and the tag (`--tag`, if
    given) is `v` + that version;
  - values.yaml's `image.repository` is `<registry>/operator` and `image.tag` is empty (so the chart deploys its
    appVersion);
  - every image reference under `<registry>/` in the CRDs, the chart, the examples, the spec's default image
    (trainingrun/api/models.py), the Dockerfile and the docs names an image this release pushes, tagged with that
    version.
On success it prints the version and, with `--github-output FILE`, appends `version=`, `registry=`, `host=` (the
registry's host name, to log in to) and `chart=` lines for later workflow steps. Standard library only: it runs
before anything is installed.

    python3 .ci/release_versions.py [--tag v0.1.0] [--root DIR] [--github-output FILE]
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

IMAGES = ("operator", "trainer", "trainer-te")  # Dockerfile targets = image names under the registry
CHART = Path("charts/trainingrun")
# Files whose image references must name what the release pushes (globs relative to the repository root).
REFERENCE_FILES = ("crds/*.yaml", "charts/trainingrun/**/*.yaml", "examples/*.yaml", "trainingrun/api/models.py",
                   "Dockerfile", "README.md", "docs/*.md")


def top_level(text: str, key: str) -> str | None:
    """A top-level scalar of a simple YAML file (Chart.yaml), unquoted; None when absent."""
    m = re.search(rf"^{re.escape(key)}:[ \t]*(.*?)[ \t]*(?:#.*)?$", text, re.M)
    return m.group(1).strip("\"'") if m else None


def image_values(text: str) -> dict[str, str]:
    """The scalar keys of values.yaml's top-level `image:` mapping (comments and quotes dropped)."""
    m = re.search(r"^image:[ \t]*\n((?:[ \t]+.*\n|[ \t]*\n)*)", text, re.M)
    out: dict[str, str] = {}
    for line in (m.group(1) if m else "").splitlines():
        kv = re.match(r"^[ \t]+([A-Za-z]+):[ \t]*(.*?)[ \t]*(?:#.*)?$", line)
        if kv:
            out[kv.group(1)] = kv.group(2).strip("\"'")
    return out


def check(root: Path, tag: str | None) -> tuple[dict[str, str], list[str]]:
    problems: list[str] = []
    version = str(tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"])
    chart_text = (root / CHART / "Chart.yaml").read_text()
    for key in ("version", "appVersion"):
        value = top_level(chart_text, key)
        if value != version:
            problems.append(f"{CHART / 'Chart.yaml'}: {key} is {value!r}, pyproject.toml's version is {version!r}")
    if tag is not None and tag != f"v{version}":
        problems.append(f"tag {tag!r} is not 'v' + the release version {version!r} (pyproject.toml, Chart.yaml)")

    image = image_values((root / CHART / "values.yaml").read_text())
    repository = image.get("repository", "")
    registry = repository.rsplit("/", 1)[0] if "/" in repository else ""
    if not registry or repository != f"{registry}/operator":
        problems.append(f"{CHART / 'values.yaml'}: image.repository is {repository!r}, expected <registry>/operator")
    if image.get("tag", ""):
        problems.append(f"{CHART / 'values.yaml'}: image.tag is {image['tag']!r}, expected empty (the appVersion)")

    if registry:
        ref = re.compile(rf"{re.escape(registry)}/([A-Za-z0-9._-]+):([A-Za-z0-9._-]+)")
        files = sorted({p for pattern in REFERENCE_FILES for p in root.glob(pattern) if p.is_file()})
        for path in files:
            for n, line in enumerate(path.read_text().splitlines(), 1):
                for m in ref.finditer(line):
                    name, ref_tag = m.groups()
                    where = f"{path.relative_to(root)}:{n}: {m.group(0)}"
                    if name not in IMAGES:
                        problems.append(f"{where} names no image the release pushes ({', '.join(IMAGES)})")
                    elif ref_tag != version:
                        problems.append(f"{where} is not tagged with the release version {version!r}")
    outputs = {"version": version, "registry": registry, "host": registry.split("/", 1)[0],
               "chart": f"oci://{registry}/charts"}
    return outputs, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", help="the pushed git tag, e.g. v0.1.0")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1], help="repository root")
    parser.add_argument("--github-output", type=Path, help="append name=value lines here ($GITHUB_OUTPUT)")
    args = parser.parse_args(argv)
    outputs, problems = check(args.root, args.tag)
    if problems:
        for p in problems:
            print(f"release_versions: {p}", file=sys.stderr)
        return 1
    images = ", ".join(f"{outputs['registry']}/{name}" for name in IMAGES)
    print(f"release {outputs['version']}: images {images}, chart {outputs['chart']}/trainingrun")
    if args.github_output:
        with args.github_output.open("a") as f:
            f.writelines(f"{k}={v}\n" for k, v in outputs.items())
    return 0


if __name__ == "__main__":
    sys.exit(main())
