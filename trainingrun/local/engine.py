"""The engine servers of a local run (the plan's engine roles: `trainingrun.plan.engine_roles`, as many as
`trainingrun.engines.table.own_servers` says — e.g. `rollout.engine.type: vllm` without `engine.url`): a pool of
`rollout.engine.replicas` servers, supervised by the launcher, each started by its engine type's entry in the engine
table (`Servers.local`; for vllm `trainingrun.engines.vllm.server.local_server`).

The servers are a service of the run, not part of an attempt: they start before the first attempt, keep running when
the trainer/rollout group restarts (they hold nothing the group needs: the rollout loads its weight version into
them), and stop when the run ends. Replica i is `engine-<i>` (its own free port; `pids.json` lists it under
`processes` with role `engine` and rank i; its log is `logs/engine-<i>.log`, appended to across its restarts). A vLLM
server's environment is vLLM's own (`make vllm` builds .venv-vllm; elsewhere $TRAININGRUN_VLLM_PYTHON). The rollout
is given every replica's URL, comma-separated ($TRAININGRUN_ENGINE_URL).

A replica that exits is restarted alone, on its own port, after the failure policy's backoff (`Launcher`
decides, `trainingrun.failure_policy`); meanwhile the rollout sends its prompts to the other replicas and, once it
answers again, loads the current weight version into it before it gets a request (`trainingrun.engines.pool`). A
replica beyond the budget stays down; the run fails only when no replica is left, naming every replica and its last
exit.

A server that is up but no longer serves — its process runs, its /health failed for LIVENESS_SECONDS after it had
answered (vLLM's API server stuck "waiting for background tasks" after its engine died) — is seen as down: killed,
and handled as a replica that exited (the operator's pods have the same rule as their liveness probe). Each failure
names the engine's own error, the first exception line of its log since it last started (`error()`: vLLM logs the
root cause first). A replica that fails with the same error again within AGAIN_SECONDS of its restart
(`failed_again`) has a deterministic error that no restart fixes: the launcher ends the run (exit 78) naming it.
(Every replica failing with one error is the rollout's to see: its engine pool compares the errors of the requests,
`EnginePool._fault`.)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainingrun import failure_policy as policy
from trainingrun.engines.table import Servers, own_servers, server_kind
from trainingrun.local.procs import describe_exit, free_port
from trainingrun.plan import EngineRole, engine_roles

LIVENESS_PERIOD = 5.0  # seconds between two /health probes of a running server
LIVENESS_SECONDS = 30.0  # /health failing this long (after it answered once since the start): no longer serving
AGAIN_SECONDS = 900.0  # the same error again this soon after a restart: deterministic


def needs_local_engine(spec) -> bool:
    """Whether the launcher runs engine servers for the run (`trainingrun.engines.table.own_servers`)."""
    return own_servers(spec) > 0


class LocalEngine:
    """One server of the run's pool (see the module docstring): the plan's engine role `role`."""

    def __init__(self, spec, out_dir: Path, role: EngineRole, servers: Servers):
        self.index = role.replica
        self.name = role.name
        self.title = servers.title
        self.restarts = 0  # restarts of this replica
        self.down = False  # beyond the budget: left down for good
        self.last_exit = ""
        self.errors: list[str] = []  # the engine's own error of each failure ('' where its log named none)
        self.started = time.monotonic()  # its last start
        self.failed_at = 0.0  # its last failure
        self.server = servers.local(spec, log_path=out_dir / "logs" / f"{self.name}.log", port=free_port())
        self._restart_at: float | None = None
        self._probed = 0.0  # when /health was last asked (liveness)
        self._served = False  # /health answered since the last start
        self._unhealthy_since: float | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> None:
        self.server.start()
        self.started = time.monotonic()

    def healthy(self) -> bool:
        ok = self.server.healthy()
        self._served = self._served or ok
        return ok

    def error(self) -> str:
        """The engine's own error since it last started (its log's first exception line), '' if none."""
        read: Any = getattr(self.server, "error", None)
        return read() if read is not None else ""

    def check(self) -> policy.Failure | None:
        """The server's exit as a `Failure` when it died since the last check (None while it runs or restarts)."""
        if self.down:
            return None
        if self._restart_at is not None:
            if time.monotonic() >= self._restart_at:
                self._restart_at = None
                with open(self.server.log_path, "a") as log:  # one log per replica, over its restarts
                    log.write(f"\n--- trainingrun: {self.name} restart {self.restarts} ---\n")
                self.server.start()
                self.started = time.monotonic()
            return None
        proc = self.server.proc
        if proc is None:
            return None
        if proc.poll() is None:
            if not self._stopped_serving():
                return None
            self.server.kill()  # up, but no longer serving: seen as down (module docstring)
            why = f"stopped serving (/health failing for {LIVENESS_SECONDS:.0f}s while its process ran; killed)"
        else:
            why = describe_exit(proc.returncode)
        code = proc.returncode
        self.last_exit = why
        self.failed_at = time.monotonic()
        error = self.error()
        self.errors.append(error)
        return policy.Failure(name=self.name, kind=policy.classify(code), role="engine", rank=self.index, code=code,
                              description=f"{self.title} server {self.name} {why}"
                                          + (f": {error}" if error else "") + f" (log {self.server.log_path})")

    def _stopped_serving(self) -> bool:
        """Its /health has failed for LIVENESS_SECONDS after answering since it started (probed every
        LIVENESS_PERIOD)."""
        now = time.monotonic()
        if now - self._probed < LIVENESS_PERIOD:
            return False
        self._probed = now
        if self.healthy():
            self._unhealthy_since = None
            return False
        if not self._served:
            return False  # still starting: the start-up timeout is the launcher's
        self._unhealthy_since = self._unhealthy_since or now
        return now - self._unhealthy_since >= LIVENESS_SECONDS

    def failed_again(self) -> str:
        """The error of its last failure when its failure before (a restart ago) had the same one and it came
        within AGAIN_SECONDS of the restart, else ''."""
        if (len(self.errors) >= 2 and self.errors[-1] and self.errors[-1] == self.errors[-2]
                and self.failed_at - self.started <= AGAIN_SECONDS):
            return self.errors[-1]
        return ""

    def restart_after(self, seconds: float) -> None:
        """Start the server again `seconds` from now (the failure policy's backoff), on the same port."""
        self.restarts += 1
        self.server.proc = None
        self._restart_at = time.monotonic() + seconds
        self._served, self._unhealthy_since = False, None

    def give_up(self) -> None:
        """Beyond the budget: the replica stays down."""
        self.down = True
        self.server.proc = None

    def stop(self) -> None:
        self.server.close()

    def process(self) -> dict:
        """Its entry in pids.json's `processes`."""
        return {"pid": self.server.pid, "role": "engine", "rank": self.index, "url": self.url,
                "log": str(self.server.log_path), "restarts": self.restarts, "down": self.down}


