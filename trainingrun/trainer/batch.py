"""Packed (THD) micro-batches from a rank's payload and the rollout's schedule.

A rank's payload holds its samples in `partitions[r]` order (flat over the rollout's steps); a step's micro-batches
are lists of positions into it (`PublishedRollout.microbatch_positions(rank, step)`). A micro-batch packs its samples back to back
(no padding) with `cu_seqlens` marking the documents. A micro-batch with no sample (possible when a rank has fewer
samples than the step's micro-batch count) becomes a single dummy token with no targets: its loss and gradient are 0.
Every field of the sample table (`contract.fields.FIELDS`) the payload has travels in `MicroBatch.fields`: a
per-token one packed the same way ([T], or [T, W] with a width), its row's `pad` on every token that is no sample's
own; a per-sample one [n]. The loss takes its inputs from there (`loss_inputs`): the tokens, the loss mask as
targets, the engine's log-probabilities (`logprobs`, generated rollouts) as `LossInputs.engine_logprobs`, and π_old
the trainer recomputed (`old_logprobs`, `policyLoss.oldLogprobs: trainer`) as `LossInputs.old_logprobs`.
`pad_to_length` appends a document of dummy tokens (no targets, in no sample) — how the expert-parallel ranks of a
mixture of experts give their all-gather token dispatcher equally long micro-batches. Routing replay reads the
payload's `routed_experts` rows of the micro-batch's tokens (−1 rows for dummy tokens).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from trainingrun.contract.fields import FIELDS, SAMPLE, TOKEN
from trainingrun.contract.payload import token_width
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
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # the table's fields: per token [T] / [T, W], per sample [n]
    pad_tokens: int = 0  # dummy tokens appended by `pad_to_length` (in no sample)

    @property
    def routed_experts(self) -> torch.Tensor | None:
        """[T, MoE layers × top-k] int16: the experts the generator routed each token to (routing replay)."""
        return self.fields.get("routed_experts")

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


def loss_inputs(fields: dict[str, torch.Tensor], cu_seqlens: torch.Tensor, sample_of: torch.Tensor,
                lengths: torch.Tensor) -> LossInputs:
    """What the loss takes from a micro-batch's fields: tokens, targets (the loss mask with each document's first
    token cleared: nothing precedes it), advantages, rewards, and the log-probabilities it compares against."""
    target = fields["loss_mask"].float()
    target[cu_seqlens[:-1].long()] = 0.0
    engine, old = fields.get("logprobs"), fields.get("old_logprobs")
    return LossInputs(
        tokens=fields["tokens"].long(), target_mask=target, sample_of=sample_of,
        advantages=fields["advantages"].float(), rewards=fields["rewards"].float(), lengths=lengths,
        engine_logprobs=None if engine is None else engine.float(), old_logprobs=None if old is None else old.float())


def pack(payload: dict[str, np.ndarray], positions: list[int], device: torch.device, pad_to: int | None = None) -> MicroBatch:
    """Pack the payload samples at `positions` into one micro-batch.

    `pad_to`: if given, each document is padded to that many tokens (no targets on padding) — only the benchmark uses
    this, to measure what padding costs against packing on the same schedule.
    """
    offsets = payload["offsets"]
    rows = [f for f in FIELDS.values() if f.name in payload]
    per_token = [f for f in rows if f.per == TOKEN]
    width = {f.name: token_width(payload, f.name) if f.width else 0 for f in per_token}
    parts: dict[str, list[np.ndarray]] = {f.name: [] for f in per_token}
    sample_of, lengths, doc_lens = [], [], []
    for j, p in enumerate(positions):
        a, b = int(offsets[p]), int(offsets[p + 1])
        length = b - a
        if length < 1:
            raise ValueError(f"payload: sample at position {p} has no tokens")
        padded = max(pad_to or length, length)
        for f in per_token:
            w = width[f.name]
            values = payload[f.name][a * w:b * w].reshape(length, w) if w else payload[f.name][a:b]
            parts[f.name].append(_padded(values.astype(f.np_dtype, copy=False), padded, f.pad))
        sample_of.append(np.full(padded, j, np.int64))
        lengths.append(length)
        doc_lens.append(padded)
    if not positions:  # empty micro-batch: one dummy token, no targets
        sample_of, doc_lens = [np.zeros(1, np.int64)], [1]
        parts = {f.name: [_padded(np.zeros((0, width[f.name]) if width[f.name] else 0, f.np_dtype), 1, f.pad)]
                 for f in per_token}
    packed = {name: np.concatenate(p) for name, p in parts.items()}
    pos_arr = np.asarray(positions, dtype=np.int64)
    for f in rows:
        if f.per == SAMPLE:
            packed[f.name] = np.asarray(payload[f.name][pos_arr] if positions else np.zeros(0), f.np_dtype)
    fields = {name: torch.from_numpy(a).to(device) for name, a in packed.items()}
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(doc_lens)]).astype(np.int32)).to(device)
    sample_of_t = (torch.from_numpy(np.concatenate(sample_of)).to(device) if positions
                   else torch.zeros(0, dtype=torch.long, device=device))
    loss = loss_inputs(fields, cu, sample_of_t, torch.tensor(lengths, dtype=torch.float32, device=device))
    return MicroBatch(
        input_ids=loss.tokens.unsqueeze(0),
        position_ids=torch.from_numpy(np.concatenate([np.arange(n) for n in doc_lens])).to(device).unsqueeze(0),
        cu_seqlens=cu,
        max_seqlen=int(max(doc_lens)),
        loss=loss,
        sample_ids=tuple(int(i) for i in payload["sample_ids"][pos_arr]) if positions else (),
        fields=fields,
    )


def _padded(values: np.ndarray, length: int, pad: int | float) -> np.ndarray:
    """`values` ([m] or [m, W]) followed by rows of `pad` up to `length` rows."""
    if len(values) >= length:
        return values
    return np.concatenate([values, np.full((length - len(values), *values.shape[1:]), pad, values.dtype)])


def pad_to_length(mb: MicroBatch, length: int) -> MicroBatch:
    """`mb` with a document of dummy tokens appended so that it holds `length` tokens: no targets, in no sample
    (each per-token field's pad: token 0, position 0 …, routed as the router chooses); unchanged when it already
    has `length` tokens."""
    extra = length - mb.input_ids.shape[1]
    if extra < 0:
        raise ValueError(f"pad_to_length: the micro-batch has {mb.input_ids.shape[1]} tokens, more than {length}")
    if extra == 0:
        return mb
    dev = mb.input_ids.device
    fields = {name: torch.cat([t, torch.full((extra, *t.shape[1:]), FIELDS[name].pad, dtype=t.dtype, device=dev)])
              if FIELDS[name].per == TOKEN else t for name, t in mb.fields.items()}
    cu = torch.cat([mb.cu_seqlens, mb.cu_seqlens[-1:] + extra])
    li = mb.loss
    sample_of = torch.cat([li.sample_of, li.sample_of.new_zeros(extra)]) if li.num_samples else li.sample_of
    loss = loss_inputs(fields, cu, sample_of, li.lengths)
    return dataclasses.replace(
        mb, input_ids=loss.tokens[None],
        position_ids=torch.cat([mb.position_ids[0], torch.arange(extra, device=dev)])[None],
        cu_seqlens=cu, max_seqlen=max(mb.max_seqlen, extra), loss=loss, fields=fields,
        pad_tokens=mb.pad_tokens + extra)


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
