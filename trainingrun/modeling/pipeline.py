"""Pipeline stages of an `Architecture`: which layers a stage holds, and canonical weight names between one stage's
model and the whole model. Pure (names and ranges; the tensors are passed through untouched), no torch import.

With pipeline-parallel size P the L transformer layers are split evenly: stage p holds global layers
[p·L/P, (p+1)·L/P), numbered 0 … L/P − 1 inside its own `GPTModel` (Megatron's even split; `check_pp` refuses an L
that P does not divide). The first stage also holds the word embedding, the last one the final norm and the output
layer. With tied embeddings and P > 1 the last stage keeps its own copy of the embedding as `output_layer.weight`
(Megatron keeps the two equal: its embedding group sums their gradients); the whole model has only the embedding.

  to_stage(state, ...)    the whole model's canonical state → what stage p's model holds (its layers renumbered)
  to_whole(state, ...)    stage p's canonical state → its part of the whole model (global layer numbers; the last
                          stage's tied copy of the embedding dropped)
  whole_name(name, ...)   the whole model's name of one of stage p's tensors (the tied copy: the embedding's), e.g.
                          what its seeded initialisation is keyed by (`modeling.initialise`)
"""

from __future__ import annotations

import re
from typing import TypeVar

from trainingrun.modeling.architecture import Architecture, spec_field

T = TypeVar("T")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
_LAST_STAGE = ("decoder.final_layernorm.", "output_layer.")


def check_pp(arch: Architecture, pp: int) -> None:
    """ValueError naming `model.numLayers` when pipeline-parallel size `pp` does not split the layers evenly."""
    if pp == 1:
        return
    if arch.num_layers % pp:
        raise ValueError(f"{spec_field('num_layers')}: {arch.num_layers} layers are not divisible by "
                         f"trainer.pipelineParallelSize {pp}; allowed: a pipelineParallelSize that divides the "
                         "number of layers (each stage holds the same number of layers)")


def stage_layers(arch: Architecture, pp_rank: int, pp_size: int) -> range:
    """The global layer numbers stage `pp_rank` of `pp_size` holds."""
    per = arch.num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def to_stage(state: dict[str, T], arch: Architecture, pp_rank: int, pp_size: int) -> dict[str, T]:
    """The entries of a whole-model canonical state dict that stage `pp_rank` holds, under its model's names."""
    if pp_size == 1:
        return dict(state)
    layers = stage_layers(arch, pp_rank, pp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: dict[str, T] = {}
    for name, value in state.items():
        m = _LAYER.match(name)
        if m:
            i = int(m.group(1))
            if i in layers:
                out[f"decoder.layers.{i - layers.start}.{m.group(2)}"] = value
        elif name.startswith("embedding."):
            if first:
                out[name] = value
            if last and arch.tie_embeddings and name == EMBEDDING:
                out[OUTPUT_LAYER] = value  # the last stage's own copy of the tied embedding
        elif name.startswith(_LAST_STAGE):
            if last:
                out[name] = value
        else:
            out[name] = value  # not stage-specific (none in a GPT model today): every stage has it
    return out


def whole_name(name: str, arch: Architecture, pp_rank: int, pp_size: int) -> str:
    """The whole model's canonical name of stage `pp_rank`'s tensor `name`: its layer renumbered globally; with tied
    embeddings the last stage's `output_layer.weight` (at P > 1 a copy of the embedding) is the embedding's."""
    if pp_size == 1:
        return name
    m = _LAYER.match(name)
    if m:
        return f"decoder.layers.{int(m.group(1)) + stage_layers(arch, pp_rank, pp_size).start}.{m.group(2)}"
    if name == OUTPUT_LAYER and arch.tie_embeddings:
        return EMBEDDING
    return name


def to_whole(state: dict[str, T], arch: Architecture, pp_rank: int, pp_size: int) -> dict[str, T]:
    """Stage `pp_rank`'s canonical state under the whole model's names (inverse of `to_stage`)."""
    if pp_size == 1:
        return dict(state)
    out: dict[str, T] = {}
    for name, value in state.items():
        if name == OUTPUT_LAYER and arch.tie_embeddings:
            continue  # the copy of the embedding: the first stage's is the one
        out[whole_name(name, arch, pp_rank, pp_size)] = value
    return out
