"""A rank's part of a published rollout: `RankPayload`, the numpy arrays the rollout writes and trainer rank r reads.

Its arrays are the sample fields of `trainingrun.contract.fields.FIELDS` that travel on the wire (every row but the
trainer's own), flat over the rank's samples, plus `offsets`; `PAYLOAD_FIELDS` / `PAYLOAD_OPTIONAL` (name → dtype)
are derived from that table, and a test keeps the list below equal to it.

RankPayload (rank r's part of rollout k; arrays in `partitions[r]` order, i.e. the rank's samples in micro-batch
order, flat over the rollout's steps):
  tokens      int32   [total tokens]   all samples' tokens, concatenated
  offsets     int64   [n + 1]          sample i is tokens[offsets[i]:offsets[i+1]]
  loss_mask   uint8   [total tokens]   1 where the token's prediction is trained (target positions)
  advantages  float32 [n]              per-sample advantage (policy_gradient) or reward
  rewards     float32 [n]              per-sample raw reward
  sample_ids  int64   [n]              global sample ids (rollout-unique), for exactly-once checks
Optional (generated rollouts, `rollout.source.type: generate`):
  logprobs    float32 [total tokens]   the generator's log-probability of each token (0 where loss_mask is 0)
  versions    int64   [n]              weight version each sample was generated with (its oldest token's)
  routed_experts int16 [total tokens × W] mixtures of experts with `trainer.moe.routingReplay`: the experts the
                                       generator routed each token to, W = MoE layers × top-k per token (layer-major:
                                       token t, layer l, choice c at t·W + l·k + c); −1 where it routed none (the
                                       last token, which it never fed back) — the trainer's router then chooses
Optional (partial rollouts, `rollout.partialRollout`):
  token_versions int64 [total tokens]  the weight version of every token (-1 on the prompt)

Built by `trainingrun.contract.published.rank_payload`; encoded and checked by the store (`trainingrun.store.wire`:
raw little-endian arrays, never pickled).
"""

from __future__ import annotations

import numpy as np

from trainingrun.contract.fields import NOT_ROUTED, PAYLOAD_FIELDS, PAYLOAD_OPTIONAL

__all__ = ["NOT_ROUTED", "PAYLOAD_FIELDS", "PAYLOAD_OPTIONAL", "RankPayload", "token_width"]


def token_width(payload: dict[str, np.ndarray], name: str) -> int:
    """How many entries per token a per-token field holds (1, or W for `routed_experts`); ValueError naming the
    field when its length is not a multiple of the tokens."""
    total = len(payload["tokens"])
    n = len(payload[name])
    if total == 0:
        return 1 if n == 0 else 0
    if n % total:
        raise ValueError(f"{name}: length {n} is not a multiple of len(tokens)={total}")
    return n // total

RankPayload = dict[str, np.ndarray]
