"""The seeded initialisation of a model without given weights, the same whatever the parallel layout.

Every parameter is drawn as the whole model's tensor of the same name: its canonical whole-model name — local-spec
name (`convert.canonical_name`), global layer number (`pipeline.whole_name`), global expert number
(`convert.ep_global_name`) — and the run's seed key a generator of its own, which draws the full tensor
(`convert.expected_shapes`); this rank keeps its tensor-parallel shard of it (`convert.split_tp`, the rules the
Hugging Face import splits by). So a data-, tensor-, pipeline- or expert-parallel rank holds exactly the numbers the
same tensor has in a one-process model, and a pipeline stage's layers are the whole model's same layers (with tied
embeddings the last stage's copy of the embedding is drawn as the embedding).

Megatron's own initialisation could not give that: on the CPU (`use_cpu_initialization`) it draws every parameter of
a rank from one random stream in construction order — the full tensor, then the rank's slice, so the tensor-parallel
sizes agreed — but a pipeline stage starts that stream at its own first layer and an expert-parallel rank builds only
its experts, so both drew other numbers for every later tensor; on CUDA it draws each rank's shard from a per-rank
generator, so no two layouts agree.

The values (`INIT_RULES`, by canonical name): Megatron's — normal(0, std) for the embedding, the output layer, the
query/key/value and first MLP projections, the router and the shared-expert gate; normal(0, std/√(2·layers)) for the
projections back into the residual stream (`linear_proj`, `linear_fc2`: Megatron's `output_layer_init_method`); ones
for the norms, zeros for the biases. A parameter no rule names is refused (ValueError naming it), so a new kind of
parameter (an adapter, ...) comes with its rule here and is layout-independent by the same mechanism.

Cost: each parameter's full tensor is drawn on the CPU in float32, one tensor at a time (peak: the largest full
tensor, e.g. a 151,936 × 2,048 embedding, 1.2 GB), then its shard is copied to the device. A rank draws the full
tensors of what it holds: its stage's layers, its experts, and T× its share of a tensor split over T
tensor-parallel ranks. torch's CPU generator draws ~100 M numbers a second on one core (this machine), so a rank of
Qwen3-30B-A3B at expert parallelism 8 (1.5 B dense + 3.6 B expert numbers) spends about a minute; the ranks draw at
the same time. Drawing on the CPU keeps the numbers the same on every device (a CUDA generator's depend on the
launch configuration). Megatron's initialisation still runs first (it sets the tensor-parallel attributes of the
parameters); on CUDA it is cheap, on the CPU it draws once more.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.convert import canonical_name, ep_global_name, expected_shapes, split_tp
from trainingrun.modeling.pipeline import whole_name

# (pattern on the canonical whole-model name, kind), first match wins: "normal" N(0, std), "output" N(0, std/√(2L)),
# "ones", "zeros".
INIT_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\.bias$"), "zeros"),
    (re.compile(r"layernorm\.weight$"), "ones"),
    (re.compile(r"\.(linear_proj|linear_fc2)\.weight$"), "output"),
    (re.compile(r"^(embedding\.word_embeddings|output_layer)\.weight$"), "normal"),
    (re.compile(r"\.(linear_qkv|linear_fc1|router)\.weight$"), "normal"),
    (re.compile(r"\.shared_experts\.gate_weight$"), "normal"),
)


def init_kind(name: str) -> str:
    """The kind of value a canonical tensor starts with (`INIT_RULES`); ValueError naming a tensor no rule covers."""
    for pattern, kind in INIT_RULES:
        if pattern.search(name):
            return kind
    raise ValueError(f"{name}: no seeded initialisation rule covers this parameter (modeling.initialise.INIT_RULES)")


def tensor_seed(seed: int, name: str) -> int:
    """The seed of the generator that draws the canonical tensor `name` of a run seeded `seed`."""
    return int(np.random.SeedSequence([int(seed), *name.encode()]).generate_state(1)[0])


def full_tensor(name: str, arch: Architecture, *, seed: int, std: float = 0.02) -> torch.Tensor:
    """The whole model's tensor `name` (canonical, global layer and expert numbers) as the seed draws it, float32."""
    shape = expected_shapes(arch).get(name)
    if shape is None:
        raise ValueError(f"{name}: not a tensor of this architecture")
    return _draw(name, shape, init_kind(name), arch, seed=seed, std=std)


def _draw(name: str, shape: tuple[int, ...], kind: str, arch: Architecture, *, seed: int, std: float) -> torch.Tensor:
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "ones":
        return torch.ones(shape)
    sigma = std / (2.0 * arch.num_layers) ** 0.5 if kind == "output" else std
    out = torch.randn(shape, generator=torch.Generator().manual_seed(tensor_seed(seed, name)), dtype=torch.float32)
    return out.mul_(sigma)


def initialise(model, arch: Architecture, *, seed: int, std: float = 0.02, tp: tuple[int, int] = (0, 1),
               pp: tuple[int, int] = (0, 1), ep: tuple[int, int] = (0, 1)) -> None:
    """Set every parameter of `model` — this rank's part of the whole model, at (rank, size) `tp`, `pp` and `ep` —
    to the whole model's seeded values (module docstring). ValueError naming a parameter that is not a tensor of
    the architecture, whose shard has another shape, or that no rule covers; nothing is changed then."""
    shapes = expected_shapes(arch)
    plan = []
    for local, param in model.named_parameters():  # every check before any parameter changes
        name = ep_global_name(whole_name(canonical_name(local), arch, *pp), arch, *ep)
        if name not in shapes:
            raise ValueError(f"{local}: the model's parameter is not a tensor of the architecture (as {name})")
        kind = init_kind(name)
        shard = split_tp(name, torch.empty(shapes[name], device="meta"), arch, *tp)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"{local}: this rank's shard of {name} has shape {tuple(shard.shape)}, the model's "
                             f"parameter {tuple(param.shape)}")
        plan.append((name, kind, param))
    with torch.no_grad():
        for name, kind, param in plan:
            if kind in ("zeros", "ones"):
                param.fill_(0.0 if kind == "zeros" else 1.0)
                continue
            full = _draw(name, shapes[name], kind, arch, seed=seed, std=std)
            param.copy_(split_tp(name, full, arch, *tp).to(param.device, param.dtype))
            del full  # one full tensor at a time
