"""Trainer-side weight publishers for the vLLM engine (`spec.weightSync.type: disk | broadcast`).

They implement `trainingrun.trainer.weights.WeightPublisher`: `publish(version, module)` is called on every trainer
rank after every trained rollout (and once at the start, version 0). The tensor-, expert- and pipeline-parallel
ranks of data-parallel replica 0 gather the weights bucket by bucket (`modeling.stream.iter_live_buckets`, buckets
of `weightSync.bucketMiB`, of the run's `Architecture` the trainer resolved); trainer rank 0 converts each bucket to
Hugging Face names (`modeling.convert.iter_megatron_to_hf`) in the engine's dtype and makes them loadable, holding a
bucket or two:

  disk       an HF directory `<weightSync.path>/v<version>-a<attempt>`, one safetensors file per bucket, written beside
             its name and renamed into place (`modeling.hf_io.write_hf_shards`; config.json and tokenizer from
             `model.hf`); with several owners (TP, EP or PP > 1) each owner rank writes its own buckets' files in
             parallel and rank 0 finishes the directory (`DiskPublisher._publish_in_parallel`); the meta carries
             every weight file's size and SHA-256 (`files`), which the engine checks before loading. The attempt in the name keeps a fenced-off trainer of an older attempt (a zombie) from
             ever touching a directory the live attempt committed; its own commit is refused by the store's attempt
             fencing.
  lora       (a run with `trainer.lora`, `weightSync.type: disk`) the adapters only: a PEFT adapter directory
             `<weightSync.path>/v<version>-a<attempt>` (`adapter_model.safetensors` in the engine's dtype,
             `adapter_config.json`), gathered by the same streamed loop (`iter_live_buckets(adapters=True)`: B of a
             column-parallel layer and A of a row-parallel one concatenated over the TP ranks, experts' over the EP
             ranks) and renamed to PEFT's names (`lora.to_peft`: a layer's expert adapters stacked as PEFT keeps
             them); PEFT and vLLM read one tensor file, so rank 0 holds the adapters whole
             (megabytes) before writing it, beside its name and renamed into place. The meta carries the file's size
             and SHA-256, the adapter's name (`adapter_name`: the engine serves the version under it) and how many
             versions the engine keeps loaded (`keep`: maxPolicyLag + 1); the engine loads it with vLLM's
             `/v1/load_lora_adapter` (`sync.load_adapter`).
  broadcast  snapshots in host memory sharded over the owner ranks of replica 0 (each TP/EP rank keeps the
             buckets it assembles of its own stage's layers: `stream.iter_live_buckets(shard=True)`,
             `stream.shard_owner`), packed as the buckets arrive;
             rank 0's `BroadcastSender` (a TCPStore, the requests) and the others' `ShardServer`s send their own
             buckets in one transfer to the engines' workers when the rollout asks

and only then commits the version in the run's store (`Store.publish_weights(version, {"version": [version]}, meta)`:
no weights in the store, the meta says where the weights are; `commit_version`), so `Store.latest_weights()` never
names a version that is not complete. Versions below version − maxPolicyLag are released (store entries, directories, snapshots): the rollout asks for exactly
k − maxPolicyLag. Publishing a version the store already holds is skipped (a restarted trainer group republishing its
checkpoint's version changes nothing, and the engine may be reading it).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import numpy as np

from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.sync_plan import DEFAULT_BUCKET_MIB, bucket_bytes
from trainingrun.engines.vllm.broadcast import BroadcastSender, ShardServer
from trainingrun.engines.vllm.worker_ext import file_digest, file_digests

DIR_PREFIX = "v"


def version_dir(root: str | Path, version: int, attempt: int = 0) -> Path:
    return Path(root) / f"{DIR_PREFIX}{version:08d}-a{attempt}"


def dir_version(path: Path) -> int | None:
    """The weight version of a directory `version_dir` named (None for anything else)."""
    name = path.name
    if not name.startswith(DIR_PREFIX):
        return None
    head = name[len(DIR_PREFIX):].split("-a", 1)[0]
    return int(head) if head.isdigit() else None


def commit_version(store, version: int, meta: dict[str, Any]) -> bool:
    """Commit weight `version` in the run's store: the meta says where the weights are (the store holds one marker
    array, not the weights). Subject to the store's attempt fencing: a fenced-off trainer's commit is refused."""
    return store.publish_weights(version, {"version": np.asarray([version], np.int64)}, {**meta, "version": version})


def make_vllm_publisher(spec, store, *, arch: Architecture, rank: int, attempt: int = 0):
    """The publisher of `spec.weightSync.type` disk / broadcast for the vllm engine, on this trainer rank (Megatron's
    parallel state is initialised: the tensor-parallel ranks of replica 0 gather the weights of `arch`)."""
    from trainingrun.modeling.state import live_layout  # deferred: torch, megatron (after the trainer's CPU shim)

    # the ranks gathering one whole copy: expert-data-parallel replica 0 (= data-parallel replica 0 when dense)
    ws = spec.weight_sync
    kw = dict(rank=rank, arch=arch, dtype=spec.rollout.engine.vllm.dtype,
              max_policy_lag=spec.rollout.max_policy_lag, attempt=attempt, bucket_mib=ws.bucket_mib,
              **live_layout())
    if ws.type == "disk":
        root = ws.path or str(Path(spec.trainer.checkpoint.path) / "weights")
        if spec.trainer.lora is not None:  # the engine serves the base with LoRA: each version is an adapter
            return AdapterPublisher(store, root=root, base=spec.model.hf, **kw)
        return DiskPublisher(store, root=root, assets_dir=spec.model.hf, **kw)
    if spec.trainer.lora is not None:  # refused by the spec's validation (rule lora-sync-not-broadcast)
        raise ValueError("weightSync.type: broadcast with trainer.lora: set weightSync.type disk (adapters only)")
    # the engine reaches trainer 0 where the other trainers do (locally 127.0.0.1; in a cluster trainer-0's DNS name)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    backend = "nccl" if spec.trainer.gpus_per_replica > 0 else "gloo"
    return BroadcastPublisher(store, host=host, port=ws.port, backend=backend, **kw)


class _Base:
    def __init__(self, store, *, rank: int, arch: Architecture, dtype: str, max_policy_lag: int, dp_rank: int = 0,
                 attempt: int = 0, bucket_mib: int = DEFAULT_BUCKET_MIB, **layout):
        self.store, self.rank, self.arch, self.dtype, self.lag = store, rank, arch, dtype, max_policy_lag
        self.attempt, self.dp_rank = attempt, dp_rank
        self.bucket_bytes = bucket_bytes(bucket_mib)  # ValueError naming weightSync.bucketMiB
        self.layout = layout  # `gather_live_state`'s keywords (`modeling.state.live_layout`); none: one process
        self.last_seconds = 0.0
        self.last_bytes = 0
        if layout:
            from trainingrun.modeling.stream import shard_owner  # deferred: torch

            self.owner, self.owners = shard_owner(**layout)
        else:
            self.owner, self.owners = 0, 1

    def _owned_buckets(self, module) -> Iterator[dict]:
        """This owner's HF buckets of the sharded stream (every rank of replica 0 runs it to its end)."""
        if self.dp_rank != 0:
            return
        from trainingrun.modeling import convert  # deferred: torch
        from trainingrun.modeling.stream import iter_live_buckets  # deferred: torch

        buckets = iter_live_buckets(module, self.arch, self.bucket_bytes, shard=True, **self.layout)
        yield from convert.iter_megatron_to_hf(buckets, self.arch, complete=False)

    @staticmethod
    def _from_rank0(value: int) -> int:
        """Trainer rank 0's `value` on every trainer rank (`stream.world_int`: every rank calls it)."""
        from trainingrun.modeling.stream import world_int  # deferred: torch

        return world_int(value)

    def _adapter_buckets(self, module) -> Iterator[dict]:
        """The LoRA adapters (canonical names, whole), a bucket at a time, on rank 0; nothing elsewhere
        (every rank of replica 0 runs it to its end, as `_hf_buckets`)."""
        if self.dp_rank != 0:
            return
        from trainingrun.modeling.stream import iter_live_buckets  # deferred: torch

        yield from iter_live_buckets(module, self.arch, self.bucket_bytes, adapters=True, **self.layout)

    def _hf_buckets(self, module) -> Iterator[dict]:
        """The weights as HF tensors (engine names, trainer dtype), a bucket of weightSync.bucketMiB at a time, on
        rank 0; nothing elsewhere. Every rank of replica 0 must run it to its end (each bucket is a collective of
        its TP, EP and PP ranks); other replicas return at once."""
        if self.dp_rank != 0:
            return
        from trainingrun.modeling import convert  # deferred: torch
        from trainingrun.modeling.stream import iter_live_buckets  # deferred: torch

        buckets = iter_live_buckets(module, self.arch, self.bucket_bytes, **self.layout)
        if self.rank != 0:
            for _ in buckets:  # not rank 0: nothing is yielded here, the generator runs the collectives
                pass
            return
        yield from convert.iter_megatron_to_hf(buckets, self.arch)

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
        self.last_parts = 0  # the files this rank wrote of the last version (in parallel with the other owners)

    def publish(self, version: int, module: Any) -> None:
        self.last_seconds, self.last_bytes = 0.0, 0  # what this publish moved (nothing when skipped)
        if self.owners > 1:
            return self._publish_in_parallel(version, module)
        buckets = self._hf_buckets(module)  # collectives: every TP/PP rank of replica 0 takes part, even to skip
        if self.rank != 0 or self._committed(version):
            for _ in buckets:
                pass
            return
        import torch  # deferred: torch

        from trainingrun.modeling.hf_io import write_hf_shards  # deferred: torch

        t0 = time.perf_counter()
        self.root.mkdir(parents=True, exist_ok=True)
        target = version_dir(self.root, version, self.attempt)
        if target.exists():  # this attempt's own, never committed (a crash before the commit): write it again
            shutil.rmtree(target)
        # one safetensors file per bucket, written as it arrives: rank 0 holds a bucket or two, never the model
        path = write_hf_shards(target, buckets, self.arch, assets_dir=self.assets_dir,
                               dtype=getattr(torch, self.dtype))
        self._commit(version, path, file_digests(path), t0)  # the engine checks the digests before it loads

    def _publish_in_parallel(self, version: int, module: Any) -> None:
        """Several owners (the TP/EP ranks of every stage of replica 0; `stream.shard_owner`): each writes the
        safetensors files of the buckets it assembles into the version's staging directory, in parallel, with a record
        of them (names, tensors, sizes, SHA-256); rank 0 then names the files, writes the index and config.json, renames
        the directory into place and commits. Every trainer rank takes part (two collectives of the whole world: rank
        0's decision, a barrier); weightSync.path must be on a volume every trainer of replica 0 mounts, as
        checkpoint.path is."""
        import torch  # deferred: torch
        import torch.distributed as dist  # deferred: torch

        from trainingrun.modeling.hf_io import staging_dir  # deferred: torch

        t0 = time.perf_counter()
        target = version_dir(self.root, version, self.attempt)
        tmp = staging_dir(target, "parts")
        skip = True
        if self.rank == 0:
            skip = self._committed(version)
            if not skip:
                for d in (target, tmp):  # this attempt's own, never committed (a crash before the commit)
                    if d.exists():
                        shutil.rmtree(d)
                tmp.mkdir(parents=True)
        skip = bool(self._from_rank0(int(skip)))  # also orders every owner's writes after rank 0's mkdir
        buckets = self._owned_buckets(module)  # collectives: every TP/EP/PP rank of replica 0 runs it to its end
        if skip:
            for _ in buckets:
                pass
            return
        if self.dp_rank == 0:
            self._write_part(tmp, buckets, dtype=getattr(torch, self.dtype))
        dist.barrier()  # every owner's part is written (or its failure recorded)
        if self.rank != 0:
            return
        self._commit(version, target, self._finish(tmp, target), t0)

    def _commit(self, version: int, path: Path, files: dict[str, list], t0: float, **meta) -> None:
        """Rank 0, a version's directory in place: its meta (`files`: each weight file's size and SHA-256, checked by
        the engine before it loads; `method` "disk" unless `meta` says otherwise) committed in the store, the versions
        the rollout can no longer ask for released, and what this publish moved recorded."""
        nbytes = sum(size for size, _ in files.values())
        commit_version(self.store, version, {"method": "disk", "path": str(path), "bytes": nbytes,
                                             "dtype": self.dtype, "files": files, **meta})
        self._release(version)
        self.last_seconds = time.perf_counter() - t0
        self.last_bytes = nbytes

    def _write_part(self, tmp: Path, buckets: Iterator[dict], *, dtype) -> None:
        """This owner's files and their record `.owner-<i>.json` (or the error that stopped them: the stream is run
        to its end either way, so that the other ranks' collectives complete)."""
        from trainingrun.modeling.hf_io import write_part_files  # deferred: torch

        record: dict[str, Any]
        try:
            parts = write_part_files(tmp, buckets, prefix=f"part-o{self.owner:04d}", dtype=dtype)
            for part in parts:
                part["size"], part["sha256"] = file_digest(tmp / part["file"])
            record = {"owner": self.owner, "parts": parts}
            self.last_parts = len(parts)
        except Exception as exc:  # noqa: BLE001 - reported by rank 0, which commits nothing
            for _ in buckets:
                pass
            record = {"owner": self.owner, "error": f"{type(exc).__name__}: {exc}"}
        path = tmp / f".owner-{self.owner:04d}.json"
        path.with_suffix(".tmp").write_text(json.dumps(record))
        path.with_suffix(".tmp").rename(path)

    def _finish(self, tmp: Path, target: Path) -> dict[str, list]:
        """Rank 0: the owners' records read, the directory made whole and renamed into place; the files' digests."""
        from trainingrun.modeling.hf_io import finish_hf_dir  # deferred: torch

        parts = []
        for owner in range(self.owners):
            path = tmp / f".owner-{owner:04d}.json"
            record = json.loads(path.read_text()) if path.is_file() else {"error": "wrote no record"}
            if "error" in record:
                shutil.rmtree(tmp, ignore_errors=True)
                raise RuntimeError(f"weight version {target.name}: trainer owner {owner}'s part failed: "
                                   f"{record['error']}; nothing was published")
            parts.extend(record["parts"])
            path.unlink()
        finish_hf_dir(tmp, target, parts, self.arch, assets_dir=self.assets_dir)
        return {p["final"]: [p["size"], p["sha256"]] for p in parts}

    def _release(self, version: int) -> None:
        keep_from = max(0, version - self.lag)
        self.store.release_weights_below(keep_from)
        for d in self.root.glob(f"{DIR_PREFIX}*"):
            v = dir_version(d)
            if v is not None and v < keep_from:
                shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        pass


ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def adapter_name(version: int) -> str:
    """The name a LoRA-serving engine serves weight `version` under (the `model` of its requests)."""
    return f"trainingrun-v{version}"


