"""Elastic data parallelism, run the way users run it: `trainingrun run` stopped and rerun with another --trainers
resumes (it used to exit 78), and the run continues as if nothing changed.

Two runs of one spec (a shortened examples/tiny.yaml with fixed steps of 3 groups, so rollouts hold several steps
and checkpoints fall inside rollouts; maxPendingRollouts 2, so rollouts are published ahead of training):
  ref      2 trainers, uninterrupted
  resized  2 trainers, stopped (SIGTERM) after its first checkpoint; rerun with 3 trainers, stopped after a
           checkpoint of that attempt once the rollout has published for 3 ranks; rerun with 2 trainers to the end.
           Each stop comes while a rollout published for the old size is still to be trained (checked with the
           trainers held still), so the next segment re-schedules it.
At each resize the trainers reshard the checkpoint (Megatron distributed checkpointing) and re-schedule the
rollouts published for the old size; the rollout schedules new ones for the new size. Checks: every step's loss
equals the reference within 1e-5 relative, with the same batch sizes, LR, samples and sample ids, and each segment
really trained at its size with re-scheduled rollouts (2→3 and 3→2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.localrun import finish, records, start, stop_held
from tests.services import metrics_ports

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300


def _spec(path: Path) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    s = doc["spec"]
    s["rollout"].update(numRollouts=6, samplesPerRollout=48, maxPendingRollouts=2,
                        steps={"policy": "fixed", "globalBatchSize": 3})
    s["trainer"]["checkpoint"] = {"interval": 4, "path": "checkpoints", "keep": 2}
    s["metrics"]["port"] = metrics_ports(4)
    s["failurePolicy"] = {"maxRestarts": 0, "backoffSeconds": 0, "progressDeadlineSeconds": 150}
    path.write_text(yaml.safe_dump(doc))
    return path


def _checkpoints(out: Path) -> list[dict]:
    found = []
    for d in sorted((out / "checkpoints").glob("step_*")):
        try:
            found.append(json.loads((d / "progress.json").read_text()))
        except (OSError, ValueError):
            continue  # being replaced
    return found


def _published_dp(out: Path) -> dict[int, int]:
    """{rollout: dp size it was published for} of the committed rollouts in the run's file store."""
    found = {}
    for commit in (out / "store" / "rollouts").glob("*/COMMIT"):
        try:
            found[int(commit.parent.name)] = int(json.loads(commit.read_text())["dp_size"])
        except (OSError, ValueError):
            continue
    return found


def _run_until(spec: Path, out: Path, trainers: int, holds) -> None:
    """Run with `trainers` until `holds()`, confirmed with the trainers held still (`stop_held`); then stop."""
    code, log = stop_held(start(spec, out, "--trainers", str(trainers)), out, holds,
                          f"the end of the {trainers}-trainer segment", timeout=TIMEOUT)
    assert code == 143, log[-3000:]


def _ahead_of_the_checkpoint(out: Path, attempt: int, dp: int) -> bool:
    """A checkpoint of `attempt` and, at or past the rollout it resumes at, a rollout published for `dp` ranks: the
    next segment must re-schedule it."""
    mine = [c for c in _checkpoints(out) if c["attempt"] == attempt]
    return bool(mine) and any(d == dp and k >= mine[-1]["rollout"] for k, d in _published_dp(out).items())


def test_resize_2_to_3_to_2_continues_the_run(tmp_path):
    spec = _spec(tmp_path / "run.yaml")
    code, log = finish(start(spec, tmp_path / "ref", "--trainers", "2"), timeout=TIMEOUT)
    assert code == 0, log[-3000:]
    ref = records(tmp_path / "ref")
    assert len(ref) >= 12

    out = tmp_path / "resized"
    _run_until(spec, out, 2, lambda: _ahead_of_the_checkpoint(out, 0, 2))
    _run_until(spec, out, 3, lambda: _ahead_of_the_checkpoint(out, 1, 3))
    code, log = finish(start(spec, out, "--trainers", "2"), timeout=TIMEOUT)
    assert code == 0, log[-3000:]

    got = records(out)  # the last attempt's record of each step
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    by_attempt: dict[int, set[int]] = {}
    for g, r in zip(got, ref, strict=True):
        by_attempt.setdefault(g["attempt"], set()).add(g["dp_size"])
        for key in ("global_batch_size", "samples_consumed", "rollout", "sample_id_sum", "loss_tokens"):
            assert g[key] == r[key], (key, g["step"])
        assert g["lr"] == pytest.approx(r["lr"], rel=1e-12), g["step"]
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5), (g["step"], g["dp_size"], g["loss"], r["loss"])
    # each attempt trained at its size, and each left steps that survived into the final record
    assert by_attempt == {0: {2}, 1: {3}, 2: {2}}, by_attempt
    logs = out / "logs"
    grow = (logs / "trainer-0.attempt1.log").read_text()
    shrink = (logs / "trainer-0.attempt2.log").read_text()
    assert "published for 2 data-parallel ranks, re-scheduled for 3 (same steps and samples)" in grow
    assert "resharded step_" in grow
    assert "written at data-parallel 2 / tensor-parallel 1 / pipeline-parallel 1, loaded at 3 / 1 / 1" in grow
    assert "published for 3 data-parallel ranks, re-scheduled for 2 (same steps and samples)" in shrink
    assert "data-parallel size changed from 2 to 3" in (logs / "rollout.attempt1.log").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == len(ref)
    print("resize 2->3->2: max relative loss difference "
          f"{max(abs(g['loss'] - r['loss']) / abs(r['loss']) for g, r in zip(got, ref)):.2e} over {len(ref)} steps")
