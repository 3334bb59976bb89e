"""The rollout's unit of data: `SampleGroup`, the samples generated for one prompt.

A sample is a token sequence with a loss mask where `loss_mask[t] = 1` means token t is a training target, predicted
from the tokens before it (so `loss_mask[0]` is always 0), plus a reward and, for jsonl, optionally a given advantage.
Its arrays are the fields of one table (`trainingrun.contract.fields.FIELDS`: tokens, loss masks, rewards, sample
ids, advantages, and what a generator adds); a group holds them as a `SampleArrays`. Every source yields groups
(`trainingrun.rollout.source`); the pipeline filters them whole, computes advantages within a group and never splits
one across steps (`trainingrun.rollout.pipeline`). A group's JSON form keeps the carried and staged groups in the
rollout's resume state (`trainingrun.rollout.loop`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainingrun.contract.fields import SampleArrays, arrays_from_json, arrays_to_json


class SampleGroup(SampleArrays):
    """The samples of one prompt. `advantages` is None until computed (or given by a jsonl source); `has_reward` is
    False when a jsonl line gave only an advantage. The fields a generator adds (`logprobs=`, `versions=`,
    `token_versions=`, `routed_experts=`, ...: the table's) are keyword arguments."""

    def __init__(self, group_id: int, tokens: list[np.ndarray], loss_masks: list[np.ndarray], rewards: np.ndarray,
                 sample_ids: np.ndarray, advantages: np.ndarray | None = None, has_reward: bool = True,
                 **fields: Any):
        super().__init__(tokens=tokens, loss_masks=loss_masks, rewards=rewards, sample_ids=sample_ids,
                         advantages=advantages, **fields)
        self.group_id = group_id
        self.has_reward = has_reward

    # ---- JSON form (rollout resume state): arrays as base64 of their little-endian bytes, never pickle
    def to_json(self) -> dict[str, Any]:
        return {"group_id": int(self.group_id), "has_reward": self.has_reward, **arrays_to_json(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SampleGroup:
        group = cls(int(d["group_id"]), [], [], np.zeros(0, np.float32), np.zeros(0, np.int64),
                    has_reward=bool(d.get("has_reward", True)))
        group.values = arrays_from_json(d)
        return group
