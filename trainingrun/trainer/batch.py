"""Packed (THD) micro-batches from a rank's payload and the rollout's schedule.

A rank's payload holds its samples in `partitions[r]` order (flat over the rollout's steps); a step's micro-batches
are lists of positions into it (`PublishedRollout.microbatch_positions(rank, step)`). A micro-batch packs its samples back to back
(no padding) with `cu_seqlens` marking the documents. A micro-batch with no sample (possible when a rank has fewer
samples than the step's micro-batch count) becomes a single dummy token with no targets: its loss and gradient are 0.
Generated rollouts carry the engine's log-probabilities (`logprobs`) into `LossInputs.engine_logprobs`; a payload the
trainer gave π_old (`old_logprobs`, `policyLoss.oldLogprobs: trainer`, same layout) into `LossInputs.old_logprobs`.
`pad_to_length` appends a document of dummy tokens (no targets, in no sample) — how the expert-parallel ranks of a
mixture of experts give their all-gather token dispatcher equally long micro-batches. Routing replay: the payload's
`routed_experts` rows of the micro-batch's tokens travel along (−1 rows for dummy tokens).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from trainingrun.contract.payload import NOT_ROUTED, token_width
from trainingrun.trainer.loss import LossInputs


@dataclass
class MicroBatch:
    """Model input and loss input of one packed micro-batch."""

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long, restarting at 0 for each document
    cu_seqlens: torch.Tensor  # [n + 1] int32
    max_seqlen: int
    loss: LossInputs
    sample_ids: tuple[int, ...]
    routed_experts: torch.Tensor | None = None  # [T, MoE layers × top-k] int16, the generator's (routing replay)
    pad_tokens: int = 0  # dummy tokens appended by `pad_to_length` (in no sample)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1]) - self.pad_tokens if self.loss.num_samples else 0

    @property
    def token_sample(self) -> torch.Tensor:
        """[T] long: the index of each token's sample in this micro-batch, −1 for dummy tokens."""
        total = self.input_ids.shape[1]
        out = torch.full((total,), -1, dtype=torch.long, device=self.input_ids.device)
        if self.loss.num_samples:
            real = total - self.pad_tokens
            out[:real] = self.loss.sample_of[:real]
        return out

    def packed_seq_params(self):
        from megatron.core.packed_seq_params import PackedSeqParams  # deferred: megatron

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )


def pack(payload: dict[str, np.ndarray], positions: list[int], device: torch.device, pad_to: int | None = None) -> MicroBatch:
    """Pack the payload samples at `positions` into one micro-batch.

    `pad_to`: if given, each document is padded to that many tokens (no targets on padding) — only the benchmark uses
    this, to measure what padding costs against packing on the same schedule.
    """
    offsets = payload["offsets"]
    toks, masks, sample_of, lengths, doc_lens, routed = [], [], [], [], [], []
    per_token = {name: [] for name in ("logprobs", "old_logprobs") if name in payload}
    width = token_width(payload, "routed_experts") if "routed_experts" in payload else 0
    for j, p in enumerate(positions):
        a, b = int(offsets[p]), int(offsets[p + 1])
        length = b - a
        if length < 1:
            raise ValueError(f"payload: sample at position {p} has no tokens")
        t = payload["tokens"][a:b].astype(np.int64)
        m = payload["loss_mask"][a:b].astype(np.float32)
        m[0] = 0.0  # the first token of a document is never predicted
        padded = max(pad_to or length, length)
        for name, parts in per_token.items():
            parts.append(np.concatenate([payload[name][a:b].astype(np.float32),
                                         np.zeros(padded - length, np.float32)]))
        if padded > length:
            t = np.concatenate([t, np.zeros(padded - length, np.int64)])
            m = np.concatenate([m, np.zeros(padded - length, np.float32)])
        if width:
            r = payload["routed_experts"][a * width:b * width].reshape(length, width)
            routed.append(np.concatenate([r, np.full((padded - length, width), NOT_ROUTED, np.int16)]))
        toks.append(t)
        masks.append(m)
        sample_of.append(np.full(padded, j, np.int64))
        lengths.append(length)
        doc_lens.append(padded)
    if not positions:  # empty micro-batch: one dummy token, no targets
        toks, masks, sample_of, doc_lens = [np.zeros(1, np.int64)], [np.zeros(1, np.float32)], [np.zeros(1, np.int64)], [1]
        per_token = {name: [np.zeros(1, np.float32)] for name in per_token}
        routed = [np.full((1, width), NOT_ROUTED, np.int16)] if width else []
    cu = np.concatenate([[0], np.cumsum(doc_lens)]).astype(np.int32)
    positions_in_doc = np.concatenate([np.arange(n) for n in doc_lens])
    pos_arr = np.asarray(positions, dtype=np.int64)
    adv = payload["advantages"][pos_arr] if positions else np.zeros(0, np.float32)
    rew = payload["rewards"][pos_arr] if positions else np.zeros(0, np.float32)
    ids = tuple(int(i) for i in payload["sample_ids"][pos_arr]) if positions else ()
    tokens = torch.from_numpy(np.concatenate(toks)).to(device)
    lps = {name: torch.from_numpy(np.concatenate(parts)).to(device) for name, parts in per_token.items()}
    return MicroBatch(
        input_ids=tokens.unsqueeze(0),
        position_ids=torch.from_numpy(positions_in_doc).to(device).unsqueeze(0),
        cu_seqlens=torch.from_numpy(cu).to(device),
        max_seqlen=int(max(doc_lens)),
        loss=LossInputs(
            tokens=tokens,
            target_mask=torch.from_numpy(np.concatenate(masks)).to(device),
            sample_of=torch.from_numpy(np.concatenate(sample_of)).to(device) if positions else torch.zeros(0, dtype=torch.long, device=device),
            advantages=torch.from_numpy(np.asarray(adv, np.float32)).to(device),
            rewards=torch.from_numpy(np.asarray(rew, np.float32)).to(device),
            lengths=torch.tensor(lengths, dtype=torch.float32, device=device),
            engine_logprobs=lps.get("logprobs"),
            old_logprobs=lps.get("old_logprobs"),
        ),
        sample_ids=ids,
        routed_experts=torch.from_numpy(np.concatenate(routed)).to(device) if width else None,
    )


