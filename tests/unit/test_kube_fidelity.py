"""The fidelity layer of tests/kube.py: each API semantic the operator relies on, over real HTTP; and that the stock
emulator still lacks each of them (so the layer holds nothing KMock does itself)."""

from __future__ import annotations

import urllib.error

import pytest

import yaml

from tests.kube import ROOT, Cluster

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


def test_merge_patch_rfc7386(kube):
    """A merge patch as the API server applies one (KMock's own object model does it): null removes a key, mappings
    merge, lists are replaced."""
    pod = _pod("m1")
    pod["metadata"]["annotations"] = {"b": "1", "c": "2"}
    kube.create(PODS, pod)
    out = kube.patch(f"{PODS}/m1", {"metadata": {"annotations": {"b": None, "d": "3"}},
                                   "spec": {"containers": [{"name": "d", "image": "y"}]}})
    assert out["metadata"]["annotations"] == {"c": "2", "d": "3"}
    assert out["spec"]["containers"] == [{"name": "d", "image": "y"}]


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


def test_scale_subresource_reads_and_writes_the_crds_replicas_path(kube):
    """GET/PATCH …/scale (what `kubectl scale` sends): an autoscaling/v1 Scale of the CRD's specReplicasPath (spec
    .rollout.engine.replicas), statusReplicasPath and labelSelectorPath; a write bumps generation and is validated
    against the schema (422 naming the field)."""
    kube.create(kube.tr_path(), _tr("sc1"))
    scale = kube.get(kube.tr_path("sc1") + "/scale")
    assert scale["kind"] == "Scale" and scale["apiVersion"] == "autoscaling/v1" and scale["metadata"]["name"] == "sc1"
    assert scale["spec"] == {"replicas": None} and scale["status"] == {"replicas": 0}  # unset in the spec
    kube.patch(kube.tr_path("sc1") + "/status", {"status": {"engineReplicas": 1, "engineSelector": "a=b"}})
    out = kube.patch(kube.tr_path("sc1") + "/scale", {"spec": {"replicas": 3}})
    assert out["kind"] == "Scale" and out["spec"] == {"replicas": 3} and out["status"] == {"replicas": 1,
                                                                                          "selector": "a=b"}
    run = kube.run("sc1")
    assert run["spec"]["rollout"]["engine"]["replicas"] == 3 and run["metadata"]["generation"] == 2
    assert run["spec"]["trainer"] == TINY["spec"]["trainer"]  # nothing else changed
    with pytest.raises(urllib.error.HTTPError) as err:
        kube.patch(kube.tr_path("sc1") + "/scale", {"spec": {"replicas": 0}})
    assert err.value.code == 422 and "spec.rollout.engine.replicas" in err.value.body.replace("/", ".")


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
    # updates too: a status write lost to a conflict, once
    refused = kube.emulator.refuse_update("trainingruns", "default", "f3", 409, "Conflict", "the object has been "
                                          "modified", subresource="status")
    with pytest.raises(urllib.error.HTTPError) as err:
        kube.patch(kube.tr_path("f3") + "/status", {"status": {"phase": "Running"}})
    assert err.value.code == 409 and refused() == 1
    kube.patch(kube.tr_path("f3") + "/status", {"status": {"phase": "Running"}})
    assert kube.status("f3")["phase"] == "Running" and refused() == 1
    kube.emulator.update_admission.clear()


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


