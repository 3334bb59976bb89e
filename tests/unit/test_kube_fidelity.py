"""The fidelity layer of tests/kube.py: each API semantic the operator relies on, over real HTTP."""

from __future__ import annotations

import urllib.error

import pytest

import yaml

from tests.kube import ROOT, Cluster, merge_patch

PODS = "/api/v1/namespaces/default/pods"
TINY = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())


def _tr(name, **meta):
    return {"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": name, **meta},
            "spec": dict(TINY["spec"])}


@pytest.fixture(scope="module")
def kube():
    with Cluster() as c:
        yield c


def _pod(name, **labels):
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "x"}]}}


def test_merge_patch_rfc7386():
    assert merge_patch({"a": {"b": 1, "c": 2}, "l": [1]}, {"a": {"b": None, "d": 3}, "l": [2]}) == {
        "a": {"c": 2, "d": 3}, "l": [2]}


def test_ids_versions_generation_and_status_subresource(kube):
    tr = kube.create(kube.tr_path(), {**_tr("f1"), "status": {"phase": "X"}})
    meta = tr["metadata"]
    assert meta["uid"] and meta["creationTimestamp"] and meta["generation"] == 1 and meta["namespace"] == "default"
    assert "status" not in tr  # status in a create is ignored
    rv = meta["resourceVersion"]
    # a main-resource patch never changes status; a spec change bumps generation
    out = kube.patch(kube.tr_path("f1"), {"spec": {"seed": 2}, "status": {"phase": "Y"}})
    assert out["metadata"]["generation"] == 2 and "status" not in out and out["metadata"]["resourceVersion"] != rv
    # a status patch changes only status
    out = kube.patch(kube.tr_path("f1") + "/status", {"spec": {"seed": 3}, "status": {"phase": "Running"}})
    assert out["status"] == {"phase": "Running"} and out["spec"]["seed"] == 2 and out["metadata"]["generation"] == 2
    # writes are validated against the CRD schema, the status subresource too (here: a message over maxLength)
    with pytest.raises(urllib.error.HTTPError) as err:
        kube.patch(kube.tr_path("f1") + "/status", {"status": {"message": "x" * 5000}})
    assert err.value.code == 422 and "status.message" in err.value.body
    with pytest.raises(urllib.error.HTTPError) as err:
        kube.patch(kube.tr_path("f1"), {"spec": {"trainer": {"replicas": 0}}})
    assert err.value.code == 422 and "spec.trainer.replicas" in err.value.body
    # annotations change: generation unchanged
    out = kube.patch(kube.tr_path("f1"), {"metadata": {"annotations": {"a": "b"}}})
    assert out["metadata"]["generation"] == 2
    # precondition: stale resourceVersion → 409; JSON-patch test failure → 422
    with pytest.raises(urllib.error.HTTPError) as err:
        kube.patch(kube.tr_path("f1") + "/status", {"metadata": {"resourceVersion": rv}, "status": {"phase": "Z"}})
    assert err.value.code == 409
    with pytest.raises(urllib.error.HTTPError) as err:
        kube.patch(kube.tr_path("f1"), [{"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                                        {"op": "add", "path": "/metadata/finalizers", "value": ["x"]}], json_patch=True)
    assert err.value.code == 422
    current = kube.run("f1")["metadata"]["resourceVersion"]
    out = kube.patch(kube.tr_path("f1"), [{"op": "test", "path": "/metadata/resourceVersion", "value": current},
                                          {"op": "add", "path": "/metadata/finalizers", "value": ["x"]}],
                     json_patch=True)
    assert out["metadata"]["finalizers"] == ["x"]


def test_finalizers_and_garbage_collection(kube):
    tr = kube.create(kube.tr_path(), _tr("f2", finalizers=["keep"]))
    owner = {"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "name": "f2",
             "uid": tr["metadata"]["uid"], "controller": True}
    child = _pod("f2-child", app="x")
    child["metadata"]["ownerReferences"] = [owner]
    created = kube.create(PODS, child)
    assert created["status"] == {"phase": "Pending"}
    kube.create(PODS, _pod("f2-other", app="y"))
    with pytest.raises(urllib.error.HTTPError) as err:
        kube.create(PODS, _pod("f2-other"))
    assert err.value.code == 409
    kube.delete(kube.tr_path("f2"))
    assert kube.run("f2")["metadata"]["deletionTimestamp"]  # held by its finalizer
    assert kube.get(f"{PODS}/f2-child") is not None
    kube.patch(kube.tr_path("f2"), {"metadata": {"finalizers": None}})
    assert kube.run("f2") is None
    assert kube.get(f"{PODS}/f2-child") is None  # garbage-collected with its owner
    assert kube.get(f"{PODS}/f2-other") is not None


def test_lists_selectors_namespaces_generate_name(kube):
    kube.create(PODS, _pod("s1", tier="a"))
    kube.create(PODS, _pod("s2", tier="b"))
    listing = kube.request("GET", PODS)
    assert listing["kind"] == "PodList" and listing["apiVersion"] == "v1"
    assert [p["metadata"]["name"] for p in kube.items(PODS, "tier=a")] == ["s1"]
    assert "s1" not in [p["metadata"]["name"] for p in kube.items(PODS, "tier!=a")]
    assert kube.get("/api/v1/namespaces/default")["metadata"]["name"] == "default"
    assert [n["metadata"]["name"] for n in kube.items("/api/v1/namespaces")] == ["default"]
    assert kube.get("/api/v1")["groupVersion"] == "v1"
    ev = kube.create("/api/v1/namespaces/default/events", {"apiVersion": "v1", "kind": "Event",
                                                            "metadata": {"generateName": "x-"}, "reason": "R"})
    assert ev["metadata"]["name"].startswith("x-") and len(ev["metadata"]["name"]) > 2


def test_admission_refusals_and_owner_reference_enforcement(kube):
    lift = kube.emulator.refuse("pods", "default", 403, "Forbidden", "exceeded quota: pods", times=2)
    for _ in range(2):
        with pytest.raises(urllib.error.HTTPError) as err:
            kube.create(PODS, _pod("a1"))
        assert err.value.code == 403 and "exceeded quota" in err.value.body
    kube.create(PODS, _pod("a1"))  # the third create passes
    lift()
    # a hook may change what is created (a mutating webhook, e.g. Kueue's scheduling gate)
    kube.emulator.admission.append(lambda req, obj: obj["spec"].setdefault("schedulingGates", [{"name": "g"}]))
    assert kube.create(PODS, _pod("a2"))["spec"]["schedulingGates"] == [{"name": "g"}]
    kube.emulator.admission.pop()
    # OwnerReferencesPermissionEnforcement: blockOwnerDeletion needs update on the owner's finalizers
    owner = kube.create(kube.tr_path(), _tr("f3"))
    child = _pod("a3")
    child["metadata"]["ownerReferences"] = [{"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun",
                                             "name": "f3", "uid": owner["metadata"]["uid"], "controller": True,
                                             "blockOwnerDeletion": True}]
    off = kube.emulator.enforce_owner_references([{"apiGroups": ["trainingrun.dev"], "resources": ["trainingruns"],
                                                   "verbs": ["update"]}])
    with pytest.raises(urllib.error.HTTPError) as err:
        kube.create(PODS, child)
    assert err.value.code == 403 and "trainingruns/finalizers" in err.value.body
    off()
    kube.emulator.enforce_owner_references([{"apiGroups": ["trainingrun.dev"], "resources": ["trainingruns/finalizers"],
                                             "verbs": ["update"]}])
    assert kube.create(PODS, child)["metadata"]["name"] == "a3"
    kube.emulator.admission.clear()


def test_finalizer_held_pod_stays_terminating(kube):
    """A pod on a lost node never confirms its end: a finalizer holds it the same way."""
    kube.create(PODS, {**_pod("held"), "metadata": {"name": "held", "finalizers": ["example.com/hold"]}})
    kube.delete(f"{PODS}/held")
    pod = kube.get(f"{PODS}/held")
    assert pod["metadata"]["deletionTimestamp"]
    kube.delete(f"{PODS}/held")  # deleting again changes nothing
    assert kube.get(f"{PODS}/held")["metadata"]["deletionTimestamp"] == pod["metadata"]["deletionTimestamp"]
    kube.patch(f"{PODS}/held", {"metadata": {"finalizers": None}})
    assert kube.get(f"{PODS}/held") is None


def test_unknown_api_group_is_404_and_watches_filter_by_label(kube):
    import json
    import urllib.request

    for path in ("/apis/scheduling.volcano.sh/v1beta1/namespaces/default/podgroups",
                 "/apis/scheduling.volcano.sh/v1beta1/namespaces/default/podgroups/pg"):
        with pytest.raises(urllib.error.HTTPError) as err:
            kube.request("POST" if path.endswith("podgroups") else "GET", path, {"metadata": {"name": "pg"}})
        assert err.value.code == 404
    kube.create(PODS, _pod("w-yes", app="watched"))
    kube.create(PODS, _pod("w-no", app="other"))
    req = urllib.request.Request(f"{kube.url}{PODS}?watch=true&labelSelector=app%3Dwatched",
                                 headers={"User-Agent": "watcher/1"})
    names = []
    with urllib.request.urlopen(req, timeout=5) as stream:
        for line in stream:
            if line.strip():
                names.append(json.loads(line)["object"]["metadata"]["name"])
            if "w-yes" in names:
                break
    assert names == ["w-yes"]
    assert kube.emulator.watch_params["/v1/pods"]["labelSelector"] == "app=watched"
