"""The vLLM server of a local run (`rollout.engine.type: vllm` without `engine.url`), supervised by the launcher.

The server is a service of the run, not part of an attempt: it starts before the first attempt, keeps running when
the trainer/rollout group restarts (it holds nothing the group needs: the rollout loads its weight version into it),
and stops when the run ends. Its environment is vLLM's own (`make vllm` builds .venv-vllm; elsewhere
$TRAININGRUN_VLLM_PYTHON), its log `logs/engine.log` (`engine.attempt<k>.log` after restarts).

When the server exits, the launcher applies the run's failure policy to it as to any process: a restart while
`failurePolicy.maxRestarts` allows (counted like a group restart, after the backoff), else the run fails naming the
engine. Meanwhile the rollout waits for /health and loads its weight version again (`trainingrun.vllm.engine`): only
the engine restarts, and no prompt is lost or answered twice.
"""

from __future__ import annotations

import time
from pathlib import Path

from trainingrun import failure_policy as policy
from trainingrun.local.procs import describe_exit, free_port, log_path
from trainingrun.vllm.client import VLLMClient
from trainingrun.vllm import server as vllm_server


def needs_local_engine(spec) -> bool:
    src = spec.rollout.source
    engine = spec.rollout.engine
    return src.type == "generate" and engine.type == "vllm" and not engine.url


class LocalEngine:
    """The run's vLLM server process (see the module docstring)."""

    def __init__(self, spec, out_dir: Path):
        python = vllm_server.find_python()
        if python is None:
            raise ValueError(f"rollout.engine.type: vllm needs vLLM's environment: run `make vllm` (builds "
                             f".venv-vllm) or set {vllm_server.PYTHON_ENV} to a Python that has vLLM, or give "
                             "rollout.engine.url")
        v = spec.rollout.engine.vllm
        model = Path(spec.model.hf).resolve()
        self.log_dir = out_dir / "logs"
        self.restarts = 0
        self.server = vllm_server.VLLMServer(
            str(model), port=free_port(), python=python, log_path=log_path(self.log_dir, "engine", 0),
            dtype=v.dtype, max_model_len=v.max_model_len or spec.model.resolved().seq_length,
            kv_cache_gib=v.kv_cache_gib, extra_args=tuple(v.args),
        )
        self._restart_at: float | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> None:
        self.server.start()

    def healthy(self) -> bool:
        return VLLMClient(self.url, timeout=5).healthy()

    def check(self) -> policy.Failure | None:
        """The server's exit as a `Failure` when it died since the last check (None while it runs or restarts)."""
        if self._restart_at is not None:
            if time.monotonic() >= self._restart_at:
                self._restart_at = None
                self.server.log_path = log_path(self.log_dir, "engine", self.restarts)
                self.server.start()
            return None
        proc = self.server.proc
        if proc is None or proc.poll() is None:
            return None
        code = proc.returncode
        return policy.Failure(name="engine", kind=policy.classify(code), role="engine", rank=0, code=code,
                              description=f"vLLM server {describe_exit(code)} (log {self.server.log_path})")

    def restart_after(self, seconds: float) -> None:
        """Start the server again `seconds` from now (the failure policy's backoff), on the same port."""
        self.restarts += 1
        self.server.proc = None
        self._restart_at = time.monotonic() + seconds

    def stop(self) -> None:
        self.server.close()
