"""Pure parts of the local launcher: merging per-attempt step records, following a growing file, progress lines,
attempt numbering and metrics port selection."""

from __future__ import annotations

import json
import socket

from trainingrun.local import metrics_port_block, next_attempt
from trainingrun.local.report import MetricsTail, merge_metrics, raw_metrics_path, summarize


def _write(path, records, tail=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_merge_keeps_last_attempt_per_step_and_skips_cut_lines(tmp_path):
    _write(raw_metrics_path(tmp_path, 0), [{"step": s, "loss": 1.0} for s in range(5)], tail='{"step": 5, "lo')
    _write(raw_metrics_path(tmp_path, 1), [{"step": s, "loss": 2.0} for s in range(3, 8)])
    _write(raw_metrics_path(tmp_path, 10), [{"step": s, "loss": 3.0} for s in range(6, 9)])  # numeric, not lexical
    merged = merge_metrics(tmp_path)
    assert [r["step"] for r in merged] == list(range(9))
    assert [r["loss"] for r in merged] == [1.0] * 3 + [2.0] * 3 + [3.0] * 3
    assert [r["attempt"] for r in merged] == [0] * 3 + [1] * 3 + [10] * 3


def test_tail_returns_only_complete_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    follower = MetricsTail(path)
    assert follower.poll() == []
    path.write_text('{"step": 0}\n{"step": 1')
    assert [r["step"] for r in follower.poll()] == [0]
    with open(path, "a") as fh:
        fh.write(', "loss": 0.5}\n')
    assert follower.poll() == [{"step": 1, "loss": 0.5}]
    assert follower.poll() == []


def test_summary(tmp_path):
    recs = [{"step": s, "rollout": s // 2, "loss": 2.0 - s / 10, "global_batch_size": 4 + s, "samples_consumed": 10 * s,
             "tokens": 100} for s in range(4)]
    s = summarize(recs, status="succeeded", restarts=0, wall_seconds=2.0, tokens_this_run=400, attempts=[],
                  failure=None, name="x", out_dir=tmp_path)
    assert (s["steps"], s["first_loss"], s["final_loss"]) == (4, 2.0, recs[-1]["loss"])
    assert (s["global_batch_size_min"], s["global_batch_size_max"], s["tokens_per_second"]) == (4, 7, 200.0)


def test_next_attempt_counts_logs_and_raw_files(tmp_path):
    assert next_attempt(tmp_path) == 0
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "trainer-0.log").write_text("")
    assert next_attempt(tmp_path) == 1
    (tmp_path / "logs" / "trainer-0.attempt3.log").write_text("")
    assert next_attempt(tmp_path) == 4


def test_metrics_port_block_skips_busy_ports():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        base = metrics_port_block(port, 2)
        assert base >= port + 1 or base + 1 < port
        assert base != port and base + 1 != port


def test_test_metrics_ports_lie_below_the_ephemeral_range():
    """The tests' metrics ports: free and never among those bind(0)/connect hand out (they could be taken between the
    launcher's check and a trainer's bind)."""
    from tests.services import ephemeral_port_range, metrics_ports

    low, _high = ephemeral_port_range()
    for _ in range(20):
        base = metrics_ports(3)
        assert base + 2 < low
        for p in range(base, base + 3):
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))
