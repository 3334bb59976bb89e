"""A live model's weights as plain tensors and arrays: what the trainers publish and the engines load.

* `state_dict_arrays` / `arrays_state_dict`: a module's own state dict as numpy arrays and back (bf16 travels as
  its raw 16 bits) — the `weightSync.type: store` wire form, written by the trainers' `StoreWeightPublisher` and
  loaded by the rollout's in-process Megatron engine.
* `gather_live_state`: the full (tensor-parallel- and expert-parallel-gathered) canonical Megatron state dict of a
  live model, on TP rank 0 / EP rank 0 — what the disk/broadcast publishers of the vLLM engine convert to Hugging
  Face names. The ranks taking part are one whole copy of the model: the TP × EP ranks of expert-data-parallel
  replica 0 (for a dense model: data-parallel replica 0).
"""

from __future__ import annotations

from collections.abc import Callable

import warnings

import numpy as np
import torch
import torch.distributed as dist

from trainingrun.modeling import convert
from trainingrun.modeling.architecture import Architecture


def state_dict_arrays(module: torch.nn.Module | dict[str, torch.Tensor]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(arrays, dtypes) of a module's state dict (or of a state dict, e.g. `gather_live_state`'s): numpy views (bf16 as
    uint16 bits), and each tensor's torch dtype name. TransformerEngine `_extra_state` blobs are not weights and are
    skipped."""
    arrays, dtypes = {}, {}
    state = module if isinstance(module, dict) else module.state_dict()
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


def gather_live_state(module: torch.nn.Module, arch: Architecture, *, tp_group=None, tp_size: int = 1,
                      tp_rank: int = 0, ep_group=None, ep_size: int = 1,
                      ep_rank: int = 0) -> dict[str, torch.Tensor] | None:
    """The full canonical Megatron state dict of a live model: on TP rank 0 of `tp_group` and EP rank 0 of
    `ep_group`, None on the others. Every rank of both groups must call it (a collective per tensor-parallel tensor
    and per expert tensor, in name order). The tensors are detached copies on the model's device (CPU copies are the
    caller's choice). Experts: each EP rank holds `local_experts` 0 … E/R − 1; all-gathered, they get their global
    numbers (`convert.ep_global_name`); a mixture of experts runs at TP 1 (`architecture.check_parallel`)."""
    state = convert.canonical_names({k: v for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)})
    if ep_size > 1:  # the experts: all-gathered, renamed to their global numbers
        return _gather(state, ep_group, ep_size, ep_rank, lambda n: convert.ep_layout(n) is not None,
                       lambda n, parts: {convert.ep_global_name(n, arch, r, ep_size): p for r, p in enumerate(parts)})
    if tp_size == 1:
        return {k: v.detach().clone() for k, v in state.items()}
    return _gather(state, tp_group, tp_size, tp_rank, lambda n: convert.tp_layout(n, arch)[0] is not None,
                   lambda n, parts: {n: convert.gather_tp(n, parts, arch)})


def _gather(state: dict[str, torch.Tensor], group, size: int, rank: int, split: Callable[[str], bool],
            merge: Callable[[str, list[torch.Tensor]], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """Every tensor of `state` on rank 0 of `group`: those `split` names all-gathered (in name order, a collective
    per tensor) and `merge`d into full tensors, the others (replicated over the group) copied; None on the others."""
    out: dict[str, torch.Tensor] = {}
    for name in sorted(state):
        local = state[name].detach().contiguous()
        if not split(name):
            if rank == 0:
                out[name] = local.clone()
            continue
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local, group=group)
        if rank == 0:
            out.update(merge(name, parts))
    return out if rank == 0 else None