class AdapterPublisher(DiskPublisher):
    """`disk` for a LoRA run: each version a PEFT adapter directory (the module docstring, "lora")."""

    def __init__(self, store, *, root: str | Path, base: str | Path | None, **kw):
        super().__init__(store, root=root, assets_dir=base, **kw)
        self.base = None if base is None else str(Path(base).resolve())

    def publish(self, version: int, module: Any) -> None:
        self.last_seconds, self.last_bytes = 0.0, 0
        buckets = self._adapter_buckets(module)  # collectives: every TP/PP rank of replica 0 takes part
        if self.rank != 0 or self._committed(version):
            for _ in buckets:
                pass
            return
        import torch  # deferred: torch
        from safetensors.torch import save_file  # deferred: safetensors

        from trainingrun.modeling.hf_io import staging_dir  # deferred: torch
        from trainingrun.modeling.lora import adapter_settings, peft_config, to_peft  # deferred: torch

        t0 = time.perf_counter()
        dtype = getattr(torch, self.dtype)
        tensors: dict[str, torch.Tensor] = {}
        for bucket in buckets:  # the adapters are megabytes: held whole, in the engine's dtype
            tensors.update({k: v.to(dtype).contiguous() for k, v in bucket.items()})
        if not tensors:
            raise ValueError("trainer.lora: the model holds no adapters to publish")
        rank, scale = adapter_settings(module)
        # PEFT's names; a layer's experts stacked into PEFT's tensors of transformers' fused expert weights
        tensors, modules, params = to_peft(tensors, self.arch.moe.num_experts if self.arch.moe else 0)
        self.root.mkdir(parents=True, exist_ok=True)
        target = version_dir(self.root, version, self.attempt)
        tmp = staging_dir(target, f"tmp-{os.getpid()}")
        for d in (target, tmp):  # this attempt's own, never committed (a crash before the commit): write it again
            if d.exists():
                shutil.rmtree(d)
        tmp.mkdir()
        save_file(tensors, str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config(rank, scale, modules, self.base, params), indent=1))
        tmp.rename(target)
        self._commit(version, target, file_digests(target), t0, method="lora", adapter_name=adapter_name(version),
                     rank=rank, keep=self.lag + 1)


