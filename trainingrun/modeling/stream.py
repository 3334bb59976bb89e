"""The streamed gather of a live model's weights (issue 28 item 1): bucket by bucket, as `modeling/sync_plan.py`
plans it, instead of the whole model at once (`state.gather_live_state`).

`iter_live_buckets` yields, on TP rank 0 (EP rank 0) of pipeline stage 0, dicts of canonical Megatron names (the
whole model's layer numbers) → full tensors, each at most one bucket (a single larger tensor alone), in the same
tensors and values `gather_live_state` returns (bit-exact; tested at TP 2, PP 2 and EP 2 in
tests/integration/test_sync_stream.py); the other ranks yield nothing but must run the generator to its end (they take
part in each bucket's collectives). Each bucket's memory is the consumer's to drop before the next: no process holds
more than its shard plus the bucket being gathered and the one being consumed.

Within a stage, the bucket's tensor-parallel tensors are all-gathered (one collective per tensor, in name order), the
replicated ones read from TP rank 0. With expert parallelism (a mixture of experts runs at TP 1) the experts are
all-gathered over the EP ranks instead, each rank's local experts renamed to their global numbers
(`convert.ep_global_name`), as `gather_live_state` does. Later stages' first rank send their buckets to stage 0, one
after another, an empty message closing each stage. The disk and broadcast publishers (`engines/vllm/publish.py`)
consume it sharded (`shard=True`, `shard_owner`), and so does the store publisher (`engines/store_sync.py`: each
owner's buckets become parts of the version in the store): every (stage, TP/EP rank) of the replica yields the
buckets it owns and nothing goes to stage 0, so no rank holds more than its own stage's part. With `adapters=True` the
same loop gathers the LoRA adapters alone (B of a column-parallel layer concatenated over the TP ranks along its
rows, A of a row-parallel one along its columns; the rest replicated; under expert parallelism the experts' adapters
gathered over the EP ranks and renamed to their global experts, as the experts' weights): the adapters-only sync of a
LoRA run (`AdapterPublisher`, and the store publisher's later versions).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from trainingrun.modeling import convert, pipeline
from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.lora import adapter_state, live_state_dict
from trainingrun.modeling.state import _recv_tensors, _send_tensors
from trainingrun.modeling.sync_plan import assign_owners, plan_buckets


def world_int(value: int, op: str = "broadcast") -> int:
    """A publisher's decision shared by every trainer rank: `value` broadcast from trainer rank 0 (`op` "broadcast")
    or summed over every rank ("sum"). A collective of the whole world (every rank calls it) on an int tensor —
    nothing pickled; `value` itself in one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return int(value)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    box = torch.tensor([int(value)], dtype=torch.int64, device=device)
    if op == "broadcast":
        dist.broadcast(box, src=0)
    elif op == "sum":
        dist.all_reduce(box)
    else:
        raise ValueError(f"world_int: op {op!r} (allowed: broadcast, sum)")
    return int(box.item())


def shard_owner(*, tp_size: int = 1, tp_rank: int = 0, pp_size: int = 1, pp_rank: int = 0, ep_size: int = 1,
                ep_rank: int = 0, **_ignored) -> tuple[int, int]:
    """(this rank's owner index, the number of owners) of `iter_live_buckets(shard=True)`: every (stage, TP or EP
    rank) of a replica owns part of the buckets — each stage keeps the buckets of its own layers; owner 0 is TP/EP
    rank 0 of stage 0, owner s × size + r rank r of stage s (the global ranks' order within replica 0)."""
    size, rank = (ep_size, ep_rank) if ep_size > 1 else (tp_size, tp_rank)
    return pp_rank * size + rank, pp_size * size


