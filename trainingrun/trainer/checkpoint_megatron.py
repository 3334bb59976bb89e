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

A LoRA run (`spec.trainer.lora`: the model has adapters) writes the adapters only — their tensors, their scale
buffers and their optimizer state — not the frozen base, which does not change: meta.json names the base and its
digest instead (`modeling.lora_base`; `TrainerCheckpoints.base`), loading takes the base from the model as built
(model.hf or the seed) and refuses a checkpoint whose base digest is not this run's, naming the field. A LoRA
checkpoint written before this (with the base) loads too: only its adapters are read.

Every rank also writes its RNG streams (CPU, CUDA, Megatron's tensor-parallel tracker) beside the shards, in rng/
(`trainer.rng`); a resume at the same layout takes each rank's back (a resume with dropout is exact), another
layout seeds fresh ones and says so.

The distributed optimizer (`trainer.optimizer.distributed`) writes its state in Megatron's `dp_reshardable` format
(each rank's shards of the main parameters and Adam moments, no gather): it loads at any data-parallel size, not at
another tensor-parallel size (`resume` refuses that, and a switch between the plain and the distributed optimizer,
by name). Over torch's own Adam (no apex or TransformerEngine: a CPU, or a GPU image without them) megatron-core
0.16.1 cannot load it into a fresh optimizer as it stands — `state_dict()` asserts on the empty state, the loaded
moments are copied into leaf views outside `no_grad`, and Adam's step stays the fresh one — so `load_shards` gives
the fresh optimizer an Adam state of zeros first, loads under `torch.no_grad()` and sets the step the checkpoint
recorded (`_DistributedAdamLoad`).

Saves are synchronous. megatron-core's file writer hands the write results of its forked writer processes back to
the saving process through a queue that, on first use, it creates in a multiprocessing Manager started with
`spawn`: a fresh interpreter that imports the main module again (entry points must be guarded by
`if __name__ == "__main__"`; trainingrun/__main__.py is) and must import torch to unpickle the results — about 4 s
of CPU on every rank's first checkpoint in every trainer process (measured on 2 CPU cores: the first save 4.5 s,
the next ones 0.3 s). A synchronous save puts and takes those results in this process, so `write_shards` gives the
writer an in-process queue instead (`_in_process_results_queue`); an async save would need the Manager's.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from trainingrun.diskspace import no_space
from trainingrun.modeling.lora import ADAPTER, LoRAAdapter
from trainingrun.modeling.lora_base import base_problem
from trainingrun.trainer import checkpoint as ckpt
from trainingrun.trainer import rng

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


# The distributed optimizer's checkpoint format (module docstring): what Megatron's `metadata` argument names it.
DISTRIBUTED_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}


def is_distributed(optimizer) -> bool:
    """Whether `optimizer` is Megatron's distributed optimizer (alone or in its ChainedOptimizer)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # deferred: megatron

    return any(isinstance(o, DistributedOptimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def has_adapters(module) -> bool:
    """Whether `module` carries LoRA adapters (its base frozen: `modeling.lora.apply_lora`)."""
    return any(isinstance(m, LoRAAdapter) for m in module.modules())


def _adapters_only(sharded: dict[str, Any]) -> dict[str, Any]:
    marker = f".{ADAPTER}."
    return {k: v for k, v in sharded.items() if marker in k}


def sharded_state(module, optimizer=None, *, is_loading: bool = False) -> dict[str, Any]:
    """The state dist_checkpointing writes/reads: the model's sharded state dict (+ the optimizer's); of a LoRA
    model its adapters only (module docstring)."""
    model_sd = _without_extra_state(module.sharded_state_dict())
    if has_adapters(module):
        model_sd = _adapters_only(model_sd)
    state = {"model": model_sd}
    if optimizer is not None:
        extra = {"metadata": DISTRIBUTED_OPTIMIZER_FORMAT} if is_distributed(optimizer) else {}
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, **extra)
    return state


class _DistributedAdamLoad:
    """The distributed optimizer over torch's own Adam, loaded as the module docstring says (a no-op for the plain
    optimizer and for apex's or TransformerEngine's fused Adam, which keep the step in their parameter groups)."""

    def __init__(self, optimizer) -> None:
        self.inner = []
        if is_distributed(optimizer):
            self.inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])
                          if isinstance(o.optimizer, torch.optim.Adam | torch.optim.AdamW)]

    def before(self) -> None:
        for adam in self.inner:
            if not adam.state:
                for group in adam.param_groups:
                    for p in group["params"]:
                        adam.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                         "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def after(self, loaded_optimizer: dict[str, Any]) -> None:
        if not self.inner:
            return
        steps = {float(g["step"]) for g in loaded_optimizer["optimizer"]["param_groups"] if "step" in g}
        if len(steps) != 1:
            raise ValueError(f"the distributed optimizer's checkpoint records Adam steps {sorted(steps)}; one expected")
        step = steps.pop()
        for adam in self.inner:
            for state in adam.state.values():
                state["step"] = torch.tensor(step, dtype=torch.float32)


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


def _in_process_results_queue() -> bool:
    """Give megatron-core's file writer an in-process results queue before its first synchronous save (module
    docstring); False when this megatron-core has no such queue (nothing changed)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async  # deferred: megatron

    if not hasattr(filesystem_async, "_results_queue"):
        return False
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    return True


