"""The trainers' progress record: what trainer rank 0 has trained so far (key `progress` of the run's store).

Written by trainer rank 0 after every optimizer step (`trainingrun.trainer.report.StepReporter`); read by the
operator (`trainingrun.operator.progress`) into the TrainingRun's status (step, samplesConsumed, lastGlobalBatchSize,
rollout) and for hang detection (`time`, progressDeadlineSeconds). Through the store, so trainer pods need no
Kubernetes API permission. Both sides go through `ProgressRecord`; nobody reads the JSON by its keys.

  {"step": int,                    optimizer steps completed (global)                    required
   "time": float,                  unix time of the write (year 1970 to 9999)            required
   "rollout": int,                 rollout being trained
   "samples_consumed": int,        samples trained on so far
   "last_global_batch_size": int,  samples in the last step
   "attempt": int,                 TRAININGRUN_ATTEMPT of the writer
   "loss": float, "lr": float,     the last step's loss and learning rate
   "tokens": int,                  tokens in the last step (all ranks)
   "samples_per_second": float}    the last step's throughput

The trainer writes every field. A reader requires `step` and `time` and takes the others when present (a record
written by hand, e.g. in a test, may carry fewer); a field present with a wrong type is refused naming it
(`CorruptPayload`), and fields it does not know are ignored.

`rollouts_done(rollout, total)`: how many of `total` rollouts a record of rollout `rollout` counts as trained (the
rollout in training counts), the one figure the local progress line and the operator's status.progress both show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainingrun.contract.errors import CorruptPayload
from trainingrun.contract.records import RecordStore, count, number, read_object

PROGRESS_KEY = "progress"
MAX_TIME = 253402300799.0  # 9999-12-31T23:59:59Z: the last second a datetime holds

_COUNTS = ("rollout", "samples_consumed", "last_global_batch_size", "attempt", "tokens")
_NUMBERS = ("loss", "lr", "samples_per_second")


def rollouts_done(rollout: int | None, total: int) -> int:
    """Rollouts trained by the time a step of rollout `rollout` (0-based; None: no step yet) is done, out of
    `total`: the rollout in training counts, never more than `total`."""
    return 0 if rollout is None else max(0, min(int(rollout) + 1, int(total)))


@dataclass(frozen=True)
class ProgressRecord:
    """Trainer rank 0's progress after its last step (see the module docstring)."""

    step: int
    time: float
    rollout: int | None = None
    samples_consumed: int | None = None
    last_global_batch_size: int | None = None
    attempt: int | None = None
    loss: float | None = None
    lr: float | None = None
    tokens: int | None = None
    samples_per_second: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The stored form: every field that is set."""
        names = ("step", "rollout", "last_global_batch_size", "loss", "lr", "samples_consumed", "tokens", "attempt",
                 "samples_per_second", "time")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @classmethod
    def from_json(cls, d: dict[str, Any], *, where: str = f"key {PROGRESS_KEY}") -> ProgressRecord:
        """The record of a stored JSON object; CorruptPayload naming `where` and the field when it is malformed."""
        if not isinstance(d, dict):
            raise CorruptPayload(f"{where}: must be a JSON object, got {type(d).__name__}")
        return cls(
            step=count(d, "step", where=where), time=number(d, "time", where=where, minimum=0.0, maximum=MAX_TIME),
            **{n: count(d, n, where=where, required=False) for n in _COUNTS},
            **{n: number(d, n, where=where, required=False) for n in _NUMBERS},
        )

    def write(self, store: RecordStore) -> None:
        store.put_json(PROGRESS_KEY, self.to_json())

    @classmethod
    def read(cls, store: RecordStore) -> ProgressRecord | None:
        """The record in `store` (None before the first step); CorruptPayload naming the field when malformed."""
        found = read_object(store, PROGRESS_KEY)
        return None if found is None else cls.from_json(found[0], where=found[1])
