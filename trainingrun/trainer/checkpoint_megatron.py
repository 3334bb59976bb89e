"""Model and optimizer checkpoints through Megatron's distributed checkpointing (`megatron.core.dist_checkpointing`).

The file protocol (atomic commit, verification, fallback, keep-N, fencing) is `checkpoint.py`; this module supplies
what it writes into a checkpoint's `dist/` directory and how the trainer group agrees (torch.distributed).

Format: Megatron's `torch_dist` sharded format. The state is {"model": GPTModel.sharded_state_dict(),
"optimizer": optimizer.sharded_state_dict(model)}: every tensor is stored once under its global (unsharded) key
with its shape, and each rank reads exactly the slices its own data-/tensor-parallel layout needs — so a checkpoint
written at one DP/TP size loads at any other (the plain optimizer's Adam moments are sharded like the parameters).
Saving is spread over the data-parallel ranks (`FullyParallelSaveStrategyWrapper`: each replica writes a share);
loading reads each tensor once per data-parallel group and exchanges it (`FullyParallelLoadStrategyWrapper`).
TransformerEngine's `_extra_state` objects (FP8 metadata we do not use, pickled BytesIO) are left out, so every
file loads with `torch.load(weights_only=True)`.

Not covered on CPU: the *distributed* optimizer's sharded state (its reload fails on gloo in megatron-core 0.16.1);
the trainer uses the plain optimizer, and resharding the distributed optimizer is a GPU check.

The async writer of `dist_checkpointing` starts a helper process with the `spawn` method, which re-imports the main
module: entry points must be guarded by `if __name__ == "__main__"` (trainingrun/__main__.py is).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from trainingrun.diskspace import no_space
from trainingrun.trainer import checkpoint as ckpt

_REASON_BYTES = 1024


class DistGroup:
    """`checkpoint.Collectives` over the default torch.distributed group (gloo on CPU, NCCL on GPU)."""

    def __init__(self) -> None:
        import torch.distributed as dist  # deferred: torch

        self.dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")

    def barrier(self) -> None:
        self.dist.barrier()

    def gather_reasons(self, reason: str | None) -> list[str | None]:
        # A [world, N] byte matrix, each rank filling its row, summed: no pickled objects cross the wire.
        table = torch.zeros(self.world, _REASON_BYTES + 1, dtype=torch.uint8, device=self.device)
        if reason is not None:
            data = reason.encode()[:_REASON_BYTES]
            table[self.rank, 0] = 1
            table[self.rank, 1:1 + len(data)] = torch.tensor(list(data), dtype=torch.uint8, device=self.device)
        self.dist.all_reduce(table)
        out: list[str | None] = []
        for row in table.cpu().tolist():
            out.append(bytes(b for b in row[1:] if b).decode(errors="replace") if row[0] else None)
        return out

    def broadcast_ints(self, values: list[int] | None) -> list[int]:
        n = torch.tensor([len(values) if values is not None else 0], dtype=torch.int64, device=self.device)
        self.dist.broadcast(n, 0)
        buf = torch.zeros(int(n.item()), dtype=torch.int64, device=self.device)
        if self.rank == 0 and values:
            buf.copy_(torch.tensor(values, dtype=torch.int64))
        if len(buf):
            self.dist.broadcast(buf, 0)
        return [int(x) for x in buf.cpu().tolist()]


def _without_extra_state(sharded: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sharded.items() if not k.endswith("_extra_state")}


def sharded_state(module, optimizer=None, *, is_loading: bool = False) -> dict[str, Any]:
    """The state dist_checkpointing writes/reads: the model's sharded state dict (+ the optimizer's)."""
    model_sd = _without_extra_state(module.sharded_state_dict())
    state = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    return state


def _strategies(load_dir: Path | None = None):
    from megatron.core import parallel_state  # deferred: megatron
    from megatron.core.dist_checkpointing.serialization import (  # deferred: megatron
        get_default_load_sharded_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (  # deferred: megatron
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )

    dp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if load_dir is None:
        return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), dp)
    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(load_dir)), dp)


class ShardsFailed(RuntimeError):
    """Megatron's checkpoint writer or reader failed. torch reports it as a `CheckpointException`, which derives
    from `BaseException` (it would pass every `except Exception` up to the interpreter, as a traceback); this carries
    it as the cause, and the errno of a rank's failure when one names it (a full volume: `diskspace`)."""

    def __init__(self, what: str, directory: Path, exc: BaseException):
        full = no_space(exc)
        self.errno = None if full is None else full.errno
        self.filename = str(directory)
        failures = getattr(exc, "failures", None) or {}
        why = "; ".join(f"rank {r}: {_first_line(f[0] if isinstance(f, tuple) else f)}" for r, f in failures.items())
        super().__init__(f"{directory}: {what} failed" + (f" ({why})" if why else " (on another rank)"))


