"""Several trainer ranks per pod: a torchrun-style supervisor for `spec.trainer.gpusPerReplica` = G > 1.

A trainer pod (or a local trainer process) is one *node*. Its environment comes from the run plan and is node-level:
`RANK` = the pod's index (node rank), `WORLD_SIZE` = the number of trainer pods (`spec.trainer.replicas`), plus
`MASTER_ADDR`/`MASTER_PORT` of node 0. With G ≤ 1 the node is also the one process, so nothing changes. With G > 1
`trainingrun trainer` becomes this supervisor: it starts G worker processes (`trainingrun trainer` again) whose
environment is process-level, as torchrun's:

  RANK              node_rank × G + local_rank       (global process rank; torch.distributed env://)
  WORLD_SIZE        nodes × G                        (= spec.trainer world size)
  LOCAL_RANK        local_rank (0 .. G-1)            (also picks the GPU: modeling.model.prepare_device)
  LOCAL_WORLD_SIZE  G
  TRAININGRUN_NODE_RANK / TRAININGRUN_NUM_NODES      the node-level RANK / WORLD_SIZE the supervisor was given
  TRAININGRUN_METRICS_PORT                           the node's port + local_rank (one /metrics per process)
  MASTER_ADDR, MASTER_PORT, everything else          unchanged

A process with `LOCAL_RANK` in its environment is a worker (ours, or one started by torchrun) and trains; it never
supervises. G is read from the spec (`TRAININGRUN_CONFIG`), the same source the rollout's data-parallel size comes
from, so the two cannot disagree.

Supervision: SIGTERM/SIGINT are forwarded to every worker (a kubelet signals only the container's first process);
when a worker fails, the others are stopped (SIGTERM, a grace period, SIGKILL) and the supervisor exits with the
failed worker's code — 78 (`EXIT_CONFIG_ERROR`) stays 78, so a configuration error is not restarted; a worker killed
by signal N gives 128 + N. Exit 0 when every worker exited 0. Workers get PR_SET_PDEATHSIG=SIGKILL on Linux, so a
supervisor killed outright leaves no workers behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from trainingrun import failure_policy as policy
from trainingrun.childproc import DIE_WITH_PARENT, child_command_prefix
from trainingrun.contract.env import ProcessEnv

POLL_SECONDS = 0.1
STOP_GRACE_SECONDS = 5.0  # a failed peer leaves the others blocked in a collective: they get this long after SIGTERM
SIGNAL_GRACE_SECONDS = 30.0  # after a forwarded SIGTERM/SIGINT, how long workers get before SIGKILL


def is_worker(env: dict[str, str] | None = None) -> bool:
    """True in a process started by a supervisor (ours or torchrun): it already has its process-level rank."""
    env = os.environ if env is None else env
    return "LOCAL_RANK" in env


def worker_env(base: dict[str, str], *, node_rank: int, num_nodes: int, nproc: int, local_rank: int) -> dict[str, str]:
    """The environment of worker `local_rank` of node `node_rank` (see the module docstring)."""
    port = ProcessEnv.from_environ(base).metrics_port
    env = dict(base)
    env.update({
        "RANK": str(node_rank * nproc + local_rank),
        "WORLD_SIZE": str(num_nodes * nproc),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(nproc),
        **ProcessEnv(node_rank=node_rank, num_nodes=num_nodes,
                     metrics_port=None if port is None else port + local_rank).to_env(),
    })
    return env


def exit_status(returncode: int) -> int:
    """A worker's return code as the supervisor's exit status (killed by signal N → 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class Supervisor:
    """Runs G workers of one node and waits for them (see the module docstring)."""

    command: list[str]  # the worker command line (`python -m trainingrun trainer ...`)
    nproc: int
    node_rank: int
    num_nodes: int
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    procs: list[subprocess.Popen] = field(default_factory=list)
    _signals: list[int] = field(default_factory=list)
    _old_handlers: dict[int, Any] = field(default_factory=dict)

    def log(self, msg: str) -> None:
        print(f"[trainer node {self.node_rank}] {msg}", file=sys.stderr, flush=True)

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002 - the main loop forwards it
        self._signals.append(signum)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            first = self.node_rank * self.nproc
            self.log(f"starting {self.nproc} workers: ranks {first}..{first + self.nproc - 1} of "
                     f"{self.num_nodes * self.nproc}")
            for local_rank in range(self.nproc):
                if self._signals:
                    break
                env = worker_env(self.env, node_rank=self.node_rank, num_nodes=self.num_nodes, nproc=self.nproc,
                                 local_rank=local_rank)
                self.procs.append(subprocess.Popen(
                    self.command, env=env, stdin=subprocess.DEVNULL,
                    preexec_fn=DIE_WITH_PARENT,
                ))
            return self._wait()
        finally:
            self._stop(0.0)  # nothing survives the supervisor, whatever happened above
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)

    def _wait(self) -> int:
        forwarded = 0
        signal_deadline: float | None = None
        while True:
            if len(self._signals) > forwarded:
                sig = self._signals[-1]
                forwarded = len(self._signals)
                self.log(f"{signal.Signals(sig).name} received: forwarding to the workers")
                self._send(sig)
                signal_deadline = signal_deadline or time.monotonic() + SIGNAL_GRACE_SECONDS
            codes = [p.poll() for p in self.procs]
            if self._signals:
                if all(c is not None for c in codes):
                    return 128 + self._signals[0]
                if time.monotonic() > signal_deadline:
                    self.log(f"workers still running {SIGNAL_GRACE_SECONDS:.0f}s after the signal: SIGKILL")
                    self._send(signal.SIGKILL)
                    signal_deadline = float("inf")
            else:
                failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    # Several may fail in one poll (a rank's death breaks its peers' collectives): the failure
                    # policy names the one to report (a configuration error, then a worker killed by a signal, then
                    # the lowest local rank).
                    cause = policy.root_cause(policy.Failure(name=f"worker {i}", kind=policy.classify(c),
                                                             description="", rank=i, code=c) for i, c in failed)
                    assert cause is not None and cause.rank is not None and cause.code is not None
                    i, code = cause.rank, cause.code
                    self.log(f"worker {i} (rank {self.node_rank * self.nproc + i}) failed with "
                             f"{'signal ' + str(-code) if code < 0 else 'exit ' + str(code)}; stopping the others")
                    self._stop(STOP_GRACE_SECONDS)
                    return exit_status(code)
                if all(c == 0 for c in codes):
                    return 0
            time.sleep(POLL_SECONDS)

    def _send(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass

    def _stop(self, grace: float) -> None:
        """SIGTERM the live workers, wait up to `grace` s, SIGKILL the rest, reap all."""
        if not any(p.poll() is None for p in self.procs):
            return
        self._send(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._send(signal.SIGKILL)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - uninterruptible sleep
                pass


def worker_command(argv: list[str]) -> list[str]:
    """`python -m trainingrun trainer ARGV` (or `$TRAININGRUN_CHILD_COMMAND trainer ARGV`, as the local launcher)."""
    return [*child_command_prefix(), "trainer", *argv]


__all__ = ["Supervisor", "exit_status", "is_worker", "worker_command", "worker_env"]