def _local_state(module: torch.nn.Module, adapters: bool,
                 merge: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, int | None]]:
    """(this rank's canonical state — the merged weights (`merge=False`: a LoRA model's frozen base alone), or with
    `adapters` the adapters alone —, each adapter's tensor-parallel split dimension: `lora.adapter_state`; empty for
    the weights)."""
    if not adapters:
        live = live_state_dict(module, merge=merge)
        return convert.canonical_names({k: v for k, v in live.items() if isinstance(v, torch.Tensor)}), {}
    local = adapter_state(module)
    return (convert.canonical_names({k: v for k, (v, _) in local.items()}),
            {convert.canonical_name(k): d for k, (_, d) in local.items()})


def iter_live_buckets(module: torch.nn.Module, arch: Architecture, limit: int, *, tp_group=None, tp_size: int = 1,
                      tp_rank: int = 0, pp_group=None, pp_size: int = 1, pp_rank: int = 0, ep_group=None,
                      ep_size: int = 1, ep_rank: int = 0, adapters: bool = False, shard: bool = False,
                      merge: bool = True, **_ignored) -> Iterator[dict[str, torch.Tensor]]:
    """Buckets of at most `limit` bytes of the full canonical state (see the module docstring); with `adapters`,
    of the LoRA adapters alone (`lora.adapter_state`), unmerged; `merge=False`: a LoRA model's frozen base alone
    (`gather_live_state(merge=False)`). With `shard`, every rank yields the buckets it owns
    instead (`shard_owner`): each bucket of a stage is assembled on one TP (EP) rank of the stage
    (`sync_plan.assign_owners`, balanced by bytes) — the all-gather gave every rank the parts — and each stage keeps
    its own (nothing is sent to stage 0); the owners' buckets together are the whole state, each tensor once (the
    broadcast's sharded snapshots, `engines/vllm/broadcast.py`; the disk sync's parallel writers)."""
    state, dims = _local_state(module, adapters, merge)
    if adapters and ep_size == 1:  # every adapter split (or not) over TP
        group, size, rank = tp_group, tp_size, tp_rank
        split = {n: tp_size > 1 and dims[n] is not None for n in state}

        def join(name: str, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
            return {name: torch.cat(parts, dim=dims[name])}
    elif ep_size > 1:  # a mixture of experts runs at TP 1: the experts (and their adapters) are split over EP
        group, size, rank = ep_group, ep_size, ep_rank
        split = {n: convert.ep_layout(n) is not None for n in state}

        def join(name: str, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
            return {convert.ep_global_name(name, arch, r, ep_size): p for r, p in enumerate(parts)}
    else:
        group, size, rank = tp_group, tp_size, tp_rank
        split = {n: tp_size > 1 and convert.tp_layout(n, arch)[0] is not None for n in state}

        def join(name: str, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
            return {name: convert.gather_tp(name, parts, arch)}
    lead = rank == 0  # the stage's rank that assembles the buckets (TP rank 0, or EP rank 0)
    sizes = [(n, state[n].numel() * state[n].element_size() * (size if split[n] else 1)) for n in sorted(state)]
    plan = plan_buckets(sizes, limit)
    owner = assign_owners([b.nbytes for b in plan], size) if shard else None  # the same on every rank
    for k, names in enumerate(b.names for b in plan):
        mine = owner[k] == rank if owner is not None else lead
        bucket: dict[str, torch.Tensor] = {}
        for name in names:
            local = state[name].detach().contiguous()
            if split[name]:
                parts = [torch.empty_like(local) for _ in range(size)]
                dist.all_gather(parts, local, group=group)
                if mine:
                    bucket.update(join(name, parts))
                del parts
            elif mine:
                bucket[name] = local.clone()
        if not mine:
            continue
        bucket = pipeline.to_whole(bucket, arch, pp_rank, pp_size)
        if pp_rank == 0 or shard:
            if bucket:
                yield bucket
        elif bucket:
            _send_tensors(bucket, dst=0, group=pp_group)
        del bucket
    if pp_size == 1 or not lead or shard:
        return
    if pp_rank != 0:
        _send_tensors({}, dst=0, group=pp_group)  # this stage is done
        return
    device = next(module.parameters()).device
    for src in range(1, pp_size):
        while bucket := _recv_tensors(src=src, group=pp_group, device=device):
            yield bucket
