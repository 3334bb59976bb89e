"""Packed (THD) micro-batches from a rank's payload and the rollout's schedule.

A rank's payload holds its samples in `partitions[r]` order (flat over the rollout's steps); a step's micro-batches
are lists of positions into it (`PublishedRollout.microbatch_positions(rank, step)`). A micro-batch packs its samples back to back
(no padding) with `cu_seqlens` marking the documents. A micro-batch with no sample (possible when a rank has fewer
samples than the step's micro-batch count) becomes a single dummy token with no targets: its loss and gradient are 0.
Generated rollouts carry the engine's log-probabilities (`logprobs`) into `LossInputs.engine_logprobs`; a payload the
trainer gave π_old (`old_logprobs`, `policyLoss.oldLogprobs: trainer`, same layout) into `LossInputs.old_logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np
import torch

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

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1]) if self.loss.num_samples else 0

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
    toks, masks, sample_of, lengths, doc_lens = [], [], [], [], []
    per_token = {name: [] for name in ("logprobs", "old_logprobs") if name in payload}
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
        toks.append(t)
        masks.append(m)
        sample_of.append(np.full(padded, j, np.int64))
        lengths.append(length)
        doc_lens.append(padded)
    if not positions:  # empty micro-batch: one dummy token, no targets
        toks, masks, sample_of, doc_lens = [np.zeros(1, np.int64)], [np.zeros(1, np.float32)], [np.zeros(1, np.int64)], [1]
        per_token = {name: [np.zeros(1, np.float32)] for name in per_token}
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
    )


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
