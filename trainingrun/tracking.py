"""Experiment tracking by step: TensorBoard event files and Weights & Biases, written by trainer rank 0.

Every numeric field of rank 0's per-step record (the object that goes to metrics.jsonl) is logged at that record's
`step`, so a field another part of the trainer adds to the record shows up without a change here. Booleans, strings,
`step` itself and the wall-clock `time` are not logged.

Where the history goes (`TrackingPaths`): the output directory is `TRAININGRUN_OUTPUT_DIR` when set (a local run sets
it to its run directory), else the directory of `TRAININGRUN_METRICS_JSONL` when that is set (a trainer started by
hand), else the checkpoint directory (in a cluster that is the shared checkpoint volume, so the history survives pod
restarts). Inside it: `tensorboard/` (or `spec.metrics.tensorboard.path`, relative to it),
`wandb/` (W&B's own files; offline runs are synced later with `wandb sync`), and in a cluster `metrics.jsonl` (each
attempt appends; the last record of a step wins, as in a local run's merge).

The rollout process writes its own history into the same output directory (`output_dir`): the evaluations of
`spec.rollout.eval` as TensorBoard scalars `eval/<field>` by step in `<tensorboard>/eval` (a run of its own beside the
trainer's; `eval_tracker`), eval.jsonl, and a judge's raw answers under judge/.

Restarts: TensorBoard gets `purge_step` = the first step after the resumed checkpoint, so the steps a failed attempt
logged after that checkpoint are hidden and the re-run steps replace them. The W&B run id is kept with the
checkpoints (`<checkpoint dir>/wandb-run-id`), so every attempt continues the same W&B run (`resume="allow"`).

Tracking never stops training: a writer that fails is reported once and dropped. A W&B section in the spec without
the `wandb` package installed is a configuration error (raised by `open_tracker`).
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainingrun.contract.env import ProcessEnv
from trainingrun.contract.errors import ConfigError
WANDB_ID_FILE = "wandb-run-id"
NOT_LOGGED = frozenset({"step", "time"})


class TrackingConfigError(ConfigError):
    """The tracking section of the spec cannot be honoured (e.g. W&B asked for, package missing): exit 78."""


def numeric_fields(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric fields (ints and floats, not bools), without `step` and `time`."""
    return {k: float(v) for k, v in record.items()
            if k not in NOT_LOGGED and isinstance(v, (int, float)) and not isinstance(v, bool)}


@dataclass(frozen=True)
class TrackingPaths:
    output_dir: Path
    tensorboard: Path | None  # None: TensorBoard off
    wandb_dir: Path
    wandb_id_file: Path
    metrics_jsonl: Path | None  # a cluster's per-step history file (None locally: the launcher merges raw files)


def tracking_paths(metrics_spec, *, checkpoint_dir: Path, environ: dict[str, str] | None = None) -> TrackingPaths:
    """Where rank 0 writes its history (see the module docstring)."""
    env = ProcessEnv.from_environ(environ)
    local_out, jsonl_env = env.output_dir, env.metrics_jsonl
    if local_out:
        out = Path(local_out)
    elif jsonl_env:  # a trainer started by hand with its JSONL path: the other history goes beside it
        out = Path(jsonl_env).parent
    else:  # a pod: the checkpoint volume
        out = checkpoint_dir
    jsonl = None if (local_out or jsonl_env) else out / "metrics.jsonl"
    return TrackingPaths(out, tensorboard_dir(metrics_spec, out), out, checkpoint_dir / WANDB_ID_FILE, jsonl)


def tensorboard_dir(metrics_spec, out: Path) -> Path | None:
    """The TensorBoard directory under the output directory `out` (None: TensorBoard off)."""
    tb = metrics_spec.tensorboard
    return out / (tb.path or "tensorboard") if tb.enabled else None  # an absolute path replaces `out`


def output_dir(spec, environ: dict[str, str] | None = None) -> Path:
    """The output directory of a process of the run `spec` (see the module docstring)."""
    return tracking_paths(spec.metrics, checkpoint_dir=Path(spec.trainer.checkpoint.path), environ=environ).output_dir


def wandb_run_id(id_file: Path) -> str:
    """The W&B run id kept with the checkpoints; created (8 random hex digits) on first use."""
    try:
        existing = id_file.read_text().strip()
    except FileNotFoundError:
        existing = ""
    if existing:
        return existing
    run_id = secrets.token_hex(4)
    id_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = id_file.with_name(f".{id_file.name}.tmp{os.getpid()}")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, id_file)
    return run_id


