"""A live model's weights as plain tensors and arrays: what the trainers publish and the engines load.

* `state_dict_arrays` / `arrays_state_dict`: a module's own state dict as numpy arrays and back (bf16 travels as
  its raw 16 bits) — the `weightSync.type: store` wire form, written by the trainers' `StoreWeightPublisher` and
  loaded by the rollout's in-process Megatron engine.
* `gather_live_state`: the full (tensor-parallel-gathered, pipeline stages joined) canonical Megatron state dict of a
  live model, on the model-parallel group's first rank — what the disk/broadcast publishers of the vLLM engine
  convert to Hugging Face names.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.distributed as dist

from trainingrun.modeling import convert, pipeline
from trainingrun.modeling.architecture import Architecture


def state_dict_arrays(module: torch.nn.Module) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(arrays, dtypes) of a module's state dict: numpy views (bf16 as uint16 bits), and each tensor's torch dtype
    name. TransformerEngine `_extra_state` blobs are not weights and are skipped."""
    arrays, dtypes = {}, {}
    for name, t in module.state_dict().items():
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
                      tp_rank: int = 0, pp_group=None, pp_size: int = 1,
                      pp_rank: int = 0) -> dict[str, torch.Tensor] | None:
    """The full canonical Megatron state dict of a live model — tensor-parallel shards gathered, pipeline stages
    joined under the whole model's layer numbers (`modeling.pipeline.to_whole`) — on TP rank 0 of pipeline stage 0,
    None on the other ranks. Every rank of the tensor × pipeline group must call it: an all-gather per
    tensor-parallel tensor in name order within each stage, then TP rank 0 of every later stage sends its part to
    stage 0 (`pp_group`: the stages of this rank's TP position). The tensors are detached copies on the model's
    device (CPU copies are the caller's choice)."""
    state = convert.canonical_names({k: v for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)})
    stage = _gather_tp(state, arch, tp_group, tp_size, tp_rank)
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


def _gather_tp(state: dict[str, torch.Tensor], arch: Architecture, tp_group, tp_size: int,
               tp_rank: int) -> dict[str, torch.Tensor] | None:
    """One stage's canonical state with its tensor-parallel shards gathered: on TP rank 0, None on the others."""
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
