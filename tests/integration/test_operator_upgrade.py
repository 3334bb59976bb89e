"""Operator upgrade: a run created and half-trained under the previous release (commit e0456b3: its CRD, its status
shape, its children labelled as it labelled them) is adopted by this operator without a restart and without losing
its counters (docs/operator.md, "Upgrades and the CRD's version policy").

tests/data/upgrade/e0456b3.json is what a cluster held after the previous release's operator ran a run for one
restart (attempt 1, restarts 1, one failed pod of attempt 0 kept for its logs); it was written by
tests/data/upgrade/snapshot_e0456b3.py, run inside a checkout of e0456b3, and crd-e0456b3.yaml is that commit's
crds/trainingrun.yaml. The test loads both into the emulator, then upgrades as a cluster admin would: the current CRD
is applied, the current operator starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.kube import CRD_PATH, Cluster, register_resources
from tests.services import wait_for

DATA = Path(__file__).resolve().parent.parent / "data" / "upgrade"
POD = "/api/v1/namespaces/default/pods/"
SERVER_SET = ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields", "deletionTimestamp")


def _fresh(obj: dict, owner_uid: str | None = None) -> dict:
    """`obj` as a client would create it again (server-set metadata dropped, owner references to the new run)."""
    meta = {k: v for k, v in obj["metadata"].items() if k not in SERVER_SET}
    for ref in meta.get("ownerReferences") or []:
        ref["uid"] = owner_uid
    return {**{k: v for k, v in obj.items() if k != "status"}, "metadata": meta}


def test_a_run_of_the_previous_release_is_adopted_without_a_restart():
    snap = json.loads((DATA / "e0456b3.json").read_text())
    with Cluster(crd_path=DATA / "crd-e0456b3.yaml") as kube:
        # what the previous release left in the cluster
        run = kube.create(kube.tr_path(), _fresh(snap["trainingrun"]))
        kube.patch(kube.tr_path("up") + "/status", {"status": snap["trainingrun"]["status"]})
        for plural in ("configmaps", "services", "pods"):
            for obj in snap[plural]:
                created = kube.create(f"/api/v1/namespaces/default/{plural}", _fresh(obj, run["metadata"]["uid"]))
                if plural == "pods":
                    kube.patch(POD + created["metadata"]["name"] + "/status", {"status": obj["status"]})
        before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in kube.items("/api/v1/namespaces/default/pods")}
        old_status = kube.status("up")
        # the upgrade: the current CRD applied (its schema now validates every write), the current operator started
        register_resources(kube.emulator, CRD_PATH)
        crd = yaml.safe_load(CRD_PATH.read_text())
        kube.patch(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}",
                   {"spec": crd["spec"]})
        with kube.operator(interval=0.5) as op:
            op.settle("up", count=3)
            st = kube.status("up")
            after = {p["metadata"]["name"]: p["metadata"]["uid"]
                     for p in kube.items("/api/v1/namespaces/default/pods")}
            assert after == before, "no pod was created or deleted: the run was not restarted"
            assert (st["phase"], st["attempt"], st["restarts"], st["disruptions"]) == ("Running", 1, 1, 0)
            assert {k: st[k] for k in ("step", "samplesConsumed", "rollout", "startTime")} == {
                k: old_status[k] for k in ("step", "samplesConsumed", "rollout", "startTime")}
            assert "Restarting" not in kube.reasons("up")
            # the counters go on from where the previous release left them
            kube.set_pod("up-trainer-0-a1", "Failed", exit_code=1)
            for pod in kube.wait_group("up", 2):
                kube.set_pod(pod["metadata"]["name"], "Running")
            st = kube.wait_phase("up", "Running")
            assert st["attempt"] == 2 and st["restarts"] == 2
            # and the new behaviour applies to the adopted run: its rollout restarts alone
            kube.set_pod("up-rollout-a2", "Failed", exit_code=1)
            wait_for(lambda: kube.get(POD + "up-rollout-a2-r1"), 15, "the rollout restarted alone")
            assert kube.status("up")["attempt"] == 2
