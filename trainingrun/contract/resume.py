"""The trainers' resume point: where trainer rank 0 resumes from its newest checkpoint (key `trainer_resume`).

Written by trainer rank 0 as soon as it has loaded its checkpoint (`Trainer.resume`); read by the rollout, which
re-creates a stream the store lost up to that point (`trainingrun.rollout.recovery`, docs/store.md "Lost data").

  {"rollout": int,           rollout holding the next step to train
   "step_in_rollout": int,   index of that step within the rollout
   "global_step": int,       optimizer steps trained before it
   "samples_consumed": int,  samples trained before it
   "attempt": int}           TRAININGRUN_ATTEMPT of the writer
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from trainingrun.contract.records import RecordStore, count, read_object

RESUME_KEY = "trainer_resume"


@dataclass(frozen=True)
class ResumePoint:
    """Where the trainers resume (from their newest checkpoint): rollout `rollout`, its step `step_in_rollout`;
    `global_step` optimizer steps and `samples_consumed` samples trained before; written by trainer rank 0 of
    attempt `attempt`."""

    rollout: int
    step_in_rollout: int
    global_step: int
    samples_consumed: int
    attempt: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def write(self, store: RecordStore) -> None:
        store.put_json(RESUME_KEY, self.to_json())

    @classmethod
    def read(cls, store: RecordStore) -> ResumePoint | None:
        """The trainers' resume point (None when they have not written one); CorruptPayload naming the field when
        the stored record is malformed."""
        found = read_object(store, RESUME_KEY)
        if found is None:
            return None
        d, where = found
        return cls(**{f.name: count(d, f.name, where=where) for f in fields(cls)})