class _TensorBoard:
    name = "tensorboard"

    def __init__(self, log_dir: Path, purge_step: int | None):
        from torch.utils.tensorboard import SummaryWriter  # deferred: torch

        log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step, flush_secs=30)

    def log(self, step: int, fields: dict[str, float]) -> None:
        for key, value in fields.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    name = "wandb"

    def __init__(self, spec, *, run_name: str, run_id: str, wandb_dir: Path, config: dict[str, Any]):
        import wandb  # deferred: wandb

        wandb_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=spec.project, entity=spec.entity, name=spec.name or run_name, group=spec.group,
            tags=list(spec.tags) or None, mode=spec.mode, id=run_id, resume="allow", dir=str(wandb_dir),
            config=config, settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        # lr against samples consumed: the scheduler advances by samples, and the batch size varies per step
        self.run.define_metric("samples_consumed")
        self.run.define_metric("lr", step_metric="samples_consumed")

    def log(self, step: int, fields: dict[str, float]) -> None:
        self.run.log({k: v for k, v in fields.items() if math.isfinite(v)}, step=step)

    def close(self) -> None:
        self.run.finish()


class Tracker:
    """Logs rank 0's per-step records to every configured writer; a failing writer is reported once and dropped."""

    def __init__(self, writers: list[Any], warn: Callable[[str], None] = print):
        self.writers = list(writers)
        self.warn = warn

    def log(self, record: dict[str, Any]) -> None:
        fields = numeric_fields(record)
        step = int(record["step"])
        for w in list(self.writers):
            self._call(w, "log", step, fields)

    def close(self) -> None:
        for w in list(self.writers):
            self._call(w, "close")
        self.writers = []

    def _call(self, writer, method: str, *args) -> None:
        try:
            getattr(writer, method)(*args)
        except Exception as exc:  # noqa: BLE001 - tracking must never stop training
            self.warn(f"warning: {writer.name} {method} failed, {writer.name} is turned off for this attempt: "
                      f"{type(exc).__name__}: {exc}")
            if writer in self.writers:
                self.writers.remove(writer)


def eval_tracker(metrics_spec, out: Path, warn: Callable[[str], None] = print) -> Tracker:
    """The rollout's TensorBoard writer of its evaluations (`<tensorboard>/eval`; no W&B: the run's W&B run is
    trainer rank 0's). Records logged to it carry `step` and fields named `eval/<name>`."""
    tb = tensorboard_dir(metrics_spec, out)
    writers: list[Any] = []
    if tb is not None:
        try:
            writers.append(_TensorBoard(tb / "eval", purge_step=None))
        except ImportError as exc:
            warn(f"warning: TensorBoard event files of the evaluations are off: {exc}")
        except OSError as exc:
            warn(f"warning: TensorBoard event files of the evaluations are off: cannot write {tb / 'eval'}: {exc}")
    return Tracker(writers, warn=warn)


def open_tracker(metrics_spec, paths: TrackingPaths, *, run_name: str, resume_step: int, config: dict[str, Any],
                 warn: Callable[[str], None] = print) -> Tracker:
    """The tracker for rank 0. `resume_step`: global steps in the checkpoint resumed from (0 for a fresh start).

    Raises TrackingConfigError when W&B is configured but the package is missing; a writer that cannot start
    otherwise (a W&B login or network problem, an unwritable directory) is a warning and tracking goes on without it.
    """
    writers: list[Any] = []
    if paths.tensorboard is not None:
        try:
            writers.append(_TensorBoard(paths.tensorboard, purge_step=resume_step + 1 if resume_step else None))
        except ImportError as exc:
            warn(f"warning: TensorBoard event files are off: {exc} (install trainingrun[train], or set "
                 "spec.metrics.tensorboard.enabled: false)")
        except OSError as exc:
            warn(f"warning: TensorBoard event files are off: cannot write {paths.tensorboard}: {exc}")
    wb = metrics_spec.wandb
    if wb is not None:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise TrackingConfigError("metrics.wandb: set, but the wandb package is not installed "
                                      "(pip install 'trainingrun[wandb]')") from None
        try:
            run_id = wandb_run_id(paths.wandb_id_file)
            writers.append(_Wandb(wb, run_name=run_name, run_id=run_id, wandb_dir=paths.wandb_dir, config=config))
        except Exception as exc:  # noqa: BLE001 - W&B raises its own types for login/network trouble
            warn(f"warning: W&B logging is off for this attempt: {type(exc).__name__}: {exc}")
    return Tracker(writers, warn=warn)
