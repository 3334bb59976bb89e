"""What a rollout draws its samples from: the `Source` protocol and the replay sources' common part.

The sources, one module each: `synthetic` (`rollout/synthetic.py`) and `jsonl` (`rollout/jsonl.py`) replay samples
that are already generated and scored; `generate` (`rollout/generate.py`) has the policy generate them. The loop
picks one by `spec.rollout.source.type` (`rollout.loop.make_source`).
"""

from __future__ import annotations

from typing import Any, Protocol

from trainingrun.rollout.groups import SampleGroup


class Source(Protocol):
    """The first three stages of a rollout: draw prompts → generate → score.

    `draw(i)` returns source rollout i's prompts (None: the source is exhausted); `generate` turns them into groups
    of samples; `score` sets the groups' rewards. `close()` releases what the source holds (engine, reward workers).
    The replay sources (`synthetic`, `jsonl`: `ReplaySource`) draw samples that are already generated and scored.
    """

    def draw(self, index: int) -> Any | None: ...

    def generate(self, prompts: Any, rollout: int) -> list[SampleGroup]:
        """The samples of `prompts`, for published rollout `rollout` (generated sources pick the weights by it)."""

    def score(self, groups: list[SampleGroup]) -> None: ...

    def close(self) -> None: ...


class ReplaySource:
    """A source whose draws are samples already generated and scored: `generate` and `score` pass them through, and
    a source rollout is a pure function of (spec, i), so a rollout lost by the store can be rebuilt bit for bit."""

    replayable = True

    def generate(self, prompts: list[SampleGroup], rollout: int) -> list[SampleGroup]:
        return prompts

    def score(self, groups: list[SampleGroup]) -> None:
        pass

    def close(self) -> None:
        pass
