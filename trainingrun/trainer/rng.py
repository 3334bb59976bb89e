"""Each trainer rank's random-number streams in a checkpoint, so that a resume with dropout is exact.

What draws random numbers while training is dropout (`spec.trainer.lora.dropout`; the model itself has none): on
the default generator (the CUDA one on a GPU, the CPU one here — the CPU shim makes Megatron's "CUDA" RNG the CPU
generator) and under Megatron's tensor-parallel RNG tracker (`tensor_parallel.get_cuda_rng_tracker()`: a stream per
tensor-/expert-parallel rank, swapped in by `fork()`). The streams differ per rank — data-parallel ranks draw masks
for other micro-batches, tensor-parallel ranks for other shards — so each rank saves its own, as Megatron's
checkpointing does with its `rng_state`:

  step_*/rng/pp<P>-tp<T>-ep<E>-dp<D>.safetensors     one per rank (P, T, E, D: its pipeline/tensor/expert/data-
                                                     parallel ranks); uint8 tensors, no pickle:
      torch              the CPU generator's state (`torch.get_rng_state()`)
      cuda               the current device's CUDA generator (on a GPU only)
      tracker/<name>     each RNG tracker stream (`get_states()`: model-parallel-rng, expert-parallel-rng, ...)

The files are written by every rank beside the shards (`write`, inside the save's shard phase), listed and hashed in
COMPLETE like every other file, so a resume verifies them before anything loads.

`restore` at resume: written at this run's layout (the same data/tensor/pipeline/expert-parallel sizes) each rank
takes its own file back, and the resumed steps draw the uninterrupted run's dropout masks. Otherwise — a resharded
resume (the old ranks' streams have no counterpart), or a checkpoint written before these files — every rank starts
fresh streams seeded from (spec.seed, the checkpoint's step) exactly as a new run seeds its own (`reseed`), and
rank 0 logs a warning: the run is reproducible (the same resume draws the same masks) but with dropout > 0 not the
uninterrupted run (at dropout 0 nothing draws, and the resume is exact either way).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch

RNG_DIR = "rng"
_TRACKER = "tracker/"
SIZES = ("dp_size", "tp_size", "pp_size", "ep_size")


def rank_key() -> str:
    """This rank's file name stem: its pipeline-, tensor-, expert- and data-parallel ranks."""
    from megatron.core import parallel_state as ps  # deferred: megatron

    return (f"pp{ps.get_pipeline_model_parallel_rank()}-tp{ps.get_tensor_model_parallel_rank()}-"
            f"ep{ps.get_expert_model_parallel_rank()}-dp{ps.get_data_parallel_rank()}")


def _tracker():
    from megatron.core import tensor_parallel  # deferred: megatron

    return tensor_parallel.get_cuda_rng_tracker()


def capture() -> dict[str, torch.Tensor]:
    """This process's streams as uint8 tensors (module docstring)."""
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    for name, state in _tracker().get_states().items():
        if not isinstance(state, torch.Tensor):  # a cudagraph-safe tracker keeps generators: not used here
            raise TypeError(f"RNG tracker stream {name} is a {type(state).__name__}, not a state tensor")
        out[_TRACKER + name] = state
    return {k: v.detach().to("cpu", torch.uint8).contiguous().clone() for k, v in out.items()}


def apply(states: dict[str, torch.Tensor]) -> None:
    """Set this process's streams to `states` (as `capture` gave them)."""
    torch.set_rng_state(states["torch"].clone())
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"].clone())
    tracker = {k[len(_TRACKER):]: v.clone() for k, v in states.items() if k.startswith(_TRACKER)}
    if tracker:
        _tracker().set_states(tracker)


def write(directory: Path) -> Path:
    """Write this rank's streams into `directory`/<rank key>.safetensors (every rank; `directory` is created)."""
    from safetensors.torch import save_file  # deferred: safetensors

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{rank_key()}.safetensors"
    save_file(capture(), str(path), metadata={"rank": rank_key()})
    return path


def read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file  # deferred: safetensors

    states = load_file(str(path))
    if "torch" not in states or any(t.dtype != torch.uint8 for t in states.values()):
        raise ValueError(f"{path}: not an RNG state file (uint8 tensors with a 'torch' entry)")
    return states


def stream_seed(seed: int, step: int) -> int:
    """The seed of the fresh streams a resume at `step` starts when the saved ones cannot be taken back."""
    return int(np.random.SeedSequence([int(seed), int(step), 0x52A6]).generate_state(1)[0])


def reseed(seed: int) -> None:
    """Fresh streams from `seed`, as a new run seeds them (`modeling.model.set_seed`)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # deferred: megatron

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def restore(checkpoint: Path, was: dict, now: dict, *, seed: int, step: int, log: Callable[[str], None]) -> bool:
    """Take this rank's streams back from `checkpoint` when it was written at this layout (True); else seed fresh
    ones from (`seed`, `step`) and log why (False). `was`/`now`: the checkpoint's and this run's meta.json."""
    then = [was.get(k, 1 if k in ("pp_size", "ep_size") else None) for k in SIZES]
    here = [now.get(k, 1 if k in ("pp_size", "ep_size") else None) for k in SIZES]
    path = checkpoint / RNG_DIR / f"{rank_key()}.safetensors"
    if then == here and path.is_file():
        apply(read(path))
        return True
    why = (f"written at data/tensor/pipeline/expert-parallel {'/'.join(map(str, then))}, resumed at "
           f"{'/'.join(map(str, here))}" if then != here else "it holds no per-rank RNG streams (written before them)")
    reseed(stream_seed(seed, step))
    log(f"warning: {checkpoint.name}: {why}; every rank's RNG streams are seeded afresh from spec.seed and step "
        f"{step}: with dropout > 0 (trainer.lora.dropout) the resumed steps draw other dropout masks than an "
        "uninterrupted run (reproducibly), so their losses are not the uninterrupted run's")
    return False
