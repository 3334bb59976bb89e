"""Child processes of a local run: start one attempt's processes, watch them, stop them without leaving orphans;
the metrics ports they serve on.

Each child runs in its own session (its own process group), so a Ctrl-C in the terminal reaches only the launcher,
which then stops the children in order: SIGTERM to every child's process group, a grace period, then SIGKILL to
whatever is left. On Linux each child also gets PR_SET_PDEATHSIG=SIGKILL (`trainingrun.childproc`), so even a launcher killed
with SIGKILL does not leave trainers behind.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainingrun.childproc import DIE_WITH_PARENT, child_command_prefix
from trainingrun.plan import ProcessPlan, RunPlan


def log_path(log_dir: Path, name: str, attempt: int) -> Path:
    """`<name>.log` for the first attempt, `<name>.attempt<k>.log` for restarts (earlier logs are kept)."""
    return log_dir / (f"{name}.log" if attempt == 0 else f"{name}.attempt{attempt}.log")


def describe_exit(code: int | None) -> str:
    """'running', 'exit 0', 'exit 78 (config error)', 'killed by SIGKILL'."""
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == 78:
        return "exit 78 (config error)"
    return f"exit {code}"


@dataclass
class Child:
    """One running (or finished) child process."""

    plan: ProcessPlan
    proc: subprocess.Popen
    log: Path
    started: float

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()


@dataclass
class ProcessGroup:
    """The processes of one attempt."""

    attempt: int
    children: list[Child] = field(default_factory=list)

    @classmethod
    def start(cls, plan: RunPlan, *, cwd: Path, log_dir: Path, extra_env: dict[str, str] | None = None) -> ProcessGroup:
        """Start every process of `plan` (the rollout first), each logging to its own file under `log_dir`."""
        group = cls(attempt=plan.attempt)
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for p in (plan.rollout, *plan.trainers):
                log = log_path(log_dir, p.name, plan.attempt)
                group.children.append(_spawn(p, cwd, log, extra_env, f"attempt {plan.attempt}"))
        except BaseException:
            group.stop(grace=0)
            raise
        return group

    def restart(self, name: str, *, cwd: Path, extra_env: dict[str, str], why: str) -> Child:
        """Start process `name` of the group again (it exited), alone, appending to its log; the others run on."""
        i = next(i for i, c in enumerate(self.children) if c.name == name)
        old = self.children[i]
        assert old.returncode is not None, f"{name} is still running"
        _signal_group(old.proc, signal.SIGKILL)  # whatever it left in its process group goes with it
        self.children[i] = _spawn(old.plan, cwd, old.log, extra_env, why)
        return self.children[i]

    def pids(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self.children}

    def exit_codes(self) -> dict[str, int | None]:
        return {c.name: c.returncode for c in self.children}

    def alive(self) -> list[Child]:
        return [c for c in self.children if c.returncode is None]

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every child's process group, wait up to `grace` seconds, then SIGKILL what is left; reap all."""
        for c in self.children:
            if c.returncode is None:
                _signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        for c in self.children:
            # Also the groups of children that already exited: a grandchild may still hold the group.
            _signal_group(c.proc, signal.SIGKILL)
        for c in self.children:
            try:
                c.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a process in uninterruptible sleep
                pass


def _spawn(p: ProcessPlan, cwd: Path, log: Path, extra_env: dict[str, str] | None, what: str) -> Child:
    """Start one process of the plan, its stdout and stderr appended to `log` after a header line."""
    prefix = child_command_prefix()
    # one OpenMP thread per process unless the user says otherwise: N processes sharing a few cores with torch's
    # default thread count ran a tiny model ~100x slower (docs/local.md)
    env = {"OMP_NUM_THREADS": "1", **os.environ, **p.env, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    with open(log, "ab") as fh:
        fh.write(f"# trainingrun local: {p.name} {what}: {shlex.join([*prefix, *p.args])}\n".encode())
        fh.flush()
        proc = subprocess.Popen(
            [*prefix, *p.args],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=DIE_WITH_PARENT,
        )
    return Child(plan=p, proc=proc, log=log, started=time.monotonic())


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the process group led by `proc` (its own session), or the process alone if the group is gone."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            if proc.poll() is None:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass


def write_json_atomic(path: Path, value: object) -> None:
    """Write JSON to `path` via a temporary file and rename, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full volume: leave the old file, not half a new one
        raise


def tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a text file ('' if missing)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def metrics_port_block(base: int, count: int, tries: int = 200) -> int:
    """The first port p >= base with p .. p+count-1 all free (the spec's port when it is free)."""
    p = base
    for _ in range(tries):
        if p + count - 1 > 65535:
            break
        if all(_port_free(p + i) for i in range(count)):
            return p
        p += count
    raise RuntimeError(f"no {count} free consecutive metrics ports from {base} (spec.metrics.port)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for bind(0) and outgoing connections (Linux: /proc; elsewhere the IANA range)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def quiet_port_block(count: int = 1, rng: random.Random | None = None) -> int:
    """The first of `count` consecutive free ports below the ephemeral range, from a random start.

    A port from free_port() lies inside that range: between the check and the bind seconds later (a trainer's
    rendezvous store, its metrics server) any socket bound to port 0 — gloo's pair listeners, another program's
    outgoing connection — can take it, and the bind fails. Ports below the range are handed out only on request; the
    random start keeps runs started side by side apart."""
    low, _high = ephemeral_port_range()
    floor = 20000 if low > 20000 + 64 * count else 1024
    return metrics_port_block((rng or random).randrange(floor, low - 64 * count), count)
