"""A run's per-step history, read from its directory: what `trainingrun plot` and `trainingrun status` show; and its
evaluations on held-out prompts (`rollout.eval`): eval.jsonl, one record per evaluated weight version, which the
rollout rewrites whole from the store after each evaluation (`eval_records`).

A local run directory has `raw/trainer-metrics.attempt<k>.jsonl` (rank 0's records as each attempt wrote them, also
while the run is live) and `metrics.jsonl` (merged at the end of each attempt). A cluster's output directory (the
checkpoint volume) has one `metrics.jsonl` that every attempt appends to. Either way a step re-run after a restart
appears more than once, and the last record of a step wins.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainingrun.contract.errors import CorruptPayload
from trainingrun.contract.evaluation import EVAL_FILE, EvalRecord
from trainingrun.local.report import merge_metrics, read_records


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    """One record per step, in step order (the last attempt's record of a step wins); [] if there is none."""
    merged = merge_metrics(run_dir)
    if merged:
        return merged
    by_step: dict[int, dict[str, Any]] = {}
    for rec in read_records(run_dir / "metrics.jsonl"):
        by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def restart_steps(records: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(first step, attempt) where the attempt that wrote the records changes: the restarts a plot marks."""
    out = []
    prev = None
    for rec in records:
        a = rec.get("attempt")
        if prev is not None and a != prev:
            out.append((int(rec["step"]), int(a) if isinstance(a, int) else -1))
        prev = a
    return out


def eval_records(run_dir: Path) -> list[EvalRecord]:
    """The run's evaluations in weight-version order (the last line of a version wins; a malformed line, e.g. cut
    short, is skipped); [] without eval.jsonl."""
    by_version: dict[int, EvalRecord] = {}
    try:
        text = (run_dir / EVAL_FILE).read_text()
    except OSError:
        return []
    for line in text.splitlines():
        try:
            rec = EvalRecord.from_json(json.loads(line), where=str(run_dir / EVAL_FILE))
        except (ValueError, CorruptPayload):
            continue
        by_version[rec.weight_version] = rec
    return [by_version[v] for v in sorted(by_version)]