def _first_line(exc: BaseException) -> str:
    text = f"{exc.__class__.__name__}: {exc}"
    return text.splitlines()[0][:300] if text else ""


def write_shards(module, optimizer, directory: Path) -> None:
    from megatron.core import dist_checkpointing  # deferred: megatron
    from torch.distributed.checkpoint.api import CheckpointException  # deferred: torch

    try:
        dist_checkpointing.save(sharded_state(module, optimizer), str(directory), sharded_strategy=_strategies())
    except CheckpointException as exc:
        raise ShardsFailed("writing the checkpoint shards", directory, exc) from exc


def load_shards(module, optimizer, directory: Path) -> None:
    """Load model and optimizer from a dist directory into `module`/`optimizer` (strict for the model)."""
    from megatron.core import dist_checkpointing  # deferred: megatron
    from torch.distributed.checkpoint.api import CheckpointException  # deferred: torch

    try:
        loaded = dist_checkpointing.load(sharded_state(module, optimizer, is_loading=True), str(directory),
                                         sharded_strategy=_strategies(directory))
    except CheckpointException as exc:
        raise ShardsFailed("reading the checkpoint shards", directory, exc) from exc
    missing, unexpected = module.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"the model does not match the checkpoint (missing {missing[:5]}, unexpected {unexpected[:5]})")
    optimizer.load_state_dict(loaded["optimizer"])


@dataclass
class TrainerCheckpoints:
    """The trainer's view: resume at start, save every `interval` steps (see `checkpoint.py` for the protocol)."""

    root: Path
    module: Any  # the GPTModel (ddp.module)
    optimizer: Any
    scheduler: Any
    attempt: int
    meta: dict[str, Any]  # run, data/tensor-parallel sizes, model spec: written to meta.json
    keep: int
    log: Callable[[str], None] = print
    assets: Callable[[Path], None] | None = None  # rank 0 adds files to each checkpoint (checkpoint.save)
    epoch: int = 0  # the run's creation time (TRAININGRUN_RUN_EPOCH): orders attempts across re-created runs

    def __post_init__(self) -> None:
        try:  # Megatron's checkpoint writer needs it (and megatron-core does not declare it): say so before training
            import psutil  # noqa: F401
        except ImportError:
            raise ckpt.CheckpointError("the psutil package is not installed: Megatron's distributed checkpointing "
                                       "needs it (pip install psutil; it is in trainingrun's train extra)") from None
        self.group = DistGroup()

    def resume(self) -> ckpt.Resumed | None:
        """Restore from the newest loadable checkpoint (None: there is none). CheckpointError: none loads."""
        t0 = time.perf_counter()
        resumed = ckpt.resume(
            self.root, group=self.group, attempt=self.attempt, log=self.log, epoch=self.epoch,
            load_shards=lambda d: load_shards(self.module, self.optimizer, d),
        )
        if resumed is None:
            return None
        self.scheduler.load_state_dict(resumed.state["scheduler"])
        ckpt.set_rng_state(resumed.state["rng"])
        was = resumed.meta
        now = self.meta
        sizes = ("dp_size", "tp_size", "pp_size")  # a checkpoint from before pipeline parallelism has no pp_size: 1
        then, here = ([d.get(k, 1 if k == "pp_size" else None) for k in sizes] for d in (was, now))
        if then != here:
            self.log(f"resharded {resumed.path.name}: written at data-parallel {then[0]} / tensor-parallel {then[1]} "
                     f"/ pipeline-parallel {then[2]}, loaded at {here[0]} / {here[1]} / {here[2]}")
        self.log(f"loaded {resumed.path} in {time.perf_counter() - t0:.2f}s")
        return resumed

    def save(self, progress: ckpt.TrainingProgress) -> ckpt.SaveResult:
        return ckpt.save(
            self.root, progress, group=self.group, attempt=self.attempt, keep=self.keep, meta=self.meta,
            assets=self.assets, epoch=self.epoch,
            write_shards=lambda d: write_shards(self.module, self.optimizer, d),
            state=lambda: {"scheduler": self.scheduler.state_dict(), "rng": ckpt.rng_state()},
        )
