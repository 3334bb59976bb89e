"""A small core-attention module for packed (THD) sequences, built on `torch.nn.functional.scaled_dot_product_attention`.

Megatron's local `DotProductAttention` refuses packed input ("Packed sequence is not supported"), and
TransformerEngine is not available on a CPU machine. This module takes Megatron's core-attention call
(query/key/value after RoPE) and, for THD input, attends within each document only: the mask is block-diagonal over
the documents given by `packed_seq_params.cu_seqlens_q`, and causal inside each block. It is a drop-in for
`core_attention` in `get_gpt_layer_local_spec()` (see `trainingrun.modeling.model.layer_spec`). It has no parameters
and imports nothing from megatron (a plain `torch.nn.Module` with Megatron's constructor and forward signature), so
it is tested in any process.

Shapes (as Megatron passes them):
  THD (packed):  query/key/value [T, heads, head_dim]           -> output [T, heads, head_dim]
  SBHD (padded): query/key/value [S, B, heads, head_dim]         -> output [S, B, heads * head_dim]
                 causal; with fewer queries than keys (inference with a KV cache) the queries are the last
                 positions, so query i attends keys 0 .. Sk - Sq + i.
Grouped-query attention (fewer key/value heads) is expanded by repetition.
"""

from __future__ import annotations

import math

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
    """Core attention for the local layer spec that accepts packed sequences (block-diagonal causal mask)."""

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
            total = query.shape[0]
            mask = block_causal_mask(packed_seq_params.cu_seqlens_q, total, query.device)
            q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [heads, T, d]
            k, v = _expand_kv(q, k), _expand_kv(q, v)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, scale=self.softmax_scale
            )
            return out.transpose(0, 1).contiguous()  # [T, heads, d]
        # [S, B, H, D] -> [B, H, S, D]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        k, v = _expand_kv(q, k), _expand_kv(q, v)
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


def _expand_kv(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Repeat key/value heads (dim -3) to the query's head count (grouped-query attention)."""
    if kv.shape[-3] == q.shape[-3]:
        return kv
    return kv.repeat_interleave(q.shape[-3] // kv.shape[-3], dim=-3)
