"""A local run whose engine replica spans two "nodes" (issue 32 item 2, the local launcher): `rollout.engine.vllm.nodes:
2` starts the replica as a leader (the API server, node 0) and a headless worker (node 1), one vLLM CPU process each,
tensor parallel 2 over vLLM's own multi-node launch (`trainingrun.engines.vllm.multinode`). The rollout reaches the
replica through the leader; weight sync (`disk`) goes through the leader's collective RPC to the workers of both
nodes. Checked at lag 0: every step's `logprob_abs_diff` within the fp32 tolerance (both halves of the tensor-parallel
model hold the trainer's weights after every sync), both processes ran, and none is left behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.integration.test_vllm_e2e import FP32_TOL, check_on_policy, parity_reward, write_spec  # noqa: F401
from tests.localrun import finish, start
from tests.services import pid_alive, wait_for

pytestmark = [pytest.mark.megatron, pytest.mark.vllm, pytest.mark.timeout(1500)]

ROLLOUTS = 2


def test_a_two_node_replica_is_exact_at_lag_0(tmp_path: Path, tiny_llama_dir: Path):
    spec = write_spec(tmp_path / "nodes.yaml", tiny_llama_dir, sync="disk", dtype="float32", rollouts=ROLLOUTS)
    doc = yaml.safe_load(spec.read_text())
    doc["spec"]["rollout"]["engine"]["vllm"]["nodes"] = 2
    spec.write_text(yaml.safe_dump(doc))
    out = tmp_path / "run"
    proc = start(spec, out)
    try:
        wait_for(lambda: proc.poll() is not None or (out / "pids.json").exists(), 1200, "the engine healthy")
        pids = json.loads((out / "pids.json").read_text())["processes"]["engine-0"]["pids"] \
            if proc.poll() is None else []
        assert len(pids) == 2 and all(pids), pids  # the leader and the worker
    except BaseException:
        proc.kill()
        raise
    code, log = finish(proc, timeout=1500)
    assert code == 0, log[-6000:]
    recs = check_on_policy(out, log, FP32_TOL, ROLLOUTS)
    print("nodes 2: logprob_abs_diff", [r["logprob_abs_diff"] for r in recs])
    leader = (out / "logs" / "engine-0.log").read_text()
    worker = (out / "logs" / "engine-0-node1.log").read_text()
    assert "/collective_rpc" in leader and "/v1/completions" in leader, leader[-3000:]
    assert "headless" in worker.lower(), worker[-3000:]  # node 1 ran as vLLM's headless worker
    assert not any(pid_alive(p) for p in pids)  # the launcher stopped both
