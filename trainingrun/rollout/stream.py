"""The prompt stream of generated rollouts with over-sampling and partial rollouts (`rollout.overSampling`,
`rollout.partialRollout`): which prompts a source rollout asks the engine for, and what an abort leaves behind.

Prompts have positions 0, 1, 2, ... in the prompt source's sequence (`rollout/prompts.py`: source rollout i of
P = samplesPerRollout / groupSize prompts holds positions i·P .. i·P + P − 1, so `prompt_at` reads position p from
block p // P and the stream is the very sequence a run without over-sampling draws). A position is a prompt's group
id (its samples' ids are group id × groupSize + i), so ids stay unique and a prompt keeps its id when it is drawn
again.

    PromptStream   cursor     the next fresh position
                   returned   positions whose requests were aborted before they finished (without partial rollouts,
                              or never sent): drawn first, in ascending order, so nothing is lost or drawn out of order
                   partials   groups cut by an abort with partial rollouts (`PartialGroup`: each sample's tokens so
                              far, their log-probabilities and the weight version of every token), continued first

A source rollout takes its requests as: every partial group, then returned positions, then fresh ones, up to
P + ceil(overSampling · P) requests (`take`). The stream is part of the rollout's resume state
(`rollout/loop.py`: saved with the groups generated from it), so a restarted rollout draws the same requests and a
cut completion survives a restart.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainingrun.contract.engine import ABORTED, Completion


def extra_prompts(prompts_per_rollout: int, over_sampling: float) -> int:
    """Extra prompts drawn per source rollout: ceil(overSampling × P)."""
    return int(math.ceil(over_sampling * prompts_per_rollout - 1e-9)) if over_sampling > 0 else 0


def _b64(a: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(a.astype(dtype)).tobytes()).decode()


def _unb64(s: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), dtype=dtype).copy()


@dataclass
class PartialGroup:
    """A group cut by an abort (partial rollouts): one `Completion` per sample, finished or ABORTED."""

    position: int
    completions: list[Completion]

    @property
    def oldest_version(self) -> int:
        """The oldest weight version among its tokens (-1 without tokens)."""
        vs = [int(c.versions.min()) for c in self.completions if c.versions is not None and len(c.versions)]
        return min(vs, default=-1)

    @property
    def tokens(self) -> int:
        return sum(len(c.tokens) for c in self.completions)

    def to_json(self) -> dict[str, Any]:
        out = []
        for c in self.completions:
            versions = c.versions if c.versions is not None else np.zeros(len(c.tokens), np.int64)
            out.append({"tokens": _b64(c.tokens, "<i4"), "logprobs": _b64(c.logprobs, "<f4"),
                        "versions": _b64(versions, "<i8"), "finish_reason": c.finish_reason})
        return {"position": int(self.position), "completions": out}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PartialGroup:
        comps = []
        for c in d["completions"]:
            reason = str(c["finish_reason"])
            comps.append(Completion(tokens=_unb64(c["tokens"], "<i4").astype(np.int32),
                                    logprobs=_unb64(c["logprobs"], "<f4").astype(np.float32), finish_reason=reason,
                                    versions=_unb64(c["versions"], "<i8").astype(np.int64)))
        return cls(position=int(d["position"]), completions=comps)


@dataclass
class PromptStream:
    """See the module docstring."""

    cursor: int = 0
    returned: list[int] = field(default_factory=list)
    partials: list[PartialGroup] = field(default_factory=list)

    def take(self, count: int, *, end: int | None = None) -> tuple[list[PartialGroup], list[int]]:
        """The next `count` requests: (partial groups, then prompt positions: returned ones first, then fresh up to
        `end`, the source's length when it has one). The stream keeps what was not taken."""
        partials, self.partials = self.partials[:count], self.partials[count:]
        left = count - len(partials)
        positions, self.returned = self.returned[:left], self.returned[left:]
        fresh = left - len(positions)
        if end is not None:
            fresh = max(0, min(fresh, end - self.cursor))
        positions += list(range(self.cursor, self.cursor + fresh))
        self.cursor += fresh
        return partials, positions

    def give_back(self, positions: list[int], partials: list[PartialGroup]) -> None:
        """Aborted prompts back to the front (ascending), cut groups to be continued first (by position)."""
        self.returned = sorted(set(self.returned) | set(positions))
        self.partials = sorted(self.partials + partials, key=lambda p: p.position)

    def empty(self, end: int | None) -> bool:
        return not self.returned and not self.partials and end is not None and self.cursor >= end

    def to_json(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "returned": list(self.returned),
                "partials": [p.to_json() for p in self.partials]}

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> PromptStream:
        if d is None:
            return cls()
        return cls(cursor=int(d["cursor"]), returned=[int(x) for x in d["returned"]],
                   partials=[PartialGroup.from_json(p) for p in d["partials"]])

    def copy(self) -> PromptStream:
        return PromptStream.from_json(self.to_json())


def is_cut(completions: list[Completion]) -> bool:
    return any(c.finish_reason == ABORTED for c in completions)
