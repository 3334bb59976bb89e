"""The rollout's state record: where the rollout is, and the account of its data (key `rollout_state` of the store).

Written by the rollout (`trainingrun.rollout.loop`) whenever its state moves (a source rollout staged, carried or
published, the end); read by the rollout when it restarts (it continues exactly where it was) and by the local
launcher (`DataAccount`: the `data` of summary.json — what was produced, filtered, published and left over). Both
sides go through `RolloutStateRecord`; nobody reads the JSON by its keys.

  {"version": 1,                         the record's format                                        required
   "fingerprint": str,                   hash of what decides the published data (another spec is
                                         refused on resume)                                         required
   "next_rollout": int,                  rollouts published                                         required
   "source_index": int,                  source rollouts drawn                                      required
   "step_offset": int,                   optimizer steps published                                  required
   "samples_offset": int,                samples published                                          required
   "carried": [group, ...],              filtered groups waiting for a step                         required
   "empty_streak": int,                  source rollouts in a row that published nothing
   "totals": {name: int},                samples produced ("produced") and dropped by each filter   required
   "finished": bool,                     the rollout ended (numRollouts published, or the source)   required
   "staged": [group, ...] | null,        generated and scored groups of source rollout source_index
   "stream": object | null,              over-sampling: the prompt stream before that source rollout
   "staged_stream": object | null,       ... and after it
   "eval_last": int | null,              rollout.eval: the last weight version evaluated (null: none yet)
   "step_offsets": [int, ...],           step_offset at the start of each of the last maxPolicyLag + 1
                                         rollouts, oldest first (an evaluation's step)
   "updated_at": float}                  unix time of the write

A group is the rollout's `SampleGroup` in its JSON form (`trainingrun.rollout.groups`), opaque here except for its
`offsets` (n + 1 token offsets: the group holds n samples), which the data account counts. A field present with a
wrong type is refused naming it (`CorruptPayload`, exit 78); fields the reader does not know are ignored.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainingrun.contract.errors import CorruptPayload
from trainingrun.contract.records import RecordStore, count, number, read_object

ROLLOUT_STATE_KEY = "rollout_state"
ROLLOUT_STATE_VERSION = 1

_COUNTS = ("next_rollout", "source_index", "step_offset", "samples_offset")


def _groups(d: dict[str, Any], name: str, *, where: str, required: bool) -> tuple[dict[str, Any], ...] | None:
    """Field `name`: a list of group objects, each with its `offsets` (a list of at least one integer)."""
    value = d.get(name)
    if value is None:
        if required:
            raise CorruptPayload(f"{where}: {name} is missing (a list of groups)")
        return None
    if not isinstance(value, list):
        raise CorruptPayload(f"{where}: {name} must be a list of groups, got {type(value).__name__}")
    for i, g in enumerate(value):
        offsets = g.get("offsets") if isinstance(g, dict) else None
        if not isinstance(offsets, list) or not offsets:
            raise CorruptPayload(f"{where}: {name}[{i}].offsets must be a list of token offsets, got {offsets!r:.80}")
    return tuple(value)


def _optional_object(d: dict[str, Any], name: str, *, where: str) -> dict[str, Any] | None:
    value = d.get(name)
    if value is not None and not isinstance(value, dict):
        raise CorruptPayload(f"{where}: {name} must be a JSON object or null, got {type(value).__name__}")
    return value


def _counts(d: dict[str, Any], name: str, *, where: str) -> tuple[int, ...]:
    """Field `name`: a list of integers >= 0 (absent: empty)."""
    value = d.get(name) or []
    if not isinstance(value, list):
        raise CorruptPayload(f"{where}: {name} must be a list of integers, got {type(value).__name__}")
    return tuple(count({name: v}, name, where=f"{where}: {name}[{i}]") for i, v in enumerate(value))


@dataclass(frozen=True)
class DataAccount:
    """What happened to the run's data so far (from the rollout's state): samples produced, dropped by each filter,
    published (trained), and the groups still carried — at the end of a run these were never published: they did not
    fill a step (`leftover_groups`, `leftover_samples`)."""

    finished: bool
    rollouts_published: int
    source_rollouts: int
    steps_published: int
    samples_published: int
    samples_produced: int
    samples_filtered: Mapping[str, int]
    leftover_groups: int
    leftover_samples: int

    @property
    def left_over(self) -> bool:
        """The rollout ended with samples that never filled a step."""
        return self.finished and self.leftover_samples > 0

    def to_json(self) -> dict[str, Any]:
        """The `data` object of summary.json."""
        return {
            "finished": self.finished, "rollouts_published": self.rollouts_published,
            "source_rollouts": self.source_rollouts, "steps_published": self.steps_published,
            "samples_published": self.samples_published, "samples_produced": self.samples_produced,
            "samples_filtered": dict(self.samples_filtered), "leftover_groups": self.leftover_groups,
            "leftover_samples": self.leftover_samples,
        }


@dataclass(frozen=True)
class RolloutStateRecord:
    """The rollout's state as stored (see the module docstring)."""

    fingerprint: str
    next_rollout: int = 0
    source_index: int = 0
    step_offset: int = 0
    samples_offset: int = 0
    carried: tuple[dict[str, Any], ...] = ()
    empty_streak: int = 0
    totals: Mapping[str, int] = field(default_factory=dict)
    finished: bool = False
    staged: tuple[dict[str, Any], ...] | None = None
    stream: dict[str, Any] | None = None
    staged_stream: dict[str, Any] | None = None
    eval_last: int | None = None
    step_offsets: tuple[int, ...] = ()
    updated_at: float | None = None  # set by `to_json` when None

    def to_json(self) -> dict[str, Any]:
        """The stored form (`updated_at`: now unless set)."""
        return {
            "version": ROLLOUT_STATE_VERSION, "fingerprint": self.fingerprint, "next_rollout": self.next_rollout,
            "source_index": self.source_index, "step_offset": self.step_offset,
            "samples_offset": self.samples_offset, "carried": list(self.carried),
            "empty_streak": self.empty_streak, "totals": dict(self.totals), "finished": self.finished,
            "staged": None if self.staged is None else list(self.staged),
            "stream": self.stream, "staged_stream": self.staged_stream,
            "eval_last": self.eval_last, "step_offsets": list(self.step_offsets),
            "updated_at": time.time() if self.updated_at is None else self.updated_at,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any], *, where: str = f"key {ROLLOUT_STATE_KEY}") -> RolloutStateRecord:
        """The record of a stored JSON object; CorruptPayload naming `where` and the field when it is malformed."""
        if not isinstance(d, dict):
            raise CorruptPayload(f"{where}: must be a JSON object, got {type(d).__name__}")
        if d.get("version") != ROLLOUT_STATE_VERSION:
            raise CorruptPayload(f"{where}: unknown state version {d.get('version')!r} (expected "
                                 f"{ROLLOUT_STATE_VERSION})")
        fingerprint, finished, totals = d.get("fingerprint"), d.get("finished"), d.get("totals")
        if not isinstance(fingerprint, str):
            raise CorruptPayload(f"{where}: fingerprint must be a string, got {fingerprint!r:.80}")
        if not isinstance(finished, bool):
            raise CorruptPayload(f"{where}: finished must be true or false, got {finished!r:.80}")
        if not isinstance(totals, dict):
            raise CorruptPayload(f"{where}: totals must be an object of sample counts, got {totals!r:.80}")
        return cls(
            fingerprint=fingerprint, **{n: count(d, n, where=where) for n in _COUNTS},
            carried=_groups(d, "carried", where=where, required=True),
            empty_streak=count(d, "empty_streak", where=where, required=False) or 0,
            totals={k: count(totals, k, where=f"{where}: totals") for k in totals}, finished=finished,
            staged=_groups(d, "staged", where=where, required=False),
            stream=_optional_object(d, "stream", where=where),
            staged_stream=_optional_object(d, "staged_stream", where=where),
            eval_last=count(d, "eval_last", where=where, required=False) if d.get("eval_last") is not None else None,
            step_offsets=_counts(d, "step_offsets", where=where),
            updated_at=number(d, "updated_at", where=where, required=False),
        )

    def write(self, store: RecordStore) -> None:
        store.put_json(ROLLOUT_STATE_KEY, self.to_json())

    @classmethod
    def read(cls, store: RecordStore) -> RolloutStateRecord | None:
        """The record in `store` (None before the rollout stored one); CorruptPayload naming the field when
        malformed."""
        found = read_object(store, ROLLOUT_STATE_KEY)
        return None if found is None else cls.from_json(found[0], where=found[1])

    def account(self) -> DataAccount:
        """The account of the run's data this state gives."""
        return DataAccount(
            finished=self.finished, rollouts_published=self.next_rollout, source_rollouts=self.source_index,
            steps_published=self.step_offset, samples_published=self.samples_offset,
            samples_produced=int(self.totals.get("produced", 0)),
            samples_filtered={k: int(v) for k, v in self.totals.items() if k != "produced"},
            leftover_groups=len(self.carried), leftover_samples=sum(len(g["offsets"]) - 1 for g in self.carried),
        )


def data_account(store: RecordStore) -> DataAccount | None:
    """The account of the run's data from the rollout's stored state (None before the rollout stored one)."""
    record = RolloutStateRecord.read(store)
    return None if record is None else record.account()
