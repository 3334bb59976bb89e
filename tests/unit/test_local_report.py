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


def test_quiet_ports_lie_below_the_ephemeral_range_and_are_free():
    """The launcher's MASTER_PORT and the tests' metrics and rendezvous ports: free, and never among those bind(0) and
    outgoing connections hand out (one of those could take the port between the check and the bind seconds later:
    seen in CI as a dashboard run missing every rank-0 gauge, and as a 3-rank group that never formed)."""
    import random

    from tests.services import metrics_ports, rendezvous_port
    from trainingrun.local.procs import ephemeral_port_range, quiet_port_block

    low, _high = ephemeral_port_range()
    rng = random.Random(3)
    for count, base in [(3, metrics_ports(3)), (2, rendezvous_port(2)), (1, rendezvous_port())] + [
            (c, quiet_port_block(c, rng)) for c in (1, 4) for _ in range(10)]:
        assert 1024 <= base and base + count - 1 < low, (base, count, low)
        for p in range(base, base + count):
            with socket.socket() as s:  # as the servers bind (http.server, TCPStore): a TIME_WAIT left is no use
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", p))


def test_a_quiet_port_block_skips_a_taken_port():
    import random

    from trainingrun.local.procs import quiet_port_block

    first = quiet_port_block(1, random.Random(5))
    with socket.socket() as busy:
        busy.bind(("", first))
        busy.listen()
        assert quiet_port_block(1, random.Random(5)) != first  # same start, the next free one


def test_a_rank_group_that_hangs_is_killed_at_its_deadline_and_every_rank_is_shown(tmp_path):
    """tests.services.rank_group: one deadline for the group; the ranks still running are killed (not left behind
    for the next test) and the failure names them with each rank's last lines."""
    import sys

    import pytest

    from tests.services import rank_group

    script = ("import os, sys, time; r = os.environ['RANK']; print('rank', r, 'port', os.environ['MASTER_PORT'], "
              "flush=True); time.sleep(60 if r == '1' else 0)")
    with pytest.raises(pytest.fail.Exception) as failed:
        rank_group([sys.executable, "-c", script], 3, timeout=5, cwd=tmp_path, what="hang")
    message = str(failed.value)
    assert "hang group of 3: ranks [1] still running after 5 s" in message
    assert "--- rank 1 (killed)" in message and "--- rank 0 (exit 0)" in message and "rank 2 port" in message
    outs = rank_group([sys.executable, "-c", script.replace("'1'", "'9'")], 2, timeout=30)
    assert [o.split()[:2] for o in outs] == [["rank", "0"], ["rank", "1"]]
