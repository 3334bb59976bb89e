"""The rollout's unit of data: `SampleGroup`, the samples generated for one prompt.

A sample is a token sequence with a loss mask where `loss_mask[t] = 1` means token t is a training target, predicted
from the tokens before it (so `loss_mask[0]` is always 0), plus a reward and, for jsonl, optionally a given advantage.
Every source yields groups (`trainingrun.rollout.source`); the pipeline filters them whole, computes advantages within
a group and never splits one across steps (`trainingrun.rollout.pipeline`). A group's JSON form keeps the carried and
staged groups in the rollout's resume state (`trainingrun.rollout.loop`).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class SampleGroup:
    """The samples of one prompt. `advantages` is None until computed (or given by a jsonl source)."""

    group_id: int
    tokens: list[np.ndarray]  # int32 each
    loss_masks: list[np.ndarray]  # uint8 each
    rewards: np.ndarray  # float32 [n]
    sample_ids: np.ndarray  # int64 [n]
    advantages: np.ndarray | None = None  # float32 [n]
    has_reward: bool = True  # jsonl lines may give only an advantage
    # generated rollouts only: the generator's log-probability of each token (0 on the prompt) and weight versions
    logprobs: list[np.ndarray] | None = None  # float32 each, same length as the tokens
    versions: np.ndarray | None = None  # int64 [n]: each sample's oldest token's weight version
    # partial rollouts: the weight version of every token (-1 on the prompt), same length as the tokens
    token_versions: list[np.ndarray] | None = None
    # mixtures of experts with routing replay: the experts each token was routed to, int16 [tokens, layers × top-k]
    routed_experts: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]

    # ---- JSON form (rollout resume state): arrays as base64 of their little-endian bytes, never pickle
    def to_json(self) -> dict[str, Any]:
        offsets = np.zeros(len(self) + 1, np.int64)
        np.cumsum(self.lengths, out=offsets[1:])
        b64 = lambda a: base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()  # noqa: E731
        return {
            "group_id": int(self.group_id),
            "offsets": offsets.tolist(),
            "tokens": b64(np.concatenate(self.tokens).astype("<i4")),
            "loss_mask": b64(np.concatenate(self.loss_masks).astype(np.uint8)),
            "rewards": b64(self.rewards.astype("<f4")),
            "sample_ids": b64(self.sample_ids.astype("<i8")),
            "advantages": None if self.advantages is None else b64(self.advantages.astype("<f4")),
            "has_reward": self.has_reward,
            "logprobs": None if self.logprobs is None else b64(np.concatenate(self.logprobs).astype("<f4")),
            "versions": None if self.versions is None else b64(self.versions.astype("<i8")),
            **({} if self.routed_experts is None else {
                "routed_experts": b64(np.concatenate(self.routed_experts).astype("<i2")),
                "routed_width": int(self.routed_experts[0].shape[1])}),
            "token_versions": None if self.token_versions is None else b64(np.concatenate(self.token_versions)
                                                                              .astype("<i8")),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SampleGroup:
        dec = lambda s, dt: np.frombuffer(base64.b64decode(s), dtype=dt).copy()  # noqa: E731
        offsets = d["offsets"]
        tokens, masks = dec(d["tokens"], "<i4").astype(np.int32), dec(d["loss_mask"], np.uint8)
        spans = list(zip(offsets[:-1], offsets[1:]))
        return cls(
            group_id=int(d["group_id"]),
            tokens=[tokens[a:b] for a, b in spans],
            loss_masks=[masks[a:b] for a, b in spans],
            rewards=dec(d["rewards"], "<f4").astype(np.float32),
            sample_ids=dec(d["sample_ids"], "<i8").astype(np.int64),
            advantages=None if d.get("advantages") is None else dec(d["advantages"], "<f4").astype(np.float32),
            has_reward=bool(d.get("has_reward", True)),
            logprobs=None if d.get("logprobs") is None else
            [a.copy() for a in np.split(dec(d["logprobs"], "<f4").astype(np.float32), offsets[1:-1])],
            versions=None if d.get("versions") is None else dec(d["versions"], "<i8").astype(np.int64),
            routed_experts=None if d.get("routed_experts") is None else
            [a.copy() for a in np.split(dec(d["routed_experts"], "<i2").astype(np.int16).reshape(
                -1, int(d["routed_width"])), offsets[1:-1])],
            token_versions=None if d.get("token_versions") is None else
            [a.copy() for a in np.split(dec(d["token_versions"], "<i8").astype(np.int64), offsets[1:-1])],
        )