class LocalEnginePool:
    """The run's engine servers (the plan's engine roles). ValueError when they cannot be run here (vLLM's
    environment missing, ...)."""

    def __init__(self, run, out_dir: Path):
        servers = server_kind(run.spec)
        assert servers is not None, "an engine in the rollout process has no servers"
        self.title = servers.title
        self.replicas = [LocalEngine(run.spec, out_dir, role, servers)
                         for role in engine_roles(run, own_servers(run.spec))]
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        """Every replica's URL, comma-separated (what the rollout is given)."""
        return ",".join(r.url for r in self.replicas)

    def start(self) -> None:
        for r in self.replicas:
            r.start()

    def healthy(self) -> bool:
        return all(r.healthy() for r in self.replicas)

    def check(self) -> list[policy.Failure]:
        """The replicas that exited since the last check."""
        return [f for f in (r.check() for r in self.replicas) if f is not None]

    def replica(self, name: str) -> LocalEngine:
        return next(r for r in self.replicas if r.name == name)

    def starts(self) -> int:
        """Server starts so far, all replicas (a change means pids.json is out of date)."""
        return sum(r.server.starts for r in self.replicas)

    def live(self) -> list[LocalEngine]:
        return [r for r in self.replicas if not r.down]

    def errors(self) -> str:
        """The replicas' own errors since they last started, where their logs name one: 'engine-0, engine-1:
        RuntimeError: ...' ('' if none)."""
        by_error: dict[str, list[str]] = {}
        for r in self.replicas:
            error = r.error()
            if error:
                by_error.setdefault(error, []).append(r.name)
        return "; ".join(f"{', '.join(names)}: {error}" for error, names in by_error.items())

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()

    def processes(self) -> dict[str, dict]:
        return {r.name: r.process() for r in self.replicas}
