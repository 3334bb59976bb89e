"""Multi-node engine replicas (issue 32 item 2, the operator's side), against the KMock emulator with the fidelity
layer (tests/kube.py), the operator in-process: `engine.replicas: 2` with `engine.vllm.nodes: 2` gives 4 engine
pods labelled by replica and node (leaders R-engine-<i>, workers R-engine-<i>-n1), a Volcano PodGroup per replica;
a failed worker of replica 1
replaces replica 1's pods only (its leader too, in the next generation), the other replica, the rollout and the
trainers keep their pods (same uids), and the run does not fail. (The rendering itself:
tests/unit/test_operator_multinode.py.)"""

from __future__ import annotations

import pytest

from tests.integration.test_operator_roles import ENGINE_RUN
from tests.kube import Cluster, pod_uids
from tests.services import wait_for

POD = "/api/v1/namespaces/default/pods/"
CM = "/api/v1/namespaces/default/configmaps/"
PG = "/apis/scheduling.volcano.sh/v1beta1/namespaces/default/podgroups/"
ENGINE_PODS = ["mn-engine-0", "mn-engine-0-n1", "mn-engine-1", "mn-engine-1-n1"]


@pytest.fixture(scope="module")
def kube():
    with Cluster() as c, c.operator(interval=0.5) as op:
        c.op = op
        yield c


