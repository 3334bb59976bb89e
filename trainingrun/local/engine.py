"""The engine servers of a local run (the plan's engine roles: `trainingrun.plan.engine_roles`, as many as
`trainingrun.engines.table.own_servers` says — e.g. `rollout.engine.type: vllm` without `engine.url`): a pool of
`rollout.engine.replicas` servers, supervised by the launcher, each started by its engine type's entry in the engine
table (`Servers.local`; for vllm `trainingrun.engines.vllm.multinode.local_replica`: one server, or a multi-node
replica of several processes).

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

Resize (`trainingrun scale`, read by the launcher: `trainingrun.local.scale`): the rollout is also given the file
RUN_DIR/engine-urls (URL_FILE, $TRAININGRUN_ENGINE_URL_FILE), the servers listed for it, which its pool re-reads before
each call. `resize_to(n)` starts servers engine-<i> for the new indices (listed by `step` once healthy, so the pool
loads its current weight version into them before their first request) and takes the servers from n on off the list
at once; `step` stops such a server once the rollout's pool has let it go — the list the pool took on last
(APPLIED_FILE, $TRAININGRUN_ENGINE_URL_APPLIED_FILE, written by the pool after each re-read) is newer than the
launcher's rewrite and leaves it out — or at once if it was never listed. Servers leave from the highest index down, so
replica i stays `replicas[i]`; a server leaving is not judged by the failure policy.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainingrun import failure_policy as policy
from trainingrun.engines.table import Servers, own_servers, server_kind
from trainingrun.engines.vllm.engine import read_urls, write_urls
from trainingrun.local.procs import describe_exit, free_port
from trainingrun.plan import EngineRole, engine_roles

LIVENESS_PERIOD = 5.0  # seconds between two /health probes of a running server
LIVENESS_SECONDS = 30.0  # /health failing this long (after it answered once since the start): no longer serving
AGAIN_SECONDS = 900.0  # the same error again this soon after a restart: deterministic
MAX_REPLICAS = 256  # spec.rollout.engine.replicas' maximum
URL_FILE = "engine-urls"  # in the run directory: the servers the rollout's pool uses ($TRAININGRUN_ENGINE_URL_FILE)
APPLIED_FILE = "engine-urls.applied"  # the list the rollout's pool took on ($TRAININGRUN_ENGINE_URL_APPLIED_FILE)


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
        self.joined = False  # listed for the rollout (healthy once since the run or the resize started it)
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

    def probe_due(self, now: float) -> bool:
        """Whether a new server's /health may be asked again (once per LIVENESS_PERIOD / 5 while it starts)."""
        if now - self._probed < LIVENESS_PERIOD / 5:
            return False
        self._probed = now
        return True

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
        """Its entry in pids.json's `processes` (`pids`: every process of the replica, the leader's first)."""
        return {"pid": self.server.pid, "role": "engine", "rank": self.index, "url": self.url,
                "log": str(self.server.log_path), "restarts": self.restarts, "down": self.down,
                "listed": self.joined, "pids": list(getattr(self.server, "pids", [self.server.pid]))}


