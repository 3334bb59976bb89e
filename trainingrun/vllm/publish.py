"""Trainer-side weight publishers for the vLLM engine (`spec.weightSync.type: disk | broadcast`).

They implement `trainingrun.trainer.weights.WeightPublisher`: `publish(version, module)` is called on every trainer
rank after every trained rollout (and once at the start, version 0). The tensor-parallel ranks of data-parallel
replica 0 gather the full weights (`full_state.gather_live_state`); trainer rank 0 converts them to Hugging Face
names (`modeling.convert`) in the engine's dtype and makes them loadable:

  disk       an HF directory `<weightSync.disk.path>/v<version>` written beside its name and renamed into place
             (`modeling.hf_io.write_hf_dir`; config.json and tokenizer from `model.hf`)
  broadcast  a snapshot held by a `BroadcastSender` on rank 0 (a TCPStore + one process group per transfer), which
             the engine's workers fetch when the rollout asks

and only then commits the version in the run's store (`Store.publish_weights(version, {}, meta)`: no arrays, the
meta says where the weights are), so `Store.latest_weights()` never names a version that is not complete. Versions
below version − maxPolicyLag are released (store entries, directories, snapshots): the rollout asks for exactly
k − maxPolicyLag. Publishing a version the store already holds is skipped (a restarted trainer group republishing its
checkpoint's version changes nothing, and the engine may be reading it).
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

DIR_PREFIX = "v"


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"{DIR_PREFIX}{version:08d}"


class _Base:
    def __init__(self, store, *, rank: int, arch: dict[str, Any], dtype: str, max_policy_lag: int, tp_group=None,
                 tp_size: int = 1, tp_rank: int = 0, dp_rank: int = 0):
        self.store, self.rank, self.arch, self.dtype, self.lag = store, rank, arch, dtype, max_policy_lag
        self.tp_group, self.tp_size, self.tp_rank, self.dp_rank = tp_group, tp_size, tp_rank, dp_rank
        self.last_seconds = 0.0
        self.last_bytes = 0

    def _gather(self, module) -> dict | None:
        """Full canonical Megatron state on rank 0; None elsewhere (replica 0's TP ranks take part)."""
        if self.dp_rank != 0:
            return None
        from trainingrun.trainer.full_state import gather_live_state

        state = gather_live_state(module, self.arch, tp_group=self.tp_group, tp_size=self.tp_size,
                                  tp_rank=self.tp_rank)
        return state if self.rank == 0 else None

    def _committed(self, version: int) -> bool:
        latest = self.store.latest_weights()
        if latest is None or latest < version:
            return False
        try:
            self.store.read_weights(version)
        except Exception:  # noqa: BLE001 - released or never there
            return False
        return True


class DiskPublisher(_Base):
    def __init__(self, store, *, root: str | Path, assets_dir: str | Path, **kw):
        super().__init__(store, **kw)
        self.root = Path(root).resolve()  # the engine runs elsewhere: it needs an absolute path
        self.assets_dir = assets_dir

    def publish(self, version: int, module: Any) -> None:
        state = self._gather(module)  # a collective: every TP rank of replica 0 takes part, even for a republish
        if self.rank != 0 or self._committed(version):
            return
        import torch

        from trainingrun.modeling.hf_io import write_hf_dir

        t0 = time.perf_counter()
        self.root.mkdir(parents=True, exist_ok=True)
        path = write_hf_dir(version_dir(self.root, version), state, self.arch, assets_dir=self.assets_dir,
                            dtype=getattr(torch, self.dtype))
        nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        self.store.publish_weights(version, {}, {"method": "disk", "path": str(path), "bytes": nbytes,
                                                 "dtype": self.dtype, "version": version})
        self._release(version)
        self.last_seconds = time.perf_counter() - t0
        self.last_bytes = nbytes

    def _release(self, version: int) -> None:
        keep_from = max(0, version - self.lag)
        self.store.release_weights_below(keep_from)
        for d in self.root.glob(f"{DIR_PREFIX}*"):
            try:
                v = int(d.name[len(DIR_PREFIX):])
            except ValueError:
                continue
            if v < keep_from:
                shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        pass


class BroadcastPublisher(_Base):
    def __init__(self, store, *, host: str, port: int = 0, timeout: float = 300.0, backend: str = "gloo", **kw):
        super().__init__(store, **kw)
        self.host, self.backend = host, backend
        self.sender = None
        if self.rank == 0:
            from trainingrun.vllm.broadcast import BroadcastSender

            if backend == "gloo":
                device: Any = "cpu"
            else:  # NCCL: snapshots stay on this rank's GPU
                import torch

                device = torch.device("cuda", torch.cuda.current_device())
            self.sender = BroadcastSender(port, backend=backend, timeout=timeout, dtype=self.dtype,
                                          keep_versions=self.lag + 1, device=device,
                                          log=lambda msg: print(f"[trainer 0] weights: {msg}", file=sys.stderr,
                                                                flush=True)).start()

    def publish(self, version: int, module: Any) -> None:
        state = self._gather(module)
        if self.rank != 0:
            return
        from trainingrun.modeling import convert

        if self._committed(version) and version in self.sender.versions:
            return

        t0 = time.perf_counter()
        snap = self.sender.set_weights(version, convert.megatron_to_hf(state, self.arch).items())
        self.store.publish_weights(version, {}, {"method": "broadcast", "host": self.host, "port": self.sender.port,
                                                 "backend": self.backend, "bytes": snap.nbytes, "dtype": self.dtype,
                                                 "version": version})
        self.store.release_weights_below(max(0, version - self.lag))
        self.last_seconds = time.perf_counter() - t0
        self.last_bytes = snap.nbytes

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
