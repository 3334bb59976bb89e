"""Core-attention modules of the local layer spec for packed (THD) sequences: `PackedSDPAttention` (the `sdpa`
backend, built on `torch.nn.functional.scaled_dot_product_attention`) and `FlashVarlenAttention` (the `flash`
backend, torch's variable-length flash attention). Which one a model gets: `trainingrun.modeling.model.attention_choice`.

Megatron's local `DotProductAttention` refuses packed input ("Packed sequence is not supported"), and
TransformerEngine is not available on a CPU machine. This module takes Megatron's core-attention call
(query/key/value after RoPE) and, for THD input, attends within each document only (the documents given by
`packed_seq_params.cu_seqlens_q`), causal inside each: the values of one call with the block-diagonal mask
`block_causal_mask`, computed as one causal SDPA call per document over [1, heads, s_i, d] views, so no [T, T] mask
or score matrix exists. torch picks its fused (flash) kernel for such a call on the CPU (fp32, bf16, fp16) and on
CUDA, which keeps for the backward only q, k, v, the output and a float32 log-sum-exp per head and token: memory
linear in T (`modeling.memory.core_attention_bytes`, checked by tests/unit/test_attention_backends.py). One masked
call over the whole micro-batch took torch's math kernel and kept [heads, T, T] float32 scores per layer:
SmolLM2-135M at maxTokensPerGPU 8192 was killed at 18.6 GB resident in its first step. Grouped-query attention
reaches SDPA as it is (`enable_gqa`), without repeated key/value heads. It is a drop-in for `core_attention` in
`get_gpt_layer_local_spec()` (see `trainingrun.modeling.model.layer_spec`). It has no parameters and imports nothing
from megatron (a plain `torch.nn.Module` with Megatron's constructor and forward signature), so it is tested in any
process.

Shapes (as Megatron passes them):
  THD (packed):  query/key/value [T, heads, head_dim]           -> output [T, heads, head_dim]
  SBHD (padded): query/key/value [S, B, heads, head_dim]         -> output [S, B, heads * head_dim]
                 causal; with fewer queries than keys (inference with a KV cache) the queries are the last
                 positions, so query i attends keys 0 .. Sk - Sq + i.
Grouped-query attention (fewer key/value heads): SDPA's `enable_gqa` (THD), key/value heads repeated (SBHD).

`FlashVarlenAttention` takes the same call. For THD input it runs `torch.nn.attention.varlen.varlen_attn` (CUDA
only, bf16/fp16) over the documents given by `cu_seqlens_q`/`cu_seqlens_kv` and `max_seqlen_q`/`max_seqlen_kv`:
no [T, T] mask, memory linear in T, and only the causal half of each document's scores computed. The function's
keywords differ between torch releases, so `find_varlen_kernel` reads its signature once: causal as
`window_size=(-1, 0)` (newer) or `is_causal=True` (older); the softmax scale as `scale=` or, where it has none, folded
into the queries; grouped-query attention as `enable_gqa=True` or, where it has none, key/value heads repeated.
Padded (SBHD) input — generation with a KV cache — takes `PackedSDPAttention`'s path (torch SDPA, whose flash kernel
CUDA picks for a causal batch without a mask).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def block_causal_mask(cu_seqlens: torch.Tensor, total: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean [total, total] mask, True where query i may attend key j: same document and j <= i.

    `cu_seqlens` = [0, len_0, len_0 + len_1, ...]; positions past cu_seqlens[-1] (if any) form one more document.
    """
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    pos = torch.arange(total, device=device)
    doc = torch.bucketize(pos, bounds[1:], right=True)  # document index of each position
    same_doc = doc[:, None] == doc[None, :]
    causal = pos[None, :] <= pos[:, None]
    return same_doc & causal