def test_stock_kmock_still_lacks_each_piece_of_the_layer():
    """Each piece of tests/kube.py exists because the installed KMock lacks it. If one of these assertions fails after
    a KMock upgrade, KMock now does that itself: delete the piece from the layer (and this assertion)."""
    import asyncio
    import json

    import aiohttp
    import kmock

    from tests.kube import _original_parse_path
    from tests.services import free_port

    # the path parser: /api/v1/namespaces[/name] (the namespaces resource itself) is not understood
    with pytest.raises(ValueError):
        _original_parse_path("/api/v1/namespaces")
    assert _original_parse_path("/api/v1/namespaces/default").plural is None

    async def probe() -> dict:
        emulator = kmock.KubernetesEmulator()
        emulator.resources.load_bundled()
        emulator.resources["trainingrun.dev/v1alpha1/trainingruns"] = kmock.ResourceInfo(
            kind="TrainingRun", namespaced=True, subresources={"status"},
            verbs={"get", "list", "watch", "create", "patch", "delete"})
        seen: dict = {}
        async with emulator, kmock.Server(emulator, host="127.0.0.1", port=free_port()) as server:
            url = str(server.url).rstrip("/")
            async with aiohttp.ClientSession() as http:
                async def call(method, path, body=None, ctype="application/json"):
                    data = None if body is None else json.dumps(body)
                    async with http.request(method, url + path, data=data, headers={"Content-Type": ctype}) as r:
                        text = await r.text()
                        return r.status, (json.loads(text) if text.startswith(("{", "[")) else text)

                merge = "application/merge-patch+json"
                _, seen["created"] = await call("POST", PODS, _pod("a", tier="x"))
                await call("POST", PODS, _pod("b", tier="y"))
                _, seen["listing"] = await call("GET", PODS + "?labelSelector=tier%3Dx")
                _, seen["status_patch"] = await call("PATCH", f"{PODS}/a/status",
                                                     {"spec": {"nodeName": "n1"}, "status": {"phase": "Running"}}, merge)
                seen["stale_patch"], _ = await call("PATCH", f"{PODS}/a", {"metadata": {"resourceVersion": "0",
                                                                                        "labels": {"s": "1"}}}, merge)
                seen["failed_test"], _ = await call("PATCH", f"{PODS}/a", [
                    {"op": "test", "path": "/metadata/name", "value": "other"}], "application/json-patch+json")
                seen["generate_name"], _ = await call("POST", PODS, {"apiVersion": "v1", "kind": "Pod",
                                                                     "metadata": {"generateName": "g-"}})
                seen["unserved"], _ = await call(
                    "POST", "/apis/scheduling.volcano.sh/v1beta1/namespaces/default/podgroups", {"metadata": {"name": "pg"}})
                child = _pod("c")
                child["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": "b", "uid": "u-b"}]
                await call("POST", PODS, child)
                await call("DELETE", f"{PODS}/b")
                seen["orphan"], _ = await call("GET", f"{PODS}/c")
                _, seen["api_v1"] = await call("GET", "/api/v1")
                bad = _tr("bad")
                bad["spec"] = {**bad["spec"], "trainer": {**bad["spec"]["trainer"], "replicas": 0}}
                seen["invalid_run"], _ = await call("POST", "/apis/trainingrun.dev/v1alpha1/namespaces/default/"
                                                            "trainingruns", bad)
                await call("POST", "/apis/trainingrun.dev/v1alpha1/namespaces/default/trainingruns", _tr("sc"))
                _, seen["scale"] = await call("GET", "/apis/trainingrun.dev/v1alpha1/namespaces/default/"
                                                     "trainingruns/sc/scale")
        return seen

    seen = asyncio.run(probe())
    meta = seen["created"]["metadata"]
    assert not {"uid", "resourceVersion", "generation", "creationTimestamp"} & set(meta), meta  # ids and versions
    assert seen["created"].get("status") is None  # a created pod is not Pending
    assert len(seen["listing"]["items"]) == 2 and "kind" not in seen["listing"]  # selectors ignored, list kind
    assert seen["status_patch"]["spec"].get("nodeName") == "n1"  # a status patch changes spec: no subresource
    assert seen["stale_patch"] == 200  # no resourceVersion precondition
    assert seen["failed_test"] != 422  # a failed JSON-patch test is not 422 Invalid
    assert not 200 <= seen["generate_name"] < 300  # no generateName
    assert seen["unserved"] == 200  # a group/version it does not serve is stored, not 404
    assert seen["orphan"] == 200  # no garbage collection of dependents
    assert seen["api_v1"]["groupVersion"] == "/v1"
    assert seen["invalid_run"] == 200  # custom resources are not validated against their CRD
    assert not isinstance(seen["scale"], dict) or seen["scale"].get("kind") != "Scale"  # no scale subresource
