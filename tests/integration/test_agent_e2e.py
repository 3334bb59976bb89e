"""examples/agent.yaml end to end, shortened: `trainingrun run` with the in-process Megatron engine, the calculator
environment in its worker process and real Megatron-core trainers (the full 30 rollouts: docs/rl.md "Figures").

  agent   the first SHORT rollouts, 2 trainers          -> multi-turn, the tool is learned, the batch size varies
  dp1     the first DP_SHORT rollouts, 1 trainer        -> DP invariance
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.localrun import finish, records, start
from tests.services import metrics_ports

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[2]
SHORT, DP_SHORT = 12, 6


def write_spec(path: Path, rollouts: int) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "agent.yaml").read_text())
    doc["spec"]["rollout"]["numRollouts"] = rollouts
    doc["spec"]["metrics"]["port"] = metrics_ports(3)
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def spec_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("agent")


@pytest.fixture(scope="module")
def agent(spec_dir):
    out = spec_dir / "agent"
    code, log = finish(start(write_spec(spec_dir / "agent.yaml", SHORT), out))
    assert code == 0, log[-4000:]
    return {"records": records(out), "summary": json.loads((out / "summary.json").read_text())}


def mean(values) -> float:
    return sum(values) / len(values)


def test_the_agent_learns_to_call_the_tool_over_several_turns(agent):
    recs = agent["records"]
    assert agent["summary"]["status"] == "succeeded" and len(recs) == SHORT
    rewards = [r["episode_reward_mean"] for r in recs]
    assert mean(rewards[-5:]) >= mean(rewards[:5]) + 0.1, rewards
    turns = [r["turns_per_episode"] for r in recs]
    assert mean(turns) > 1 and mean(turns[-3:]) > mean(turns[:3]) + 0.2, turns  # the tool calls add turns
    calls = [r["tool_calls_per_episode"] for r in recs]
    assert all(c == pytest.approx(t - 1) for c, t in zip(calls, turns))  # a call is a turn; then the answer
    for r in recs:
        assert r["episodes"] == 128 and r["env_failures"] == 0 and r["truncated_episodes"] == 0, r["step"]
        assert r["logprob_abs_diff"] <= 1e-3, r["step"]  # the trained tokens' logprobs are the engine's
        assert r["response_tokens_per_turn"] > 1
    gbs = [r["global_batch_size"] for r in recs]
    assert len(set(gbs)) > 2 and all(g % 8 == 0 for g in gbs)  # whole groups; all-right/all-wrong ones filtered


def test_agent_dp_invariance(spec_dir, agent):
    out = spec_dir / "dp1"
    code, log = finish(start(write_spec(spec_dir / "dp1.yaml", DP_SHORT), out, "--trainers", "1"))
    assert code == 0, log[-4000:]
    one, two = records(out), agent["records"][:DP_SHORT]
    for a, b in zip(one, two, strict=True):
        assert (a["global_batch_size"], a["samples_consumed"], a["sample_id_sum"], a["tokens"]) == (
            b["global_batch_size"], b["samples_consumed"], b["sample_id_sum"], b["tokens"]), a["step"]
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]
        assert a["turns_per_episode"] == b["turns_per_episode"] and a["reward_mean"] == b["reward_mean"]