class PackedSDPAttention(torch.nn.Module):
    """Core attention for the local layer spec that accepts packed sequences (causal within each document, one SDPA
    call per document: module docstring)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__()
        self.config = config
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("PackedSDPAttention does not support attention_bias")
        dropout = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._per_document(query, key, value, packed_seq_params.cu_seqlens_q, dropout)
        # [S, B, H, D] -> [B, H, S, D]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        k, v = _expand_kv(q, k, dim=-3), _expand_kv(q, v, dim=-3)
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask.bool()  # Megatron: True = masked out
        elif q.shape[-2] != k.shape[-2]:
            # Inference with a KV cache: the queries are the last positions of the keys (causal, bottom-right).
            sq, sk = q.shape[-2], k.shape[-2]
            mask = torch.arange(sk, device=q.device)[None, :] <= torch.arange(sk - sq, sk, device=q.device)[:, None]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=self.softmax_scale
        )
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1).contiguous()


    def _per_document(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                      dropout: float) -> torch.Tensor:
        """Causal attention within each document of a packed [T, heads, d] micro-batch, one SDPA call per document
        (module docstring): the same values as one call with `block_causal_mask`, without its [T, T] scores."""
        total, heads = query.shape[0], query.shape[1]
        out = query.new_empty(total, heads, value.shape[-1])
        gqa = key.shape[1] != heads
        for a, b in document_bounds(cu_seqlens, total):
            q, k, v = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, heads, s, d]
            doc = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                 scale=self.softmax_scale, enable_gqa=gqa)
            out[a:b] = doc[0].transpose(0, 1)
        return out


def document_bounds(cu_seqlens: torch.Tensor, total: int) -> list[tuple[int, int]]:
    """(start, end) of each non-empty document of a packed micro-batch of `total` tokens: `cu_seqlens` = [0, len_0,
    len_0 + len_1, ...]; positions past cu_seqlens[-1] (if any) form one more document, as in `block_causal_mask`."""
    cuts = [int(c) for c in cu_seqlens.tolist() if 0 < int(c) < total]
    edges = [0, *sorted(set(cuts)), total]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def _expand_kv(q: torch.Tensor, kv: torch.Tensor, dim: int) -> torch.Tensor:
    """Repeat key/value heads (dimension `dim`) to the query's head count (grouped-query attention)."""
    if kv.shape[dim] == q.shape[dim]:
        return kv
    return kv.repeat_interleave(q.shape[dim] // kv.shape[dim], dim=dim)


@dataclass(frozen=True)
class VarlenKernel:
    """torch's `varlen_attn` and how this torch release's version of it is called (see the module docstring)."""

    fn: Callable[..., torch.Tensor]
    causal: dict  # the keyword that makes it causal: {"window_size": (-1, 0)} or {"is_causal": True}
    takes_scale: bool  # has `scale=`
    takes_gqa: bool  # has `enable_gqa=`


def find_varlen_kernel() -> VarlenKernel | str:
    """This torch's variable-length flash attention, or why there is none (a sentence naming what is missing)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # deferred: torch submodule of recent releases only (probed)
    except ImportError as exc:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn ({exc})"
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal: dict = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return (f"torch {torch.__version__}'s varlen_attn takes neither window_size nor is_causal: it has no causal "
                "mask")
    return VarlenKernel(varlen_attn, causal, "scale" in params, "enable_gqa" in params)


# Flash attention's limits: half precision, heads of at most 256 (a multiple of 8), an Ampere or newer GPU.
FLASH_MAX_HEAD_DIM = 256
FLASH_MIN_CAPABILITY = (8, 0)


def flash_unavailable(device: torch.device, precision: str, head_dim: int) -> str | None:
    """Why the flash backend cannot run a model of `precision` and `head_dim` on `device` (None: it can)."""
    if device.type != "cuda":
        return f"it runs on CUDA only (device {device})"
    if precision not in ("bf16", "fp16"):
        return f"flash kernels run in bf16 or fp16, the model is {precision}"
    if head_dim > FLASH_MAX_HEAD_DIM or head_dim % 8:
        return f"flash kernels take heads of at most {FLASH_MAX_HEAD_DIM}, a multiple of 8; the model's are {head_dim}"
    kernel = find_varlen_kernel()
    if isinstance(kernel, str):
        return kernel
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < FLASH_MIN_CAPABILITY:
        return (f"flash kernels need compute capability {FLASH_MIN_CAPABILITY[0]}.{FLASH_MIN_CAPABILITY[1]} or "
                f"newer (Ampere); {torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
    return None


class FlashVarlenAttention(PackedSDPAttention):
    """Core attention for the local layer spec: packed sequences through torch's `varlen_attn` (module docstring)."""

    kernel: VarlenKernel | None = None  # found at the first packed call (class-wide: one torch per process)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        if attention_bias is not None:
            raise ValueError("FlashVarlenAttention does not support attention_bias")
        if self.training and self.dropout_p:
            raise ValueError("FlashVarlenAttention has no attention dropout (the trainer runs without dropout)")
        kernel = self._kernel()
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))  # [T, heads, d]
        kwargs = dict(kernel.causal)
        head_dim = q.shape[-1]
        if kernel.takes_scale:
            kwargs["scale"] = self.softmax_scale
        elif not math.isclose(self.softmax_scale, 1.0 / math.sqrt(head_dim)):
            q = q * (self.softmax_scale * math.sqrt(head_dim))  # its fixed 1/sqrt(d), times our scale's ratio
        if k.shape[1] != q.shape[1]:
            if kernel.takes_gqa:
                kwargs["enable_gqa"] = True
            else:
                k, v = _expand_kv(q, k, dim=1), _expand_kv(q, v, dim=1)
        cu_q = packed_seq_params.cu_seqlens_q.to(device=q.device, dtype=torch.int32)
        cu_k = packed_seq_params.cu_seqlens_kv.to(device=q.device, dtype=torch.int32)
        max_q = _max_seqlen(packed_seq_params.max_seqlen_q, cu_q)
        max_k = _max_seqlen(packed_seq_params.max_seqlen_kv, cu_k)
        return kernel.fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)

    @classmethod
    def _kernel(cls) -> VarlenKernel:
        if cls.kernel is None:
            found = find_varlen_kernel()
            if isinstance(found, str):
                raise RuntimeError(f"model.attentionBackend flash: {found}")
            FlashVarlenAttention.kernel = found
        return cls.kernel


def _max_seqlen(given: int | None, cu_seqlens: torch.Tensor) -> int:
    """The longest document: the schedule's value, or (when a caller left it out) read off `cu_seqlens`."""
    if given is not None:
        return int(given)
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