class BroadcastPublisher(_Base):
    """The snapshots kept for the engines (maxPolicyLag + 1 versions) live in host memory, sharded over the ranks
    of replica 0 that own their parts (`stream.shard_owner`: every TP or EP rank of every pipeline stage; no GPU
    copy): rank 0 a `BroadcastSender` (the TCPStore, the requests, its own buckets), each
    other owner a `ShardServer` that joins every transfer and sends its own buckets. Rank 0 commits a version only
    once every owner's part of it is there."""

    def __init__(self, store, *, host: str, port: int = 0, timeout: float = 300.0, backend: str = "gloo", **kw):
        super().__init__(store, **kw)
        self.host, self.backend = host, backend
        self.sender = None
        if self.owners > 1:  # every rank: the other owners learn rank 0's store port (0 = a free one)
            port = self._share_port(port, timeout)
        else:
            self._start(port, timeout)

    def _holder_kw(self, timeout: float) -> dict[str, Any]:
        if self.backend == "gloo":
            device: Any = "cpu"
        else:  # NCCL: the snapshot stays in host memory; each bucket goes to this rank's GPU for its broadcast
            import torch  # deferred: torch

            device = torch.device("cuda", torch.cuda.current_device())
        return dict(backend=self.backend, timeout=timeout, dtype=self.dtype, keep_versions=self.lag + 1,
                    device="cpu", transfer_device=device, bucket_bytes=self.bucket_bytes, owners=self.owners,
                    log=lambda msg: print(f"[trainer {self.rank}] weights: {msg}", file=sys.stderr, flush=True))

    def _start(self, port: int, timeout: float) -> int:
        if self.rank == 0:
            self.sender = BroadcastSender(port, **self._holder_kw(timeout)).start()
            return self.sender.port
        return port

    def _share_port(self, port: int, timeout: float) -> int:
        # every trainer rank constructs its publisher here
        port = self._from_rank0(self._start(port, timeout) if self.rank == 0 else 0)
        if self.rank != 0 and self.dp_rank == 0:
            self.sender = ShardServer(self.host, port, owner=self.owner, **self._holder_kw(timeout)).start()
        return port

    def publish(self, version: int, module: Any) -> None:
        self.last_seconds, self.last_bytes = 0.0, 0  # what this publish moved (nothing when skipped)
        # collectives: every TP/PP rank of replica 0 takes part, even to skip
        buckets = self._owned_buckets(module) if self.owners > 1 else self._hf_buckets(module)
        held = self.sender is not None and version in self.sender.versions
        if self.sender is None or held and (self.rank != 0 or self._committed(version)):
            for _ in buckets:
                pass
            return

        t0 = time.perf_counter()
        # packed bucket by bucket as they arrive: this rank's part plus a bucket or two, never a second whole copy
        snap = self.sender.set_weights(version, (item for hf in buckets for item in hf.items()))
        if self.rank != 0:
            self.last_seconds, self.last_bytes = time.perf_counter() - t0, snap.nbytes
            return
        nbytes = sum(int(p["bytes"]) for p in self.sender.parts(version)) if self.owners > 1 else snap.nbytes
        commit_version(self.store, version, {"method": "broadcast", "host": self.host, "port": self.sender.port,
                                             "backend": self.backend, "bytes": nbytes, "dtype": self.dtype})
        self.store.release_weights_below(max(0, version - self.lag))
        self.last_seconds = time.perf_counter() - t0
        self.last_bytes = nbytes

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
