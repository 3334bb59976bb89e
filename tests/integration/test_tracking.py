"""Experiment tracking (trainingrun/tracking.py): what rank 0 writes, read back with the tools' own readers —
TensorBoard's EventAccumulator for event files, W&B's `wandb leet inspect --json` for offline run files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainingrun.api.spec.services import MetricsSpec
from trainingrun.tracking import (
    TrackingConfigError,
    numeric_fields,
    open_tracker,
    tracking_paths,
    wandb_run_id,
)


def records(steps, *, extra: str | None = None, attempt: int = 0):
    out = []
    for s in steps:
        rec = {"step": s, "rollout": s // 2, "global_batch_size": 30 + s, "loss": 5.0 / s, "lr": 1e-3 * s,
               "grad_norm": 0.5, "samples_consumed": 100 * s, "tokens": 1000, "attempt": attempt, "time": 1.7e9,
               "note": "text", "finished": True}
        if extra:
            rec[extra] = s * 7.0
        out.append(rec)
    return out


def read_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value}, as TensorBoard itself shows the directory (purged steps hidden)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_numeric_fields_are_every_number_but_step_and_time():
    rec = records([3], extra="reward_mean")[0]
    fields = numeric_fields(rec)
    assert set(fields) == {"rollout", "global_batch_size", "loss", "lr", "grad_norm", "samples_consumed", "tokens",
                           "attempt", "reward_mean"}
    assert fields["reward_mean"] == 21.0


def test_tensorboard_events_read_back_with_tensorboards_reader(tmp_path):
    spec = MetricsSpec()
    paths = tracking_paths(spec, checkpoint_dir=tmp_path / "ck", environ={"TRAININGRUN_OUTPUT_DIR": str(tmp_path)})
    assert paths.tensorboard == tmp_path / "tensorboard" and paths.metrics_jsonl is None
    warnings: list[str] = []
    t = open_tracker(spec, paths, run_name="r", resume_step=0, config={}, warn=warnings.append)
    for rec in records(range(1, 6), extra="policy_lag"):  # a field the trainer may add later appears as is
        t.log(rec)
    t.close()
    assert not warnings
    scalars = read_scalars(paths.tensorboard)
    assert scalars["loss"] == {s: pytest.approx(5.0 / s) for s in range(1, 6)}
    assert scalars["global_batch_size"] == {s: 30 + s for s in range(1, 6)}
    assert scalars["policy_lag"][4] == 28.0
    assert "time" not in scalars and "step" not in scalars and "note" not in scalars and "finished" not in scalars


def test_tensorboard_resume_purges_the_failed_attempts_later_steps(tmp_path):
    spec = MetricsSpec()
    paths = tracking_paths(spec, checkpoint_dir=tmp_path, environ={})
    # in a cluster: under the checkpoint directory, with a metrics.jsonl there
    assert paths.tensorboard == tmp_path / "tensorboard" and paths.metrics_jsonl == tmp_path / "metrics.jsonl"
    first = open_tracker(spec, paths, run_name="r", resume_step=0, config={})
    for rec in records(range(1, 8), attempt=0):  # attempt 0 logs 7 steps, then dies; its checkpoint is at step 4
        first.log(rec)
    first.close()
    second = open_tracker(spec, paths, run_name="r", resume_step=4, config={})
    for rec in records(range(5, 10), attempt=1):
        second.log(rec)
    second.close()
    attempt = read_scalars(paths.tensorboard)["attempt"]
    assert sorted(attempt) == list(range(1, 10)), "every step once"
    assert [attempt[s] for s in range(1, 10)] == [0, 0, 0, 0, 1, 1, 1, 1, 1]


def test_a_trainer_given_only_its_jsonl_path_keeps_the_history_beside_it(tmp_path):
    paths = tracking_paths(MetricsSpec(), checkpoint_dir=tmp_path / "ckpt",
                           environ={"TRAININGRUN_METRICS_JSONL": str(tmp_path / "out" / "m.jsonl")})
    assert paths.tensorboard == tmp_path / "out" / "tensorboard" and paths.metrics_jsonl is None
    assert paths.wandb_id_file == tmp_path / "ckpt" / "wandb-run-id"  # the W&B run id stays with the checkpoints


def test_tensorboard_off_and_custom_path(tmp_path):
    off = MetricsSpec.model_validate({"tensorboard": {"enabled": False}})
    assert tracking_paths(off, checkpoint_dir=tmp_path, environ={}).tensorboard is None
    custom = MetricsSpec.model_validate({"tensorboard": {"path": "tb/x"}})
    assert tracking_paths(custom, checkpoint_dir=tmp_path, environ={}).tensorboard == tmp_path / "tb" / "x"


def test_a_failing_writer_is_reported_once_and_dropped(tmp_path):
    warnings: list[str] = []
    paths = tracking_paths(MetricsSpec(), checkpoint_dir=tmp_path, environ={})
    t = open_tracker(MetricsSpec(), paths, run_name="r", resume_step=0, config={}, warn=warnings.append)
    t.writers[0].writer.close()

    class Broken:
        name = "broken"

        def log(self, step, fields):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    t.writers.append(Broken())
    for rec in records([1, 2, 3]):
        t.log(rec)
    assert len([w for w in warnings if "broken" in w]) == 1 and "No space left" in warnings[0]
    assert [w.name for w in t.writers] == ["tensorboard"]


def test_wandb_run_id_is_kept_with_the_checkpoints(tmp_path):
    first = wandb_run_id(tmp_path / "ck" / "wandb-run-id")
    assert len(first) == 8 and wandb_run_id(tmp_path / "ck" / "wandb-run-id") == first
    assert wandb_run_id(tmp_path / "other" / "wandb-run-id") != first


def test_wandb_without_the_package_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    spec = MetricsSpec.model_validate({"wandb": {"project": "p", "mode": "offline"}, "tensorboard": {"enabled": False}})
    with pytest.raises(TrackingConfigError, match="metrics.wandb: .*not installed"):
        open_tracker(spec, tracking_paths(spec, checkpoint_dir=tmp_path, environ={}), run_name="r", resume_step=0,
                     config={})


def inspect_wandb(path: Path) -> list[dict]:
    """Records of a .wandb file, read by W&B's own tool (`wandb leet inspect --json`)."""
    wandb_cli = Path(sys.executable).with_name("wandb")
    proc = subprocess.run([str(wandb_cli), "leet", "inspect", "--json", str(path)], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


WANDB_SCRIPT = """
import json, sys
from pathlib import Path
from trainingrun.api.spec.services import MetricsSpec
from trainingrun.tracking import open_tracker, tracking_paths
spec = MetricsSpec.model_validate({"wandb": {"project": "proj", "mode": "offline", "tags": ["t1"]}})
out, first, last = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
paths = tracking_paths(spec, checkpoint_dir=out / "checkpoints", environ={"TRAININGRUN_OUTPUT_DIR": str(out)})
warn = []
t = open_tracker(spec, paths, run_name="wb", resume_step=first - 1, config={"seed": 7}, warn=warn.append)
for s in range(first, last + 1):
    t.log({"step": s, "loss": 10.0 / s, "global_batch_size": 40 + s, "samples_consumed": 50 * s, "lr": 1e-3,
           "reward_mean": 0.25, "time": 0.0})
t.close()
print(json.dumps(warn))
"""


def test_wandb_offline_files_read_back_with_wandbs_own_tool_and_a_restart_continues_the_run(tmp_path):
    env = {**os.environ, "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true", "OMP_NUM_THREADS": "1"}
    for first, last in ((1, 3), (4, 6)):  # two attempts: the second resumes from a checkpoint at step 3
        proc = subprocess.run([sys.executable, "-c", WANDB_SCRIPT, str(tmp_path), str(first), str(last)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout.splitlines()[-1]) == []
    run_id = (tmp_path / "checkpoints" / "wandb-run-id").read_text().strip()
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files), files
    history = {}
    for f in files:
        recs = inspect_wandb(f)
        run = next(r["run"] for r in recs if r["type"] == "run")
        assert run["run_id"] == run_id and run["project"] == "proj" and run["config"]["update"]["seed"] == 7
        for r in recs:
            if r["type"] == "history":
                item = r["history"]["item"]
                history[int(r["history"]["step"]["num"])] = item
    assert sorted(history) == [1, 2, 3, 4, 5, 6]
    assert history[5]["loss"] == pytest.approx(2.0) and history[6]["global_batch_size"] == 46
    assert history[2]["reward_mean"] == 0.25 and "time" not in history[2]