def test_a_failed_worker_replaces_its_replica_only_and_the_run_goes_on(kube):
    """With Volcano gang scheduling: one PodGroup per replica (R-engine-<i>, minMember 2), kept by its replacement."""
    import kmock

    kube.emulator.resources["scheduling.volcano.sh/v1beta1/podgroups"] = kmock.ResourceInfo(
        kind="PodGroup", namespaced=True, verbs={"get", "list", "watch", "create", "delete", "patch"})
    body = {**ENGINE_RUN, "rollout": {**ENGINE_RUN["rollout"],
                                      "engine": {"type": "vllm", "replicas": 2, "vllm": {"gpus": 1, "nodes": 2}}}}
    kube.new_run("mn", failurePolicy={"backoffSeconds": 0, "maxRestarts": 0, "roles": {"engine": {"maxRestarts": 2}}},
                 gangScheduling={"enabled": True, "provider": "volcano"}, **body)
    engines = [wait_for(lambda n=n: kube.get(POD + n), 15, f"engine pod {n} (now {kube.status('mn')})")
               for n in ENGINE_PODS]
    assert [(p["metadata"]["labels"]["trainingrun.dev/engine-replica"],
             p["metadata"]["labels"]["trainingrun.dev/engine-node"]) for p in engines] == [
        ("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    worker = engines[3]["spec"]["containers"][0]["args"]
    assert worker[worker.index("--master-addr") + 1] == "engine-1.mn-engine.default.svc" and "--headless" in worker
    # the rollout is given the leaders only
    urls = kube.get(CM + "mn-config")["data"]["engines"].splitlines()
    assert urls == [f"http://engine-{i}.mn-engine.default.svc:8000" for i in (0, 1)]
    gangs = [kube.get(PG + f"mn-engine-{i}") for i in (0, 1)]
    assert [g["spec"]["minMember"] for g in gangs] == [2, 2] and kube.get(PG + "mn-engine") is None
    assert [p["metadata"]["annotations"]["scheduling.k8s.io/group-name"] for p in engines] == [
        "mn-engine-0", "mn-engine-0", "mn-engine-1", "mn-engine-1"]
    group = kube.wait_group("mn", 0)
    kube.set_pod("mn-store", "Running")
    for name in ENGINE_PODS:
        kube.set_pod(name, "Running")
    kube.run_all("mn", 0)
    assert kube.condition("mn", "PodsReady")["status"] == "True"
    kept = pod_uids([*group, engines[0], engines[1]])

    kube.set_pod("mn-engine-1-n1", "Failed", exit_code=1)  # replica 1's worker dies
    wait_for(lambda: kube.live_pod("mn-engine-1") is None, 15, f"replica 1's leader replaced (now {kube.status('mn')})")
    new = [wait_for(lambda n=n: kube.get(POD + n), 15, f"replacement {n} (now {kube.status('mn')})")
           for n in ("mn-engine-1-r1", "mn-engine-1-n1-r1")]
    for node, pod in enumerate(new):
        labels = pod["metadata"]["labels"]
        assert (labels["trainingrun.dev/engine-replica"], labels["trainingrun.dev/engine-node"],
                labels["trainingrun.dev/role-attempt"]) == ("1", str(node), "1")
    assert pod_uids([*kube.group_pods("mn", 0), kube.get(POD + "mn-engine-0"), kube.get(POD + "mn-engine-0-n1")]) == kept
    assert pod_uids([kube.get(PG + f"mn-engine-{i}") for i in (0, 1)]) == pod_uids(gangs)  # the replica's gang stays
    assert all(p["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "mn-engine-1" for p in new)
    st = kube.status("mn")
    assert st["phase"] == "Running" and st["attempt"] == 0 and st["restarts"] == 0, st
    [entry] = [e for e in st["roleRestarts"] if e["role"] == "engine"]
    assert (entry["replica"], entry["restarts"]) == (1, 1) and "mn-engine-1-n1" in entry["lastFailure"]
    assert any("engine replica 1" in e["message"] for e in kube.events("mn") if e.get("reason") == "RestartingRole")
    assert kube.condition("mn", "PodsReady")["status"] == "False"  # replica 1 is not whole yet
    for name in ("mn-engine-1-r1", "mn-engine-1-n1-r1"):
        kube.set_pod(name, "Running")
    wait_for(lambda: kube.condition("mn", "PodsReady").get("status") == "True", 10, "PodsReady after the replacement")
    kube.op.settle("mn")
    st = kube.status("mn")
    assert st["phase"] == "Running" and st["restarts"] == 0 and st["engineReplicas"] == 2, st
    assert {p["metadata"]["name"] for p in kube.items(POD.rstrip("/"))
            if p["metadata"]["labels"].get("trainingrun.dev/role") == "engine" and not p["metadata"].get(
                "deletionTimestamp") and p.get("status", {}).get("phase") != "Failed"} == {
        "mn-engine-0", "mn-engine-0-n1", "mn-engine-1-r1", "mn-engine-1-n1-r1"}


PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = []
for argv in json.loads(sys.argv[1]):
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    out.append([ns.nnodes, ns.node_rank, ns.master_addr, ns.master_port, ns.tensor_parallel_size,
                ns.distributed_executor_backend, bool(getattr(ns, "headless", False)), ns.worker_extension_cls])
print(json.dumps(out))
"""


def test_vllms_own_parser_reads_the_leaders_and_the_workers_command_lines():
    """The rendered command lines (after the entrypoint) parsed by the installed vLLM's own `vllm serve` parser: the
    multi-node flags exist in this vLLM (no Ray needed) and mean what the operator intends."""
    import json
    import subprocess

    from tests.integration.test_operator_roles import ENGINE_RUN as BASE
    from tests.services import require_vllm
    from trainingrun.api import parse_trainingrun
    from trainingrun.operator import render, vocabulary

    python = require_vllm()
    spec = {**BASE, "rollout": {**BASE["rollout"], "engine": {"type": "vllm", "vllm": {"gpus": 4, "nodes": 2}}}}
    run = parse_trainingrun({"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun",
                             "metadata": {"name": "mn"}, "spec": spec})
    owner = vocabulary.Owner(name="mn", namespace="default", uid="u")
    argvs = []
    for node, skip in ((0, 2), (1, 3)):  # "-m MODULE" of the API server; "-m vllm.entrypoints.cli.main serve"
        args = render.render_engine_pod(run, owner, 0, node=node)["spec"]["containers"][0]["args"]
        argvs.append(args[skip:])
    out = subprocess.run([python, "-c", PARSE, json.dumps(argvs)], capture_output=True, text=True, timeout=300,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    leader, worker = json.loads(out.stdout.strip().splitlines()[-1])
    addr = "engine-0.mn-engine.default.svc"
    assert leader[:7] == [2, 0, addr, 29501, 8, "mp", False]
    assert worker[:7] == [2, 1, addr, 29501, 8, "mp", True]
    assert leader[7] == worker[7] == "trainingrun.engines.vllm.worker_ext.WeightSyncExtension"  # every node
