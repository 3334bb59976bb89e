"""A multi-node vLLM replica as local processes (`trainingrun.engines.vllm.multinode`, issue 32 item 2, the local
launcher's side) with a stand-in for vLLM's Python: the leader and worker command lines (vLLM's own multi-node launch,
one rendezvous port), the replica seen as one process that exits when any of its processes does, and stopped whole.
The real 2-node replica: tests/integration/test_vllm_nodes.py."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from trainingrun.engines.vllm.multinode import WORKER_CODE, MultiNodeServer


def stand_in(tmp_path: Path) -> str:
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\nexec sleep 60\n")
    script.chmod(0o755)
    return str(script)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_a_two_node_replica_is_a_leader_and_a_headless_worker_meeting_at_one_port(tmp_path):
    server = MultiNodeServer("/models/tiny", nodes=2, port=18000, python=stand_in(tmp_path),
                             log_path=tmp_path / "engine-0.log", dtype="float32", max_model_len=64)
    server.start()
    try:
        leader, worker = (s._args for s in server.servers)
        assert leader[:2] == ["-m", "vllm.entrypoints.openai.api_server"] and worker[:2] == ["-c", WORKER_CODE]
        for node, args in enumerate((leader, worker)):
            assert flag(args, "--node-rank") == str(node) and flag(args, "--nnodes") == "2"
            assert flag(args, "--tensor-parallel-size") == "2" and flag(args, "--master-addr") == "127.0.0.1"
            assert flag(args, "--distributed-executor-backend") == "mp" and flag(args, "--model") == "/models/tiny"
        assert flag(leader, "--master-port") == flag(worker, "--master-port")
        assert server.url == "http://127.0.0.1:18000" and server.pid == server.servers[0].pid
        assert (tmp_path / "engine-0-node1.log").exists()
        assert server.proc.poll() is None
        os.kill(server.servers[1].pid, signal.SIGKILL)  # the worker dies: the replica has exited
        deadline = time.monotonic() + 10
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.proc.returncode == -signal.SIGKILL
        leader_proc = server.servers[0].proc
        server.proc = None  # the launcher, before a restart: the leader still running is stopped too
        assert leader_proc.poll() is not None and server.proc is None
        server.start()
        assert server.starts == 2 and server.proc.poll() is None
    finally:
        server.close()
    assert all(s.proc is None for s in server.servers)
