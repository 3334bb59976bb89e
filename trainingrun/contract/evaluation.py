"""The evaluations of a run (`spec.rollout.eval`): one record per evaluated weight version, kept in the store (key
`eval`) and written as `eval.jsonl` (one line per record, by weight version) into the output directory.

Written by the rollout (`trainingrun.rollout.evaluate`), which also reads the stored list back when it restarts: a
version already in it is never evaluated again, so an evaluation is neither repeated nor skipped across a crash (the
schedule itself is in the rollout's state, `contract.rollout_state`). Read by the run-directory tools
(`trainingrun status`, `trainingrun plot`) from eval.jsonl, through `EvalRecord.from_json`.

  {"version": 1, "records": [record, ...]}   key `eval`, records in weight-version order
  record = {"step": int,                 optimizer steps trained into the weights (metrics.jsonl's step of the last
                                         of them; 0: the initial weights)                              required
            "weight_version": int,       the version evaluated (rollouts trained into it)              required
            "rollout": int,              the rollout before which it ran (numRollouts: the final one)  required
            "reward_mean": float,        mean reward over every completion                             required
            "pass_at_1": float,          unbiased pass@1 (a completion passes at reward >= passThreshold) required
            "pass_at_k": float,          unbiased pass@k over the samplesPerPrompt completions          required
            "k": int,                    samplesPerPrompt                                              required
            "prompts": int,              prompts evaluated                                             required
            "samples": int,              completions scored (prompts x k)
            "response_length_mean": float,  completion tokens per completion                           required
            "rewards_failed": int,       completions whose reward failed (failedReward)
            "seconds": float,            wall time of the evaluation: generation and scoring (not the wait for
                                         the weights)
            "time": float}               unix time it ended

A field present with a wrong type is refused naming it (`CorruptPayload`); fields the reader does not know are
ignored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any

from trainingrun.contract.errors import CorruptPayload
from trainingrun.contract.records import RecordStore, count, number, read_object

EVAL_KEY = "eval"
EVAL_VERSION = 1
EVAL_FILE = "eval.jsonl"

_INTS = ("step", "weight_version", "rollout", "k", "prompts", "samples", "rewards_failed")
_FLOATS = ("reward_mean", "pass_at_1", "pass_at_k", "response_length_mean", "seconds", "time")
_REQUIRED = ("step", "weight_version", "rollout", "reward_mean", "pass_at_1", "pass_at_k", "k", "prompts",
             "response_length_mean")


@dataclass(frozen=True)
class EvalRecord:
    """One evaluation (see the module docstring)."""

    step: int
    weight_version: int
    rollout: int
    reward_mean: float
    pass_at_1: float
    pass_at_k: float
    k: int
    prompts: int
    response_length_mean: float
    samples: int = 0
    rewards_failed: int = 0
    seconds: float = 0.0
    time: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, d: Any, *, where: str = f"key {EVAL_KEY}") -> EvalRecord:
        """The record of a JSON object; CorruptPayload naming `where` and the field when it is malformed."""
        if not isinstance(d, dict):
            raise CorruptPayload(f"{where}: an evaluation must be a JSON object, got {type(d).__name__}")
        values: dict[str, Any] = {}
        for name in _INTS:
            v = count(d, name, where=where, required=name in _REQUIRED)
            if v is not None:
                values[name] = v
        for name in _FLOATS:
            v = number(d, name, where=where, required=name in _REQUIRED)
            if v is not None:
                values[name] = v
        return cls(**values)


def read_evals(store: RecordStore) -> list[EvalRecord]:
    """The stored evaluations in weight-version order ([] before the first); CorruptPayload when malformed."""
    found = read_object(store, EVAL_KEY)
    if found is None:
        return []
    d, where = found
    if d.get("version") != EVAL_VERSION or not isinstance(d.get("records"), list):
        raise CorruptPayload(f"{where}: expected {{'version': {EVAL_VERSION}, 'records': [...]}}")
    records = [EvalRecord.from_json(r, where=f"{where}: records[{i}]") for i, r in enumerate(d["records"])]
    return sorted(records, key=lambda r: r.weight_version)


def write_evals(store: RecordStore, records: list[EvalRecord]) -> None:
    """Store `records` (one per weight version: a later record of a version replaces the earlier)."""
    by_version = {r.weight_version: r for r in records}
    store.put_json(EVAL_KEY, {"version": EVAL_VERSION, "updated_at": time.time(),
                              "records": [by_version[v].to_json() for v in sorted(by_version)]})
