"""LoRA adapters on Megatron's linear layers (`spec.trainer.lora`; the plan is `modeling.lora_targets`).

`apply_lora(model, arch, lora, seed=, tp=, pp=)` freezes every parameter of a built `GPTModel` (requires_grad False:
no gradient, no optimizer state, no DDP bucket — call it before `trainer.optim.wrap_ddp`) and gives each targeted
`ColumnParallelLinear` / `RowParallelLinear` of the local layer spec an `adapter` submodule (`LoRAAdapter`) and a
forward hook: the layer's output gains

    (alpha / r) · Σ_parts  B_p · A_p · dropout(x)        (each part's rows placed where the layer fuses them)

with one part per Hugging Face projection the layer fuses (q, k, v of `linear_qkv`; gate, up of a SwiGLU
`linear_fc1`; o; down), so the model is PEFT's LoRA model of the same weights.

Tensor parallelism, as the base splits:
  * column-parallel (`linear_qkv`, `linear_fc1`): A (r x in) is replicated, B (out/T x r) split by rows like the
    weight's. h = A·x is passed through Megatron's `copy_to_tensor_model_parallel_region` (identity forward, all-reduce
    backward), so A's gradient is the whole layer's on every rank; dropout draws from the default generator, which
    Megatron keeps equal over the tensor-parallel ranks (its hidden dropout does the same).
  * row-parallel (`linear_proj`, `linear_fc2`): A (r x in/T) split by columns like the weight's, B (out x r)
    replicated. h = A·x_shard is all-reduced (`reduce_from_tensor_model_parallel_region`); dropout of the split input
    draws under Megatron's model-parallel RNG tracker (a stream per tensor-parallel rank, as its attention dropout).
  The split parameters carry Megatron's tensor-parallel attributes (the gradient norm counts them once per shard, the
  replicated ones once); the layers' `sharded_state_dict` names the adapters' split axis, so checkpoints store every
  adapter once at its whole shape.

Initialisation, the same at every layout: B is zero (the model starts as the base); A is drawn as the whole
tensor of its canonical name (`decoder.layers.<global layer>.<layer>.adapter.<part>_A`) from a generator keyed by
the run's seed and that name (`initialise.tensor_seed`), uniform(±1/√in) (the bound of PEFT's default
kaiming-uniform), and this rank keeps its shard. Adapters are created in the model's dtype; with bf16/fp16 Megatron's
mixed-precision optimizer keeps their fp32 master copies, as for any trained parameter.

`live_state_dict(module)`: the module's state dict with every adapter merged into its layer's weight
(W + (alpha/r)·B·A, this rank's shard, computed in fp32) and the adapters left out — what the full-weight publishers
send; `adapter_state(module)`: the adapters alone with their tensor-parallel split axes — what the adapters-only
weight sync gathers (`modeling.stream`), named as PEFT names them by `peft_name` and `peft_config`. Of a checkpoint's
full state, `merge_full_state` merges likewise (`trainingrun export-hf`, `score`; each adapter keeps its scale as
the buffer `scale_`), `peft_adapter` gives a PEFT adapter directory's tensors and config (`export-hf --adapter`),
and `load_peft_adapter` starts a run's adapters from one (`spec.model.adapter`). The TransformerEngine layer spec is
refused (its `linear_qkv` fuses the input norm, so the adapter would see the un-normed input).

Experts (target `experts`, mixtures of experts; Megatron's `SequentialMLP`, the experts' layers column-/row-parallel
linears at TP 1): every expert's `linear_fc1` gets one adapter `gate_up` (r x hidden, 2·moe_ffn x r) on its fused
gate and up, its `linear_fc2` one adapter `down`, as PEFT adapts transformers' fused expert tensors. Under expert
parallelism each rank holds its local experts' adapters, drawn under their global expert numbers
(`convert.ep_global_name`) and marked expert-parallel (`allreduce` False: reduced over the expert-data-parallel
group, in the expert optimizer, as the experts' weights); checkpoints stack them along the experts as Megatron stacks
the experts' weights. `to_peft` stacks a layer's experts into PEFT's tensors (A [E·r, in], B [out, r·E]).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.convert import canonical_name, ep_global_name, ep_layout
from trainingrun.modeling.initialise import tensor_seed
from trainingrun.modeling.lora_targets import (EXPERT_LAYERS, EXPERT_PREFIX, HF_EXPERT_PARAMS, LAYERS, LoRASettings,
                                               check_adapter, check_lora, expert_parts, parts, peft_expert_key)
from trainingrun.modeling.pipeline import whole_name

ADAPTER = "adapter"  # the submodule's name in its linear layer


def _interleave_qkv(groups: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """q, k, v (last dim: this rank's heads·d, groups·d, groups·d) in Megatron's fused layout: per query group its
    q heads, then its k, then its v (`convert.fuse_qkv`)."""
    def combine(outs: list[torch.Tensor]) -> torch.Tensor:
        lead = outs[0].shape[:-1]
        return torch.cat([o.reshape(*lead, groups, -1) for o in outs], dim=-1).reshape(*lead, -1)
    return combine


def _concat(outs: list[torch.Tensor]) -> torch.Tensor:
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class LoRAAdapter(torch.nn.Module):
    """The adapters of one linear layer: per part `<part>_A` and `<part>_B` (this rank's shards, module docstring)."""

    def __init__(self, kind: str, shapes: list[tuple[str, tuple[int, int], tuple[int, int]]], *, scale: float,
                 dropout: float, combine: Callable[[list[torch.Tensor]], torch.Tensor], tp_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.kind, self.scale, self.dropout, self.combine, self.tp_size = kind, scale, dropout, combine, tp_size
        self.part_names = [name for name, _, _ in shapes]
        # alpha / r, kept with the adapters so that a checkpoint merges them without its spec (`merge_full_state`)
        self.register_buffer("scale_", torch.tensor([scale], dtype=torch.float32, device=device))
        for name, a_shape, b_shape in shapes:
            self.register_parameter(f"{name}_A", torch.nn.Parameter(torch.zeros(a_shape, dtype=dtype, device=device)))
            self.register_parameter(f"{name}_B", torch.nn.Parameter(torch.zeros(b_shape, dtype=dtype, device=device)))

    def split_params(self) -> list[str]:
        """The parameter names split over the tensor-parallel ranks (B of a column-, A of a row-parallel layer)."""
        return [f"{n}_B" if self.kind == "column" else f"{n}_A" for n in self.part_names]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel  # deferred: megatron (after the CPU shim)

        if self.kind == "column":
            xd = F.dropout(x, self.dropout, self.training) if self.dropout else x
            outs = []
            for n in self.part_names:
                h = F.linear(xd, getattr(self, f"{n}_A"))
                if self.tp_size > 1:
                    h = tensor_parallel.copy_to_tensor_model_parallel_region(h)
                outs.append(F.linear(h, getattr(self, f"{n}_B")))
            return self.combine(outs) * self.scale
        if self.dropout and self.training:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                xd = F.dropout(x, self.dropout, True)
        else:
            xd = x
        (n,) = self.part_names
        h = F.linear(xd, getattr(self, f"{n}_A"))
        if self.tp_size > 1:
            h = tensor_parallel.reduce_from_tensor_model_parallel_region(h)
        return F.linear(h, getattr(self, f"{n}_B")) * self.scale

    def delta(self) -> torch.Tensor:
        """This rank's shard of (alpha/r)·B·A in the layer's weight layout (out_local x in_local), fp32."""
        cols = [(getattr(self, f"{n}_B").float() @ getattr(self, f"{n}_A").float()).t() for n in self.part_names]
        return (self.combine(cols) * self.scale).t()


def _adapter_hook(module, args, kwargs, output):
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + getattr(module, ADAPTER)(x), bias


def _sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
    """The layer's sharded state dict with its adapters' split axes (replaces the instance's method)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint  # deferred: megatron

    adapter = getattr(self, ADAPTER)
    axis = {"weight": 0, "bias": 0} if adapter.kind == "column" else {"weight": 1}
    axis.update({f"{ADAPTER}.{p}": 0 if adapter.kind == "column" else 1 for p in adapter.split_params()})
    return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axis,
                                               sharded_offsets, tp_group=self.tp_group,
                                               dp_cp_group=(metadata or {}).get("dp_cp_group"))


def _layer_target(path: str, arch: Architecture, targets) -> tuple[str, str, tuple] | None:
    """(target, "column" | "row", parts) of the linear layer at `path` inside a transformer layer (`mlp.linear_fc1`,
    `mlp.experts.local_experts.<e>.linear_fc2`, …) when one of `targets` adapts it; None otherwise."""
    if path.startswith(EXPERT_PREFIX):
        expert_layer = path.rsplit(".", 1)[-1]
        if "experts" not in targets or expert_layer not in EXPERT_LAYERS or path.count(".") != 4:
            return None
        return "experts", "column" if expert_layer == "linear_fc1" else "row", expert_parts(expert_layer, arch)
    for target in targets:
        if target != "experts" and LAYERS[target][0] == path:
            return target, LAYERS[target][1], parts(target, arch)
    return None


def _combine(target: str, groups: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    return _interleave_qkv(groups) if target == "attention_qkv" else _concat


def _expert_parallel(arch: Architecture, ep: tuple[int, int] | None) -> tuple[int, int]:
    """(rank, size) of expert parallelism: `ep` as given, else Megatron's (a mixture of experts), else (0, 1)."""
    if ep is not None:
        return ep
    if arch.moe is None:
        return 0, 1
    from megatron.core import parallel_state  # deferred: megatron

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size()


def _draw_a(name: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """The whole A of canonical name `name`: uniform(±1/√in), from the generator of (seed, name)."""
    bound = 1.0 / math.sqrt(shape[1])
    gen = torch.Generator().manual_seed(tensor_seed(seed, name))
    return torch.rand(shape, generator=gen, dtype=torch.float32).mul_(2.0 * bound).sub_(bound)


def apply_lora(model, arch: Architecture, lora: LoRASettings, *, seed: int, tp: tuple[int, int] = (0, 1),
               pp: tuple[int, int] = (0, 1), ep: tuple[int, int] | None = None) -> list[str]:
    """Freeze `model` and give its targeted layers adapters (module docstring); the names of the layers adapted.
    `ep`: (rank, size) of expert parallelism (None: Megatron's). ValueError naming `trainer.lora` when the settings
    do not fit the model or a targeted layer is not a Megatron column/row-parallel linear of the local spec."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # deferred: megatron
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes  # deferred: megatron

    check_lora(lora, arch)
    tp_rank, tp_size = tp
    ep = _expert_parallel(arch, ep)
    for param in model.parameters():
        param.requires_grad_(False)
    adapted = []
    for local, module in model.named_modules():
        rest = local.split(".", 3)  # decoder.layers.<i>.<layer name>
        found = _layer_target(rest[3], arch, lora.targets) if len(rest) == 4 and rest[:2] == ["decoder", "layers"] \
            else None
        if found is None:
            continue
        target, kind, target_parts = found
        expected = ColumnParallelLinear if kind == "column" else RowParallelLinear
        if not isinstance(module, expected):
            raise ValueError(f"trainer.lora: {local} is a {type(module).__name__}, not Megatron's {expected.__name__} "
                             "of the local layer spec (the TransformerEngine spec fuses the input norm into "
                             "linear_qkv); allowed: model.attentionBackend flash or sdpa (model.transformerImpl local)")
        weight = module.weight
        shapes, full = [], []
        for name, n_in, n_out in target_parts:
            a_shape = (lora.rank, n_in // tp_size if kind == "row" else n_in)
            b_shape = (n_out // tp_size if kind == "column" else n_out, lora.rank)
            shapes.append((name, a_shape, b_shape))
            full.append((name, (lora.rank, n_in)))
        if target == "experts" and tp_size > 1:  # refused before (`architecture.check_parallel`)
            raise ValueError("trainer.lora.targets: experts at trainer.tensorParallelSize > 1; allowed: 1")
        combine = _combine(target, arch.num_query_groups // tp_size)
        adapter = LoRAAdapter(kind, shapes, scale=lora.scale, dropout=lora.dropout, combine=combine,
                              tp_size=tp_size, dtype=weight.dtype, device=weight.device)
        out_local = sum(b[0] for _, _, b in shapes)
        in_local = shapes[0][1][1]
        if (out_local, in_local) != tuple(weight.shape):
            raise ValueError(f"trainer.lora: {local}'s adapters ({out_local} x {in_local}) do not fit its weight "
                             f"{tuple(weight.shape)}")
        # the whole model's name: layer numbered over the pipeline stages, expert over the expert-parallel ranks
        whole = ep_global_name(whole_name(canonical_name(f"{local}.weight"), arch, *pp), arch, *ep)
        whole = whole.removesuffix(".weight")
        with torch.no_grad():
            for name, a_full in full:
                a = _draw_a(f"{whole}.{ADAPTER}.{name}_A", a_full, seed)
                if kind == "row":
                    a = torch.chunk(a, tp_size, dim=1)[tp_rank]
                getattr(adapter, f"{name}_A").copy_(a)
        for pname in adapter.split_params():
            set_tensor_model_parallel_attributes(getattr(adapter, pname), True, 0 if kind == "column" else 1, 1)
        if target == "experts":  # reduced over the expert-data-parallel group, as the experts' weights
            for param in adapter.parameters():
                param.allreduce = False
        module.add_module(ADAPTER, adapter)
        module.register_forward_hook(_adapter_hook, with_kwargs=True)
        module.sharded_state_dict = types.MethodType(_sharded_state_dict, module)
        adapted.append(local)
    if not adapted:
        raise ValueError(f"trainer.lora.targets: {', '.join(lora.targets)} name no layer of this model")
    return adapted


def live_state_dict(module: torch.nn.Module, *, merge: bool = True) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every adapter merged into its layer's weight and left out (module docstring); the
    plain state dict of a module without adapters. `merge=False`: the frozen base alone (adapters left out)."""
    state = module.state_dict()
    adapters = {name: m for name, m in module.named_modules() if isinstance(m, LoRAAdapter)}
    if not adapters:
        return state
    prefixes = tuple(f"{name}." for name in adapters)
    out = {k: v for k, v in state.items() if not k.startswith(prefixes)}
    if not merge:
        return out
    with torch.no_grad():
        for name, adapter in adapters.items():
            key = name.removesuffix(f".{ADAPTER}") + ".weight"
            base = out[key]
            out[key] = (base.float() + adapter.delta().to(base.device)).to(base.dtype)
    return out


def merge_full_state(state: dict[str, torch.Tensor], arch: Architecture) -> dict[str, torch.Tensor]:
    """A full canonical state (whole shapes, `trainer.full_state`: a checkpoint) with every layer's adapters merged
    into its weight (W + scale·B·A, in fp32, cast back) and the adapter tensors left out; unchanged without them."""
    marker = f".{ADAPTER}."
    layers = sorted({k.split(marker)[0] for k in state if marker in k})
    if not layers:
        return state
    out = {k: v for k, v in state.items() if marker not in k}
    for layer in layers:
        found = _layer_target(layer.split(".", 3)[3], arch, tuple(LAYERS) + ("experts",)) \
            if layer.count(".") >= 3 else None
        if found is None:
            raise ValueError(f"{layer}: adapters on a layer LoRA does not target")
        target, _, target_parts = found
        pre = f"{layer}{marker}"
        names = [name for name, _, _ in target_parts]
        cols = [(state[f"{pre}{n}_B"].float() @ state[f"{pre}{n}_A"].float()).t() for n in names]
        combine = _combine(target, arch.num_query_groups)
        scale = float(state[f"{pre}scale_"].reshape(-1)[0])
        weight = out[f"{layer}.weight"]
        out[f"{layer}.weight"] = (weight.float() + combine(cols).t() * scale).to(weight.dtype)
    return out


def adapter_state(module: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int | None]]:
    """This rank's adapter tensors (local names, `scale_` left out), each with the dimension it is split along over
    the tensor-parallel ranks (B of a column-, A of a row-parallel layer), None when replicated: what the adapters-only
    weight sync gathers (`modeling.stream.iter_live_buckets(adapters=True)`)."""
    out: dict[str, tuple[torch.Tensor, int | None]] = {}
    for name, m in module.named_modules():
        if not isinstance(m, LoRAAdapter):
            continue
        split = set(m.split_params()) if m.tp_size > 1 else set()
        for pname, param in m.named_parameters(recurse=False):
            out[f"{name}.{pname}"] = (param.detach(), (0 if m.kind == "column" else 1) if pname in split else None)
    return out


# our part -> the Hugging Face module it adapts, under model.layers.<i>
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def peft_name(key: str) -> str:
    """The PEFT tensor name (`adapter_model.safetensors`) of a canonical dense adapter tensor
    `decoder.layers.<i>.<layer>.adapter.<part>_<A|B>` (whole-model layer number); the experts' are stacked
    (`to_peft`)."""
    layer_path, param = key.split(f".{ADAPTER}.")
    part, ab = param.rsplit("_", 1)
    return f"base_model.model.model.layers.{int(layer_path.split('.')[2])}.{HF_MODULES[part]}.lora_{ab}.weight"


def _expert_key(key: str) -> tuple[int, str, int, str] | None:
    """(layer, expert layer, global expert, A | B) of a canonical expert adapter tensor; None for a dense one."""
    layer_path, param = key.split(f".{ADAPTER}.")
    expert = ep_layout(layer_path + ".x")
    if expert is None:
        return None
    return int(layer_path.split(".")[2]), layer_path.rsplit(".", 1)[1], expert, param.rsplit("_", 1)[1]


def to_peft(state: dict[str, torch.Tensor], num_experts: int = 0) -> tuple[dict[str, torch.Tensor], list[str],
                                                                            list[str]]:
    """PEFT's tensors of canonical adapter tensors (whole shapes, global experts; `scale_` left out), with PEFT's
    `target_modules` and `target_parameters`. Each layer's expert adapters are stacked as PEFT keeps them on
    transformers' fused expert tensors (`lora_targets`): A [E·r, in] (expert e's rows e·r …), B [out, r·E] (expert
    e's columns e, e+E, …). ValueError when a layer's experts are not all there."""
    tensors: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    experts: dict[tuple[int, str, str], dict[int, torch.Tensor]] = {}
    for key, value in state.items():
        found = _expert_key(key)
        if found is None:
            name = peft_name(key)
            modules.add(name.split(".")[-3])
            tensors[name] = value.contiguous()
        else:
            layer, expert_layer, e, ab = found
            experts.setdefault((layer, expert_layer, ab), {})[e] = value
    for (layer, expert_layer, ab), per in sorted(experts.items()):
        if sorted(per) != list(range(num_experts)):
            raise ValueError(f"layer {layer} {expert_layer}: adapters of experts {sorted(per)}, not of all "
                             f"{num_experts}")
        values = [per[e] for e in range(num_experts)]
        stacked = torch.cat(values, 0) if ab == "A" else torch.stack(values, -1).reshape(values[0].shape[0], -1)
        tensors[peft_expert_key(layer, expert_layer, ab)] = stacked.contiguous()
    params = [HF_EXPERT_PARAMS[layer] for layer in EXPERT_LAYERS] if experts else []
    return tensors, sorted(modules), params


def _from_peft_expert(tensors: dict[str, torch.Tensor], layer: int, expert_layer: str, expert: int, ab: str,
                      num_experts: int) -> torch.Tensor:
    """Expert `expert`'s A (r x in) or B (out x r) of PEFT's stacked tensor (the inverse of `to_peft`)."""
    t = tensors[peft_expert_key(layer, expert_layer, ab)]
    if ab == "A":
        return t.reshape(num_experts, -1, t.shape[1])[expert]
    return t.reshape(t.shape[0], -1, num_experts)[:, :, expert]


def peft_config(rank: int, scale: float, modules: list[str], base: str | None,
                parameters: list[str] | None = None) -> dict:
    """A PEFT `adapter_config.json` for adapters of `rank` scaled by `scale` (= alpha / rank) on `modules` (and the
    fused expert tensors `parameters`, in the order PEFT nests them: `to_peft`)."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scale * rank,
              "lora_dropout": 0.0, "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "use_rslora": False, "init_lora_weights": True,
              "base_model_name_or_path": base}
    if parameters:
        config["target_parameters"] = list(parameters)
    return config


def peft_adapter(state: dict[str, torch.Tensor], arch: Architecture, *, base: str | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict]:
    """A PEFT LoRA adapter (`adapter_model.safetensors` tensors, `adapter_config.json`) from a full canonical state
    that holds adapters (`trainer.full_state.load_full_state(..., merge=False)`). ValueError when it holds none, or
    the model has no PEFT names for them (a GELU `gpt` model's MLP)."""
    marker = f".{ADAPTER}."
    keys = sorted(k for k in state if marker in k and not k.endswith("scale_"))
    if not keys:
        raise ValueError("holds no LoRA adapters (its run had no spec.trainer.lora)")
    if not arch.gated and any(".mlp." in k for k in keys):
        raise ValueError("a GELU (gpt) model's MLP adapters have no PEFT module names; --adapter exports "
                         "llama-family models")
    ranks, scales = set(), set()
    for key in keys:
        layer_path, param = key.split(marker)
        ranks.add(int(state[key].shape[0 if param.endswith("_A") else 1]))
        scales.add(float(state[f"{layer_path}{marker}scale_"].reshape(-1)[0]))
    if len(ranks) != 1 or len(scales) != 1:
        raise ValueError(f"adapters of several ranks {sorted(ranks)} or scales {sorted(scales)}")
    (rank,), (scale,) = ranks, scales
    tensors, modules, params = to_peft({k: state[k] for k in keys}, arch.moe.num_experts if arch.moe else 0)
    return tensors, peft_config(rank, scale, modules, base, params)


def load_peft_adapter(model, arch: Architecture, lora: LoRASettings, path: str, *, tp: tuple[int, int] = (0, 1),
                      pp: tuple[int, int] = (0, 1), ep: tuple[int, int] | None = None) -> int:
    """Copy a PEFT adapter directory's adapters (`spec.model.adapter`, checked by `lora_targets.check_adapter`) into
    the adapters `apply_lora` gave `model`, this rank's shard of each (its experts' under expert parallelism); the
    number of tensors copied."""
    from safetensors.torch import load_file  # deferred: safetensors

    check_adapter(path, lora, arch)
    tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
    tp_rank, tp_size = tp
    ep = _expert_parallel(arch, ep)
    copied = 0
    with torch.no_grad():
        for local, module in model.named_modules():
            if not isinstance(module, LoRAAdapter):
                continue
            # the whole model's name of the adapter's first A: layer over the stages, expert over the EP ranks
            whole = ep_global_name(whole_name(canonical_name(f"{local}.{module.part_names[0]}_A"), arch, *pp), arch,
                                   *ep)
            layer = int(whole.split(".")[2])
            found = _expert_key(whole)
            for part in module.part_names:
                if found is not None:
                    _, expert_layer, e, _ = found
                    a, b = (_from_peft_expert(tensors, layer, expert_layer, e, ab, arch.moe.num_experts)
                            for ab in "AB")
                else:
                    pre = f"base_model.model.model.layers.{layer}.{HF_MODULES[part]}"
                    a, b = tensors[f"{pre}.lora_A.weight"], tensors[f"{pre}.lora_B.weight"]
                if module.kind == "row":
                    a = torch.chunk(a, tp_size, dim=1)[tp_rank]
                else:
                    b = torch.chunk(b, tp_size, dim=0)[tp_rank]
                getattr(module, f"{part}_A").copy_(a)
                getattr(module, f"{part}_B").copy_(b)
                copied += 2
    return copied


def adapter_parameters(module: torch.nn.Module) -> int:
    """How many adapter numbers this rank holds."""
    return sum(p.numel() for m in module.modules() if isinstance(m, LoRAAdapter) for p in m.parameters())


def adapter_settings(module: torch.nn.Module) -> tuple[int, float]:
    """(rank, scale = alpha / rank) of the module's adapters; ValueError when it has none."""
    for m in module.modules():
        if isinstance(m, LoRAAdapter):
            return int(getattr(m, f"{m.part_names[0]}_A").shape[0]), float(m.scale)
    raise ValueError("trainer.lora: the model holds no LoRA adapters")
