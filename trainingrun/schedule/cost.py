"""Cost models used to balance load across data-parallel ranks.

A cost model maps a sample's token count ``L`` to the work it causes. Two are offered:

``tokens``
    ``cost(L) = L``. Right when the linear layers dominate (short sequences, large hidden size).

``flops``
    ``cost(L) = a·L + L²``, an attention-aware proxy of a transformer layer's forward FLOPs. Per layer with hidden size
    ``d`` and a 4·d MLP, the dense matmuls cost ``24·L·d²`` and the attention scores plus the weighted sum cost
    ``4·L²·d``; dividing by ``4·d`` gives ``6·d·L + L²``. So ``a = 6·d``; the default :data:`FLOPS_LINEAR_COEFF` is
    ``6 × 4096`` (a 7B-class model). With causal masking the quadratic term halves, which is the same as doubling ``a``;
    the proxy only has to rank and add up samples, so the constant factor does not matter.

The token cap (``max_tokens_per_gpu``) always applies to *tokens*, whatever cost model balances the load.
Costs are float64: ``L²`` of long samples summed over a step overflows nothing there.
"""

from __future__ import annotations

import numpy as np

#: ``a`` in the FLOPs proxy ``a·L + L²``: ``6 × d_model`` for ``d_model = 4096``.
FLOPS_LINEAR_COEFF: float = 6.0 * 4096

COST_MODELS: tuple[str, ...] = ("tokens", "flops")


def check_cost(cost: str) -> str:
    """Return ``cost`` if it names a known cost model, else raise ``ValueError`` naming the argument."""
    if cost not in COST_MODELS:
        raise ValueError(f"cost: must be one of {', '.join(COST_MODELS)}, got {cost!r}")
    return cost


def sample_costs(lengths: np.ndarray, cost: str = "tokens") -> np.ndarray:
    """Per-sample cost (float64 array) of ``lengths`` under the cost model ``cost``."""
    check_cost(cost)
    lens = np.asarray(lengths, dtype=np.float64)
    if cost == "tokens":
        return lens
    return FLOPS_LINEAR_COEFF * lens + lens * lens
