"""Simulated vLLM servers for tests (`trainingrun.engines.simulated`): in this process (a thread) or as a process of
their own, which a test can kill, stop (SIGSTOP) and start again on the same port; and weight versions published as
the trainers' disk publisher does (an HF-style directory with a safetensors file and its digests in the store's
meta)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np

from trainingrun.engines.vllm.publish import commit_version
from trainingrun.engines.vllm.worker_ext import file_digests

ROOT = Path(__file__).resolve().parents[1]


class SimProcess:
    """`python -m trainingrun.engines.simulated` as a child process."""

    def __init__(self, port: int = 0, *, log: Path | None = None, **cfg):
        self.cfg, self.log = cfg, log
        self.port = port
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> SimProcess:
        args = [sys.executable, "-m", "trainingrun.engines.simulated", "--port", str(self.port)]
        for k, v in self.cfg.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        if self.log is not None:
            args += ["--log", str(self.log)]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = self.proc.stdout.readline()
        assert line.startswith("port "), line
        self.port = int(line.split()[1])
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/sim_stats", timeout=10) as r:
            return json.loads(r.read())

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:  # a stalled server: the socket accepts, nothing answers
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def cont(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.kill()


def weights_file(directory: Path, seed: int = 0, *, shapes=((8, 4), (4,))) -> Path:
    """A small safetensors file (the simulated engine checks names, shapes and digests, not values)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.layers.{i}.weight": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def publish_disk_version(store, root: Path, version: int) -> dict:
    """Weight version `version` as the trainers' disk publisher commits it: a directory and its files' digests."""
    d = weights_file(root / f"v{version:08d}-a0", seed=version)
    meta = {"method": "disk", "path": str(d), "files": file_digests(d), "bytes": (d / "model.safetensors").stat().st_size}
    assert commit_version(store, version, meta)
    return {**meta, "version": version}
