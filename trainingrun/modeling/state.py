"""A live model's weights as plain tensors and arrays: what the trainers publish and the engines load.

* `tensors_arrays` / `arrays_state_dict`: a state dict as numpy arrays and back (bf16 travels as its raw 16 bits) —
  the `weightSync.type: store` wire form, written by the trainers' `StoreWeightPublisher` (of `gather_live_state`)
  and loaded by the rollout's in-process Megatron engine; `state_dict_arrays` the same of a module's own state dict.
* `gather_live_state`: the full (tensor-parallel-gathered) canonical Megatron state dict of a live model, on TP rank
  0 — what every publisher sends: the store publisher as arrays, the vLLM disk/broadcast publishers converted to
  Hugging Face names.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.distributed as dist

from trainingrun.modeling import convert
from trainingrun.modeling.architecture import Architecture


def state_dict_arrays(module: torch.nn.Module) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """`tensors_arrays` of a module's own state dict."""
    return tensors_arrays(module.state_dict())


def tensors_arrays(state: dict[str, torch.Tensor]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(arrays, dtypes) of a state dict: numpy views (bf16 as uint16 bits), and each tensor's torch dtype name.
    TransformerEngine `_extra_state` blobs are not weights and are skipped."""
    arrays, dtypes = {}, {}
    for name, t in state.items():
        if name.endswith("_extra_state") or not isinstance(t, torch.Tensor):
            continue
        t = t.detach().cpu().contiguous()
        dtypes[name] = str(t.dtype).removeprefix("torch.")
        arrays[name] = (t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy())
    return arrays, dtypes


def arrays_state_dict(arrays: dict[str, np.ndarray], dtypes: dict[str, str]) -> dict[str, torch.Tensor]:
    """Inverse of `state_dict_arrays`: tensors that share the arrays' memory (often a read-only memory map of the
    stored version), for one `load_state_dict`, which copies them into the parameters and never writes to them."""
    out = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, arr in arrays.items():
            kind = dtypes.get(name, str(arr.dtype))
            if kind == "bfloat16":
                out[name] = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
            else:
                out[name] = torch.from_numpy(arr)
    return out


def live_layout() -> dict:
    """Where this rank sits for `gather_live_state`: tp_group, tp_size, tp_rank, dp_rank from Megatron's parallel
    state (initialised)."""
    from megatron.core import parallel_state as ps  # deferred: megatron (imported after the CPU shim)

    return dict(tp_group=ps.get_tensor_model_parallel_group(), tp_size=ps.get_tensor_model_parallel_world_size(),
                tp_rank=ps.get_tensor_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank())


def gather_live_state(module: torch.nn.Module, arch: Architecture, *, tp_group=None, tp_size: int = 1,
                      tp_rank: int = 0) -> dict[str, torch.Tensor] | None:
    """The full (TP-gathered) canonical Megatron state dict of a live model: on TP rank 0 of `tp_group`, None on the
    others. Every rank of the group must call it (a collective per tensor-parallel tensor, in name order). The
    tensors are detached copies on the model's device (CPU copies are the caller's choice)."""
    state = convert.canonical_names({k: v for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)})
    if tp_size == 1:
        return {k: v.detach().clone() for k, v in state.items()}
    out: dict[str, torch.Tensor] = {}
    for name in sorted(state):
        local = state[name].detach().contiguous()
        dim, _ = convert.tp_layout(name, arch)
        if dim is None:
            if tp_rank == 0:
                out[name] = local.clone()
            continue
        shards = [torch.empty_like(local) for _ in range(tp_size)]
        dist.all_gather(shards, local, group=tp_group)
        if tp_rank == 0:
            out[name] = convert.gather_tp(name, shards, arch)
    return out if tp_rank == 0 else None