class LocalEnginePool:
    """The run's engine servers (the plan's engine roles). ValueError when they cannot be run here (vLLM's
    environment missing, ...). Its size may change while the run runs (`resize_to`, `step`: module docstring,
    "Resize")."""

    def __init__(self, run, out_dir: Path):
        servers = server_kind(run.spec)
        assert servers is not None, "an engine in the rollout process has no servers"
        self.run, self.out_dir, self.servers = run, out_dir, servers
        self.title = servers.title
        self.replicas = [LocalEngine(run.spec, out_dir, role, servers)
                         for role in engine_roles(run, own_servers(run.spec))]
        self.wanted = len(self.replicas)  # the pool's size asked for: replicas from here on leave
        self.url_file = out_dir / URL_FILE
        self.applied_file = out_dir / APPLIED_FILE
        self._listed_at = 0.0  # when url_file was last written (time.time())
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        """Every replica's URL, comma-separated (what the rollout is given)."""
        return ",".join(r.url for r in self.listed())

    def start(self) -> None:
        for r in self.replicas:
            r.start()

    def healthy(self) -> bool:
        return all(r.healthy() for r in self.replicas)

    def check(self) -> list[policy.Failure]:
        """The replicas that exited since the last check (a replica leaving the pool is not judged)."""
        return [f for f in (r.check() for r in self.replicas[:self.wanted]) if f is not None]

    def replica(self, name: str) -> LocalEngine:
        return next(r for r in self.replicas if r.name == name)

    def starts(self) -> int:
        """Server starts so far, all replicas (a change means pids.json is out of date)."""
        return sum(r.server.starts for r in self.replicas)

    def live(self) -> list[LocalEngine]:
        return [r for r in self.replicas[:self.wanted] if not r.down]

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

    # -- resize (module docstring, "Resize")
    def listed(self) -> list[LocalEngine]:
        """The replicas the rollout's pool is given: those of the wanted size that joined."""
        return [r for r in self.replicas[:self.wanted] if r.joined]

    def publish(self) -> None:
        """Write the list of servers the rollout's pool re-reads ($TRAININGRUN_ENGINE_URL_FILE)."""
        self._listed_at = time.time()
        write_urls(self.url_file, [r.url for r in self.listed()])

    def join_all(self) -> None:
        """The servers started with the run are healthy: all listed."""
        for r in self.replicas:
            r.joined = True
        self.publish()

    def size(self) -> dict[str, int]:
        """pids.json's `engine_replicas`: the size asked for, the servers listed, those still leaving."""
        return {"wanted": self.wanted, "listed": len(self.listed()), "leaving": len(self.replicas) - self.wanted}

    def resize_to(self, n: int) -> None:
        """Ask for `n` servers: new ones start now (listed once healthy, `step`); the ones from `n` on leave the
        list at once and are stopped once the rollout's pool applied a list without them."""
        if not 1 <= n <= MAX_REPLICAS:
            raise ValueError(f"replicas: {n}; allowed: 1..{MAX_REPLICAS} (spec.rollout.engine.replicas)")
        self.wanted = n
        for i in range(len(self.replicas), n):
            r = LocalEngine(self.run.spec, self.out_dir, EngineRole(type=self.run.spec.rollout.engine.type,
                                                                   replica=i), self.servers)
            self.replicas.append(r)
            r.start()
        self.publish()

    def step(self) -> list[str]:
        """One look at a resize under way: a new server that became healthy is listed; a server leaving that the
        rollout's pool let go (or that never was listed) is stopped. What happened, one line each."""
        events: list[str] = []
        now = time.monotonic()
        joined = [r for r in self.replicas[:self.wanted] if not r.joined and r.server.proc is not None
                  and r.server.proc.poll() is None and r.probe_due(now) and r.healthy()]
        for r in joined:
            r.joined = True
            events.append(f"{r.name} healthy after {time.monotonic() - r.started:.0f}s at {r.url}: listed for the "
                          "rollout, which loads the current weight version into it before its first request")
        if joined:
            self.publish()
        applied = self._applied()
        while len(self.replicas) > self.wanted:
            r = self.replicas[-1]
            if r.joined and (applied is None or r.url in applied):
                break  # the rollout's pool may still send it requests
            r.stop()
            self.replicas.pop()
            events.append(f"{r.name} stopped: the rollout's pool let it go" if r.joined
                          else f"{r.name} stopped before it joined")
        return events

    def _applied(self) -> list[str] | None:
        """The list the rollout's pool took on since url_file was last written (None: none yet)."""
        try:
            if self.applied_file.stat().st_mtime < self._listed_at:
                return None
        except FileNotFoundError:
            return None
        return read_urls(str(self.applied_file))
