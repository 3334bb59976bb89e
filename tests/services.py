"""Real services for tests, started on 127.0.0.1 random ports and ended by PID.

Locally a missing binary skips the test with a reason; with TRAININGRUN_REQUIRE_SERVICES=1 (CI) it fails instead.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from trainingrun.local.procs import quiet_port_block

REQUIRE = os.environ.get("TRAININGRUN_REQUIRE_SERVICES") == "1"


def require_binary(name: str) -> str:
    """Path of `name`, or skip (fail in CI) with a reason."""
    path = shutil.which(name)
    if path:
        return path
    message = f"{name} is not installed (apt-get install -y {name}); required in CI"
    if REQUIRE:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics_ports(count: int) -> int:
    """The first of `count` consecutive free ports for a run's spec.metrics.port, below the ephemeral range.

    A block from free_port() lies inside that range: between the launcher's check and a trainer's bind, seconds later,
    any socket bound to port 0 (gloo's many pair listeners, an outgoing connection) can take one of its ports, and that
    trainer then serves no metrics (seen in CI: every rank-0 gauge missing from a dashboard run)."""
    return quiet_port_block(count)


def rendezvous_port(count: int = 1) -> int:
    """MASTER_PORT (and `count` - 1 more after it) for a group of torch.distributed processes, below the ephemeral range.

    free_port()'s port stays free only until some socket binds port 0: rank 0 binds MASTER_PORT after importing torch
    and Megatron (tens of seconds on a loaded 2-core machine), while the other pytest worker's gloo groups open
    listeners on port 0 (seen in CI: a 3-rank checkpoint group never formed and timed out after 300 s)."""
    return quiet_port_block(count)


ROOT = Path(__file__).resolve().parents[1]


def rank_group(args: list[str], world: int, *, timeout: float, cwd: Path | None = None,
               env: dict[str, str] | None = None, what: str = "") -> list[str]:
    """Run `args` as ranks 0 .. world-1 of one torch.distributed group on 127.0.0.1; every rank's output.

    Every rank must exit 0. Output goes to files, not pipes (a rank blocked on a full pipe stalls the others in their
    next collective), and one deadline covers the group: past it every rank still running is killed and the failure
    shows each rank's last lines."""
    base = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(rendezvous_port()),
            "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    logs = [tempfile.TemporaryFile("w+") for _ in range(world)]
    procs = [subprocess.Popen(args, env={**base, "RANK": str(r)}, cwd=cwd, stdout=logs[r], stderr=subprocess.STDOUT,
                              text=True) for r in range(world)]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        late = [r for r, p in enumerate(procs) if p.poll() is None]
        for r in late:
            procs[r].kill()
            procs[r].wait()
        outs = []
        for f in logs:
            f.seek(0)
            outs.append(f.read())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    label = f"{what} " if what else ""
    if late:
        tails = "\n".join(f"--- rank {r} ({'killed' if r in late else f'exit {procs[r].returncode}'}):\n{o[-2500:]}"
                          for r, o in enumerate(outs))
        pytest.fail(f"{label}group of {world}: ranks {late} still running after {timeout:.0f} s\n{tails}")
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"{label}rank {r} failed (exit {p.returncode}):\n{out[-4000:]}"
    return outs


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            last = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last})")


