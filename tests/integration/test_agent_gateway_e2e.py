"""examples/agent-gateway.yaml end to end, shortened: `trainingrun run` with the in-process Megatron engine behind the
rollout's OpenAI-compatible gateway, real Megatron-core trainers, and the example's agent program
(examples/agents/calculator_agent.py) as a black box: a process per episode that imports nothing of trainingrun and
only speaks HTTP to OPENAI_BASE_URL (the full 30 rollouts: docs/rl.md "Agents", figures).

The acceptance of issue 30: the agent trains the model — turns per episode > 1, the reward rises by at least 0.1 from
the first 5 steps to the last 5, the global batch size varies — and the trained tokens' log-probabilities are the
engine's (logprob_abs_diff at lag 0 as for environments).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.localrun import finish, records, start
from tests.services import metrics_ports

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "examples" / "agents" / "calculator_agent.py"
SHORT = 12


def mean(values) -> float:
    return sum(values) / len(values)


def test_the_agent_program_imports_nothing_but_the_standard_library():
    """The black box: its imports are standard-library modules (and the optional `openai` client), never ours."""
    tree = ast.parse(AGENT.read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - {"__future__", "openai"} <= sys.stdlib_module_names, names


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("agent-gateway")
    doc = yaml.safe_load((ROOT / "examples" / "agent-gateway.yaml").read_text())
    doc["spec"]["rollout"]["numRollouts"] = SHORT
    doc["spec"]["metrics"]["port"] = metrics_ports(3)
    agent = doc["spec"]["rollout"]["source"]["generate"]["agent"]
    assert agent["command"][:2] == ["python3", "examples/agents/calculator_agent.py"]
    # this interpreter without site-packages (a laptop's python3; the `openai` client is not installed here anyway):
    # 128 agent processes start per rollout, and the start-up of a python with every package of the test
    # environment would dominate the run on a 2-core machine
    agent["command"] = [sys.executable, "-S", *agent["command"][1:]]
    (d / "spec.yaml").write_text(yaml.safe_dump(doc))
    out = d / "out"
    code, log = finish(start(d / "spec.yaml", out, cwd=ROOT), timeout=900)  # cwd: the agent's relative path
    assert code == 0, log[-4000:]
    return {"records": records(out), "summary": json.loads((out / "summary.json").read_text())}


def test_a_black_box_agent_trains_the_model_through_the_gateway(run):
    recs = run["records"]
    assert run["summary"]["status"] == "succeeded" and len(recs) == SHORT
    rewards = [r["episode_reward_mean"] for r in recs]
    assert mean(rewards[-5:]) >= mean(rewards[:5]) + 0.1, rewards
    turns = [r["turns_per_episode"] for r in recs]
    assert mean(turns) > 1 and mean(turns[-3:]) > mean(turns[:3]), turns  # the tool calls add turns
    for r in recs:
        assert r["episodes"] == 128 and r["agent_failures"] == 0 and r["gateway_unauthorized"] == 0, r["step"]
        assert r["gateway_requests"] == round(r["turns_per_episode"] * 128), r["step"]  # one request, one turn
        assert r["rewrites_per_episode"] == 0  # the agent only appends to its conversation: one token sequence
        assert r["logprob_abs_diff"] <= 1e-3, r["step"]  # the trained tokens' logprobs are the engine's
        assert r["gateway_request_seconds"] > 0 and r["response_tokens_per_turn"] > 1
    gbs = [r["global_batch_size"] for r in recs]
    assert len(set(gbs)) > 2 and all(g % 8 == 0 for g in gbs)  # whole groups; all-right/all-wrong ones filtered
