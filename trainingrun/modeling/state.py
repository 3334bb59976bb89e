"""A live model's weights as plain tensors and arrays: what the trainers publish and the engines load.

* `tensors_arrays` / `arrays_state_dict`: a state dict as numpy arrays and back (bf16 travels as its raw 16 bits) —
  the `weightSync.type: store` wire form, written by the trainers' `StoreWeightPublisher` (a bucket of the streamed
  gather at a time, `modeling.stream`) and loaded by the rollout's in-process Megatron engine; `state_dict_arrays` the same of a module's own state dict.
* `gather_live_state`: the full canonical Megatron state dict of a live model — tensor-parallel shards gathered,
  experts gathered over the expert-parallel group, pipeline stages joined — on the first rank of one whole copy of
  the model: what every publisher sends (they stream it bucket by bucket, `modeling.stream`, bit-exact with this
  gather). With LoRA adapters they are merged into their layers' weights first
  (`modeling.lora.live_state_dict`); `merge=False` gives the frozen base alone (a LoRA run's store publisher sends
  it once, streamed, then adapters only). The ranks taking part are the TP × EP × PP ranks of (expert-)data-parallel replica
  0; `live_layout` says where this rank sits.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from trainingrun.modeling import convert, pipeline
from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.lora import live_state_dict


def state_dict_arrays(module: torch.nn.Module) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """`tensors_arrays` of a module's own state dict."""
    return tensors_arrays(live_state_dict(module))


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
    """Where this rank sits for `gather_live_state` (its keyword arguments) and the publishers: the tensor-,
    pipeline- and expert-parallel groups with this rank's size and rank in each, and dp_rank — its data-parallel
    replica (with expert parallelism its expert-data-parallel one): only replica 0 gathers. From Megatron's parallel
    state; {} (one process: nothing to gather) where Megatron's model-parallel groups are not initialised."""
    from megatron.core import parallel_state as ps  # deferred: megatron (imported after the CPU shim)

    if not ps.model_parallel_is_initialized():
        return {}
    ep = ps.get_expert_model_parallel_world_size()
    return dict(tp_group=ps.get_tensor_model_parallel_group(), tp_size=ps.get_tensor_model_parallel_world_size(),
                tp_rank=ps.get_tensor_model_parallel_rank(), pp_group=ps.get_pipeline_model_parallel_group(),
                pp_size=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                ep_group=ps.get_expert_model_parallel_group() if ep > 1 else None, ep_size=ep,
                ep_rank=ps.get_expert_model_parallel_rank() if ep > 1 else 0,
                dp_rank=ps.get_expert_data_parallel_rank() if ep > 1 else ps.get_data_parallel_rank())


def gather_live_state(module: torch.nn.Module, arch: Architecture, *, tp_group=None, tp_size: int = 1,
                      tp_rank: int = 0, pp_group=None, pp_size: int = 1, pp_rank: int = 0, ep_group=None,
                      ep_size: int = 1, ep_rank: int = 0, merge: bool = True) -> dict[str, torch.Tensor] | None:
    """The full canonical Megatron state dict of a live model, on TP rank 0 / EP rank 0 of pipeline stage 0, None on
    the other ranks. Every rank of the tensor × expert × pipeline group must call it: within each stage an
    all-gather per tensor-parallel tensor (or, for a mixture of experts, which runs at TP 1, per expert tensor) in name
    order; then the first rank of every later stage sends its part to stage 0 (`pp_group`: the stages of this rank's
    position). Experts: each EP rank holds `local_experts` 0 … E/R − 1; gathered, they get their global numbers
    (`convert.ep_global_name`); stages are joined under the whole model's layer numbers (`modeling.pipeline.to_whole`).
    The tensors are detached copies on the model's device (CPU copies are the caller's choice). `merge=False`: a LoRA
    model's frozen base, its adapters left out (`lora.live_state_dict`)."""
    state = convert.canonical_names({k: v for k, v in live_state_dict(module, merge=merge).items()
                                     if isinstance(v, torch.Tensor)})
    if ep_size > 1:  # the experts: all-gathered, renamed to their global numbers
        stage = _gather(state, ep_group, ep_size, ep_rank, lambda n: convert.ep_layout(n) is not None,
                        lambda n, parts: {convert.ep_global_name(n, arch, r, ep_size): p for r, p in enumerate(parts)})
    elif tp_size > 1:
        stage = _gather(state, tp_group, tp_size, tp_rank, lambda n: convert.tp_layout(n, arch)[0] is not None,
                        lambda n, parts: {n: convert.gather_tp(n, parts, arch)})
    else:
        stage = {k: v.detach().clone() for k, v in state.items()}
    if stage is None or pp_size == 1:
        return stage
    stage = pipeline.to_whole(stage, arch, pp_rank, pp_size)
    if pp_rank != 0:
        _send_tensors(stage, dst=0, group=pp_group)
        return None
    device = next(iter(stage.values())).device
    for src in range(1, pp_size):
        stage.update(_recv_tensors(src=src, group=pp_group, device=device))
    return stage


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


# Tensors between pipeline stages, without pickle: a header of int64s (name bytes, then per tensor its dtype code,
# rank and shape), the names as UTF-8 bytes, then each tensor as it is.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.bool)


def _send_tensors(state: dict[str, torch.Tensor], *, dst: int, group) -> None:
    names = sorted(state)
    device = next(iter(state.values())).device if state else torch.device("cpu")
    blob = "\n".join(names).encode()
    header = [len(blob), len(names)]
    for name in names:
        t = state[name]
        header += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    dist.send(torch.tensor([len(header)], dtype=torch.int64, device=device), group=group, group_dst=dst)
    dist.send(torch.tensor(header, dtype=torch.int64, device=device), group=group, group_dst=dst)
    if blob:
        dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device), group=group, group_dst=dst)
    for name in names:
        dist.send(state[name].contiguous(), group=group, group_dst=dst)


def _recv_tensors(*, src: int, group, device: torch.device) -> dict[str, torch.Tensor]:
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, group=group, group_src=src)
    header = torch.empty(int(size.item()), dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=src)
    values = header.cpu().tolist()
    n_bytes, n_tensors = values[0], values[1]
    blob = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    if n_bytes:
        dist.recv(blob, group=group, group_src=src)
    names = blob.cpu().numpy().tobytes().decode().split("\n") if n_bytes else []
    if len(names) != n_tensors:
        raise ValueError(f"pipeline stage {src} sent {n_tensors} tensors but {len(names)} names")
    out: dict[str, torch.Tensor] = {}
    pos = 2
    for name in names:
        dtype, ndim = _DTYPES[values[pos]], values[pos + 1]
        shape = values[pos + 2:pos + 2 + ndim]
        pos += 2 + ndim
        out[name] = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out[name], group=group, group_src=src)
    return out