def stop_process(proc: subprocess.Popen, timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class RedisServer:
    """A real redis-server on 127.0.0.1; `restart()` keeps the port (for fault tests). Without persistence (the
    default) a restarted server comes back empty; with `persist=True` it keeps its data (append-only file, fsync'ed
    on every write) across restarts."""

    def __init__(self, binary: str, workdir: Path, *, persist: bool = False):
        self.binary = binary
        self.workdir = workdir
        self.persist = persist
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.persist else "no", "--appendfsync", "always",
             "--dir", str(self.workdir), "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

        def ping() -> bool:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")

        wait_for(ping, 10, f"redis-server on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None

    def restart(self, down_seconds: float = 0.0) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()


@contextmanager
def redis_server(*, persist: bool = False) -> Iterator[RedisServer]:
    binary = require_binary("redis-server")
    with tempfile.TemporaryDirectory(prefix="trainingrun-redis-") as d:
        server = RedisServer(binary, Path(d), persist=persist)
        server.start()
        try:
            yield server
        finally:
            server.stop()


class Prometheus:
    """A real Prometheus scraping `targets` every second; `query(promql)` returns the result vector."""

    def __init__(self, url: str, proc: subprocess.Popen):
        self.url = url
        self.proc = proc

    def query(self, promql: str) -> list[dict]:
        import json
        import urllib.parse

        with urllib.request.urlopen(f"{self.url}/api/v1/query?query={urllib.parse.quote(promql)}", timeout=5) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus query failed: {promql}: {body}")
        return body["data"]["result"]

    def wait_query(self, promql: str, timeout: float = 30) -> list[dict]:
        return wait_for(lambda: self.query(promql), timeout, f"prometheus data for {promql!r}", interval=0.5)


@contextmanager
def prometheus_server(targets: list[str], *, rule_files: list[str] | None = None,
                      scrape_interval: str = "1s") -> Iterator[Prometheus]:
    binary = require_binary("prometheus")
    with tempfile.TemporaryDirectory(prefix="trainingrun-prom-") as d:
        import yaml

        config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "trainingrun", "static_configs": [{"targets": targets}]}],
        }
        if rule_files:
            config["rule_files"] = rule_files
        cfg = Path(d) / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        port = free_port()
        log = open(Path(d) / "prometheus.log", "wb")
        proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={d}/data",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=1).status == 200, 30, "prometheus ready")
            yield Prometheus(url, proc)
        finally:
            stop_process(proc)
            log.close()


# ---------------------------------------------------------------------------------------------------- vLLM
ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TINY_LLAMA = ROOT / "tests" / "tiny_llama.py"


def require_vllm() -> str:
    """The Python of vLLM's own environment (`make vllm` builds .venv-vllm), or skip (fail in CI) with a reason."""
    if VLLM_PYTHON.exists() and (VLLM_PYTHON.parent.parent / ".ok").exists():
        return str(VLLM_PYTHON)
    message = f"{VLLM_PYTHON.parent.parent.relative_to(ROOT)} is missing or incomplete (run `make vllm`); required in CI"
    if REQUIRE:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def run_vllm_python(python: str, *args: str, timeout: float = 300) -> str:
    """Run a script with vLLM's Python (one thread, offline); its stdout, or RuntimeError with its stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([python, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode:
        raise RuntimeError(f"{python} {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def make_tiny_llama(python: str, out: Path, *, seed: int = 0, perturb_from: Path | None = None,
                    scale: float = 0.5, hidden: int = 128) -> Path:
    """A tiny random Llama HF directory made by `transformers` (tests/tiny_llama.py); `perturb_from`: its weights
    plus seeded noise (new weights for weight-sync tests); `hidden` 64: head_dim 16."""
    args = [str(TINY_LLAMA), str(out), "--seed", str(seed), "--hidden", str(hidden)]
    if perturb_from is not None:
        args += ["--perturb-from", str(perturb_from), "--scale", str(scale)]
    run_vllm_python(python, *args)
    return out


def reference_logprobs(python: str, model_dirs: list[Path], tokens: list[int]) -> dict[Path, list[float]]:
    """fp32 `transformers` log p(token i | tokens < i), i >= 1, under each HF directory (one subprocess)."""
    import json

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "lp.json"
        run_vllm_python(python, str(TINY_LLAMA), ",".join(map(str, model_dirs)), "--logprobs", str(out),
                        "--tokens", ",".join(map(str, tokens)))
        got = json.loads(out.read_text())
    return {Path(k): v for k, v in got.items()}


@contextmanager
def vllm_server(model_dir: Path, log_path: Path, *, python: str | None = None, start_timeout: float = 600,
                extra_args: tuple[str, ...] = ()) -> Iterator["VLLMServer"]:  # noqa: F821 - imported lazily
    """A real vLLM OpenAI server (CPU) on a random 127.0.0.1 port, with the weight-sync worker extension; stopped
    (its process group, which it leads) on exit. ~55 s to healthy on a quiet 2-core machine, ~1.5 GB RSS here."""
    from trainingrun.engines.vllm.server import VLLMServer

    python = python or require_vllm()
    server = VLLMServer(str(model_dir), port=free_port(), python=python, log_path=log_path, extra_args=extra_args)
    server.start()
    try:
        server.wait_healthy(start_timeout)
        yield server
    finally:
        server.close()


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs: it exists and is not a zombie (a zombie is gone for a test's purposes; /proc tells
    the state — read after the name's closing parenthesis, since a name may hold spaces)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