def pad_to_length(mb: MicroBatch, length: int) -> MicroBatch:
    """`mb` with a document of dummy tokens appended so that it holds `length` tokens: no targets, in no sample
    (token 0, position 0 …), routed as the router chooses; unchanged when it already has `length` tokens."""
    extra = length - mb.input_ids.shape[1]
    if extra < 0:
        raise ValueError(f"pad_to_length: the micro-batch has {mb.input_ids.shape[1]} tokens, more than {length}")
    if extra == 0:
        return mb
    dev = mb.input_ids.device
    zeros = torch.zeros(extra, dtype=torch.long, device=dev)
    li = mb.loss
    loss = dataclasses.replace(
        li, tokens=torch.cat([li.tokens, zeros]), target_mask=torch.cat([li.target_mask, zeros.float()]),
        sample_of=torch.cat([li.sample_of, zeros]) if li.num_samples else li.sample_of,
        engine_logprobs=None if li.engine_logprobs is None else torch.cat([li.engine_logprobs, zeros.float()]),
        old_logprobs=None if li.old_logprobs is None else torch.cat([li.old_logprobs, zeros.float()]))
    routed = mb.routed_experts
    if routed is not None:
        routed = torch.cat([routed, torch.full((extra, routed.shape[1]), NOT_ROUTED, dtype=routed.dtype, device=dev)])
    return dataclasses.replace(
        mb, input_ids=torch.cat([mb.input_ids[0], zeros])[None],
        position_ids=torch.cat([mb.position_ids[0], torch.arange(extra, device=dev)])[None],
        cu_seqlens=torch.cat([mb.cu_seqlens, mb.cu_seqlens[-1:] + extra]), max_seqlen=max(mb.max_seqlen, extra),
        loss=loss, routed_experts=routed, pad_tokens=mb.pad_tokens + extra)


def step_microbatches(payload: dict[str, np.ndarray], positions: list[list[int]], device: torch.device,
                      pad_to_longest: bool = False) -> list[MicroBatch]:
    """One packed micro-batch per entry of `positions` (a rank's micro-batches of one step, as positions into its
    payload: `PublishedRollout.microbatch_positions`)."""
    out = []
    for pos in positions:
        pad = None
        if pad_to_longest and pos:
            off = payload["offsets"]
            pad = max(int(off[p + 1] - off[p]) for p in pos)
        out.append(pack(payload, [int(p) for p in pos], device, pad_to=pad))
    return out
