"""Episode counts of multi-turn rollouts (contract/published.py `EpisodeCounts`): the record's weighted means, the
JSON round trip and its refusals, and the rollout's Prometheus pairs (metrics/rollout.py), which add across
rollouts as (sum, count)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trainingrun.contract.published import EpisodeCounts
from trainingrun.metrics.rollout import RolloutMetrics

A = EpisodeCounts(episodes=4, turns=10, tool_calls=6, tool_errors=3, truncated=1, response_tokens=40,
                  failures={"timeout": 1, "error": 1}, reward=2.0)
B = EpisodeCounts(episodes=6, turns=6, tool_calls=0, tool_errors=0, truncated=0, response_tokens=12,
                  failures={}, reward=3.0)


def test_the_record_holds_the_weighted_means_and_the_counts():
    r = A.record()
    assert r["turns_per_episode"] == 2.5 and r["tool_calls_per_episode"] == 1.5 and r["tool_error_rate"] == 0.5
    assert r["env_failure_rate"] == 0.5 and r["env_timeout_rate"] == 0.25 and r["truncated_rate"] == 0.25
    assert r["response_tokens_per_turn"] == 4.0 and r["episode_reward_mean"] == 0.5
    assert (r["episodes"], r["env_failures"], r["env_timeouts"], r["truncated_episodes"]) == (4, 2, 1, 1)
    assert B.record()["tool_error_rate"] == 0.0  # no calls: 0, not a division by zero


def test_json_round_trip_and_malformed_records_name_the_field():
    assert EpisodeCounts.from_json(A.to_json()) == A
    for bad in ([], {"episodes": 1}, {**A.to_json(), "failures": [1]}, {**A.to_json(), "turns": "x"}):
        with pytest.raises(ValueError, match="episodes"):
            EpisodeCounts.from_json(bad)


def test_the_rollouts_prometheus_pairs_add_up_across_rollouts():
    m = RolloutMetrics("r")
    m.observe_episodes(A)
    m.observe_episodes(B)
    values = {(s.name, s.labels.get("reason")): s.value
              for fam in text_string_to_metric_families(generate_latest(m.registry).decode()) for s in fam.samples}
    turns = values[("trainingrun_rollout_turns_per_episode_sum", None)], values[
        ("trainingrun_rollout_turns_per_episode_count", None)]
    assert turns == (16, 10)  # the mean over both rollouts' episodes: 1.6, not the mean of 2.5 and 1.0
    assert values[("trainingrun_rollout_tool_error_rate_sum", None)] == 3
    assert values[("trainingrun_rollout_tool_error_rate_count", None)] == 6
    assert values[("trainingrun_rollout_truncated_episodes_total", None)] == 1
    assert values[("trainingrun_rollout_environment_failures_total", "timeout")] == 1
    assert values[("trainingrun_rollout_environment_failures_total", "error")] == 1