def write_shards(module, optimizer, directory: Path) -> None:
    from megatron.core import dist_checkpointing  # deferred: megatron
    from torch.distributed.checkpoint.api import CheckpointException  # deferred: torch

    _in_process_results_queue()
    try:
        dist_checkpointing.save(sharded_state(module, optimizer), str(directory), sharded_strategy=_strategies())
    except CheckpointException as exc:
        raise ShardsFailed("writing the checkpoint shards", directory, exc) from exc


def load_shards(module, optimizer, directory: Path) -> None:
    """Load model and optimizer from a dist directory into `module`/`optimizer` (strict for the model)."""
    from megatron.core import dist_checkpointing  # deferred: megatron
    from torch.distributed.checkpoint.api import CheckpointException  # deferred: torch

    adam = _DistributedAdamLoad(optimizer)
    adam.before()
    try:
        loaded = dist_checkpointing.load(sharded_state(module, optimizer, is_loading=True), str(directory),
                                         sharded_strategy=_strategies(directory))
    except CheckpointException as exc:
        raise ShardsFailed("reading the checkpoint shards", directory, exc) from exc
    missing, unexpected = module.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if has_adapters(module):  # the frozen base is the model's own (model.hf or the seed), checked by its digest
        missing = [k for k in missing if f".{ADAPTER}." in k]
    if missing or unexpected:
        raise ValueError(f"the model does not match the checkpoint (missing {missing[:5]}, unexpected {unexpected[:5]})")
    with torch.no_grad():  # the distributed optimizer copies into views of the (leaf) parameters
        optimizer.load_state_dict(loaded["optimizer"])
    adam.after(loaded["optimizer"])


