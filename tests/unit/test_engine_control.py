"""The engine pool's pure parts (issue 30): the adaptive in-flight limit (`engines/concurrency.py`), the affinity
table (`engines/dispatch.py`), engine errors compared across servers (`engines/pool.normalise_cause`), vLLM's
/metrics text and error bodies read (`engines/vllm/client.py`), the first exception line of a server's log
(`engines/vllm/server.log_error`), and the per-engine counts the published rollout carries to metrics.jsonl."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainingrun.contract.engine import EngineCounts
from trainingrun.contract.published import SourceStats, engine_counts_from_json
from trainingrun.engines.concurrency import GROW, HEADROOM, TRIM_FLOOR, AdaptiveLimit
from trainingrun.engines.dispatch import AffinityTable
from trainingrun.engines.pool import normalise_cause
from trainingrun.engines.replica import EngineSignals
from trainingrun.engines.vllm.client import error_message, parse_metrics
from trainingrun.engines.vllm.engine import METRICS, VLLMReplica
from trainingrun.engines.vllm.server import log_error


def signals(running, waiting, kv=0.5, preemptions=0.0) -> EngineSignals:
    return EngineSignals(running=running, waiting=waiting, kv_usage=kv, preemptions=preemptions)


# ------------------------------------------------------------------------------------------------ AdaptiveLimit
def test_the_limit_grows_while_it_holds_requests_back_and_the_engine_has_room():
    a = AdaptiveLimit(64, 4, 4096)
    assert a.update(signals(100, 0, kv=0.4), inflight=64, blocked=True) == math.ceil(64 * GROW)
    # not blocked (nothing waited in the pool), or not at the limit: nothing learned, hold
    assert a.update(signals(100, 0, kv=0.4), inflight=96, blocked=False) == 96
    assert a.update(signals(50, 0, kv=0.4), inflight=50, blocked=True) == 96
    # the KV cache nearly full: hold even when blocked
    assert a.update(signals(96, 0, kv=0.95), inflight=96, blocked=True) == 96


def test_the_limit_is_trimmed_to_what_the_engine_runs_when_it_queues():
    a = AdaptiveLimit(200, 4, 4096)
    # the engine runs 120 of our 200 and queues 80: trimmed to 200 * 120/200 * (1 + HEADROOM)
    assert a.update(signals(120, 80, kv=1.0), inflight=200, blocked=True) == math.ceil(120 * (1 + HEADROOM))
    # a small queue (within the slack) is held: a request is always there when one finishes
    b = AdaptiveLimit(100, 4, 4096)
    assert b.update(signals(100, 3, kv=0.99), inflight=100, blocked=True) == 100
    # one reading never cuts below TRIM_FLOOR of the old limit
    c = AdaptiveLimit(100, 4, 4096)
    assert c.update(signals(1, 99, kv=1.0), inflight=100, blocked=True) == math.ceil(100 * TRIM_FLOOR)


def test_preemptions_trim_and_no_signals_hold():
    a = AdaptiveLimit(100, 4, 4096)
    assert a.update(signals(100, 0, kv=0.99, preemptions=5), inflight=100, blocked=True) == 100  # the first reading
    assert a.update(signals(100, 0, kv=0.99, preemptions=9), inflight=100, blocked=True) == 90  # 4 more: trimmed
    assert a.update(None, inflight=90, blocked=True) == 90
    assert a.update(EngineSignals(kv_usage=0.1), inflight=90, blocked=True) == 90  # no running/waiting: hold
    with pytest.raises(ValueError, match="bounds"):
        AdaptiveLimit(8, 10, 4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5000), st.floats(0, 5000), st.floats(0, 1), st.floats(0, 100),
                          st.integers(0, 5000), st.booleans()), min_size=1, max_size=40),
       st.integers(1, 64), st.integers(0, 5000))
def test_the_limit_stays_within_its_bounds_whatever_the_signals(readings, low, span):
    high = low + span
    a = AdaptiveLimit(64, low, high)
    preempted = 0.0
    for running, waiting, kv, more, inflight, blocked in readings:
        preempted += more
        before = a.limit
        limit = a.update(signals(running, waiting, kv, preempted), inflight, blocked)
        assert low <= limit <= high
        if waiting > 0.05 * max(running, 1.0) and running > 0 and inflight > 0:
            assert limit <= max(before, low)  # an engine that queues never gets more


# ------------------------------------------------------------------------------------------------ affinity table
def test_the_affinity_table_is_bounded_and_forgets_what_is_released():
    t = AffinityTable(capacity=3)
    for i in range(5):
        t.set(f"ep{i}", f"engine-{i % 2}")
    assert len(t) == 3 and t.get("ep0") is None and t.get("ep1") is None and t.get("ep4") == "engine-0"
    t.get("ep2")
    t.set("ep2", "engine-1")  # used again: the newest
    t.set("ep5", "engine-0")
    assert t.get("ep3") is None and t.get("ep2") == "engine-1"
    t.release(["ep2", "missing"])
    assert t.get("ep2") is None and len(t) == 2


# ------------------------------------------------------------------------------------------------ engine errors
def test_the_same_engine_error_from_two_servers_compares_equal():
    a = "EngineCore died handling cmpl-1f2e3d at http://127.0.0.1:4001/v1 (block 0123456789abcdef0123)"
    b = "EngineCore died handling cmpl-99aa00 at http://127.0.0.1:4002/v1 (block fedcba9876543210fedc)"
    assert normalise_cause(a) == normalise_cause(b)
    assert normalise_cause("head_dim=16") != normalise_cause("head_dim=32")


def test_vllm_error_bodies_and_metrics_are_read():
    body = '{"error":{"message":"EngineCore encountered an issue.","type":"InternalServerError","code":500}}'
    assert error_message(body) == "EngineCore encountered an issue."
    assert error_message('{"error": "plain"}') == "plain" and error_message("not json") == "not json"
    text = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 7.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 5.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0',
        'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0 1700000000000',
        "process_open_fds 12",
        "garbage line {",
    ])
    m = parse_metrics(text)
    assert m["vllm:num_requests_running"] == 12.0 and m["process_open_fds"] == 12.0
    assert m["vllm:num_preemptions_total"] == 3.0

    class Client:
        url = "http://x"

        def metrics(self, timeout=None):
            return m

    s = VLLMReplica(Client()).signals(timeout=1)
    assert s == EngineSignals(running=12.0, waiting=2.0, kv_usage=0.25, prefix_queries=1000.0, prefix_hits=640.0,
                              preemptions=3.0)
    assert set(METRICS) == {f for f in EngineSignals.__dataclass_fields__}
    Client.metrics = lambda self, timeout=None: {"process_open_fds": 3.0}
    assert VLLMReplica(Client()).signals(timeout=1) is None  # an engine that exports none of them


def test_the_root_cause_is_the_first_exception_line_of_a_vllm_log():
    log = "\n".join([
        "(APIServer pid=1) INFO 12-03 23:26:02 [launcher.py:195] Route: /health",
        "(Worker pid=3905) ERROR 12-03 23:26:04 [multiproc_executor.py:1063] Traceback (most recent call last):",
        "(Worker pid=3905) ERROR 12-03 23:26:04 [multiproc_executor.py:1063]   File \"x.py\", line 1, in f",
        "(Worker pid=3905) ERROR 12-03 23:26:04 [multiproc_executor.py:1063] RuntimeError: Unsupported CPU "
        "attention configuration: head_dim=16 isa=2 kv_cache_idx=0",
        "(EngineCore pid=1136) ERROR 12-03 23:26:04 [core.py:1512] RuntimeError: Worker failed with error 'x'",
        "(APIServer pid=1) ERROR 12-03 23:26:04 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue.",
    ])
    assert log_error(log) == ("RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 "
                              "kv_cache_idx=0")
    assert log_error(log.splitlines()[-1]) == "EngineDeadError: EngineCore encountered an issue."
    assert log_error("INFO: Waiting for application shutdown.\nWARNING: Error handling is fine") == ""


# ------------------------------------------------------------------------------------------------ engine counts
def test_engine_counts_travel_in_the_published_stats_to_the_step_record():
    before = EngineCounts(prefix_queries=100, prefix_hits=10, inflight_seconds=5.0, seconds=1.0, concurrency=64)
    after = EngineCounts(prefix_queries=1100, prefix_hits=810, inflight_seconds=45.0, seconds=3.0, concurrency=96)
    share = after.minus(before)
    assert share == EngineCounts(1000, 800, 40.0, 2.0, 96)
    assert share.prefix_hit_rate == 0.8 and share.inflight == 20.0
    other = EngineCounts(prefix_queries=1000, prefix_hits=200, inflight_seconds=10.0, seconds=2.0, concurrency=8)
    stats = SourceStats(source_index=0, produced=8, filtered={}, carried_in=0, carried_out=0, seed=1,
                        engines={"engine-0": share, "engine-1": other})
    back = SourceStats.from_json(stats.to_json())
    assert back == stats
    rec = back.engine_record()
    assert rec["prefix_hit_rate"] == pytest.approx(1000 / 2000)  # token-weighted over the engines, not a mean
    assert rec["engine_prefix_hit_rate"] == {"engine-0": 0.8, "engine-1": 0.2}
    assert rec["engine_inflight"] == {"engine-0": 20.0, "engine-1": 5.0}
    assert rec["engine_concurrency"] == {"engine-0": 96, "engine-1": 8}
    assert SourceStats(source_index=0, produced=0, filtered={}, carried_in=0, carried_out=0, seed=1).engine_record() == {}
    with pytest.raises(ValueError, match="engines"):
        engine_counts_from_json({"engine-0": {"prefix_queries": 1}})