def optimizer_format_problem(root: Path, meta: dict[str, Any]) -> str | None:
    """Why the newest checkpoint under `root` cannot load into the optimizer `meta` describes (None: it can, or
    there is none): plain ↔ distributed, or the distributed optimizer's state at another tensor-parallel size. Said
    before anything loads: a restart with the checkpoints' settings resumes, so nothing is set aside as unloadable."""
    complete = ckpt.complete_checkpoints(root)
    if not complete:
        return None
    try:
        was = ckpt.read_meta(complete[-1])
    except (OSError, ValueError):
        return None  # a damaged record: the checkpoint's verification says so
    kind, now = was.get("optimizer", "plain"), meta["optimizer"]
    if kind != now:
        return (f"checkpoint {complete[-1]} holds the {kind} optimizer's state and this run uses the {now} one "
                f"(trainer.optimizer.distributed {str(now == 'distributed').lower()}): the two store it differently; "
                f"allowed: trainer.optimizer.distributed {str(kind == 'distributed').lower()}, as it was written")
    if now == "distributed" and was.get("tp_size") != meta.get("tp_size"):
        return (f"checkpoint {complete[-1]} holds the distributed optimizer's state at tensor-parallel "
                f"{was.get('tp_size')}: it loads at any data-parallel size, not at tensor-parallel "
                f"{meta.get('tp_size')}; allowed: trainer.tensorParallelSize {was.get('tp_size')}")
    if now == "distributed" and was.get("pp_size", 1) != meta.get("pp_size", 1):  # its shards are per stage too
        return (f"checkpoint {complete[-1]} holds the distributed optimizer's state at pipeline-parallel "
                f"{was.get('pp_size', 1)}: it loads at any data-parallel size, not at pipeline-parallel "
                f"{meta.get('pp_size', 1)}; allowed: trainer.pipelineParallelSize {was.get('pp_size', 1)}")
    return None


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
    base: Callable[[], dict[str, Any]] | None = None  # LoRA: the base's reference and digest (`modeling.lora_base`)
    seed: int = 0  # spec.seed: the fresh RNG streams of a resume that cannot take the saved ones back (`rng`)

    def __post_init__(self) -> None:
        try:  # Megatron's checkpoint writer needs it (and megatron-core does not declare it): say so before training
            import psutil  # noqa: F401
        except ImportError:
            raise ckpt.CheckpointError("the psutil package is not installed: Megatron's distributed checkpointing "
                                       "needs it (pip install psutil; it is in trainingrun's train extra)") from None
        self.group = DistGroup()
        self.meta = {**self.meta, "optimizer": "distributed" if is_distributed(self.optimizer) else "plain"}
        self._base: dict[str, Any] | None = None

    def base_reference(self) -> dict[str, Any] | None:
        """The base's reference and digest (rank 0 computes it once; None on the others and without LoRA)."""
        if self.base is None or self.group.rank != 0:
            return None
        if self._base is None:
            t0 = time.perf_counter()
            self._base = self.base()
            self.log(f"lora: base {self._base['digest']} ({self._base['source']}) in {time.perf_counter() - t0:.2f}s")
        return self._base

    def base_check(self) -> str | None:
        """Rank 0: why the newest checkpoint's adapters do not belong to this run's base (`lora_base.base_problem`)."""
        complete = ckpt.complete_checkpoints(self.root)
        if self.base is None or self.group.rank != 0 or not complete:
            return None
        try:
            was = ckpt.read_meta(complete[-1]).get("base")
        except (OSError, ValueError):
            return None  # a damaged record: the checkpoint's verification says so
        return base_problem(was if isinstance(was, dict) else None, self.base_reference(), str(complete[-1]))

    def resume(self) -> ckpt.Resumed | None:
        """Restore from the newest loadable checkpoint (None: there is none). CheckpointError: none loads, or its
        optimizer state does not fit this optimizer (`optimizer_format_problem`)."""
        t0 = time.perf_counter()
        problem = optimizer_format_problem(self.root, self.meta)
        if problem:
            raise ckpt.CheckpointError(problem)
        if self.base is not None:  # LoRA: the adapters must belong to this run's base; every rank refuses alike
            for reason in self.group.gather_reasons(self.base_check()):
                if reason is not None:
                    raise ckpt.CheckpointError(reason)
        resumed = ckpt.resume(
            self.root, group=self.group, attempt=self.attempt, log=self.log, epoch=self.epoch,
            load_shards=lambda d: load_shards(self.module, self.optimizer, d),
        )
        if resumed is None:
            return None
        self.scheduler.load_state_dict(resumed.state["scheduler"])
        was = resumed.meta
        now = self.meta
        # each rank's own streams when the layout is the same; else fresh ones, warned (`rng`)
        rng.restore(resumed.path, was, now, seed=self.seed, step=resumed.progress.global_step, log=self.log)
        sizes = ("dp_size", "tp_size", "pp_size")  # a checkpoint from before pipeline parallelism has no pp_size: 1
        then, here = ([d.get(k, 1 if k == "pp_size" else None) for k in sizes] for d in (was, now))
        if then != here:
            self.log(f"resharded {resumed.path.name}: written at data-parallel {then[0]} / tensor-parallel {then[1]} "
                     f"/ pipeline-parallel {then[2]}, loaded at {here[0]} / {here[1]} / {here[2]}")
        self.log(f"loaded {resumed.path} in {time.perf_counter() - t0:.2f}s")
        return resumed

    def save(self, progress: ckpt.TrainingProgress) -> ckpt.SaveResult:
        base = self.base_reference()
        return ckpt.save(
            self.root, progress, group=self.group, attempt=self.attempt, keep=self.keep,
            meta=self.meta if base is None else {**self.meta, "base": base},
            assets=self.assets, epoch=self.epoch,
            write_shards=lambda d: self._write(d),
            state=lambda: {"scheduler": self.scheduler.state_dict(), "rng": ckpt.rng_state()},
        )

    def _write(self, dist_dir: Path) -> None:
        """Every rank: its model/optimizer shards into dist/, its RNG streams into rng/ (`rng`; hashed with the rest)."""
        write_shards(self.module, self.optimizer, dist_dir)
        rng.write(dist_dir.parent / rng.RNG_DIR)
