"""`trainingrun run FILE.yaml [--out DIR] [--trainers N]`: run a whole TrainingRun on this machine.

The command line: load and check the spec (`--trainers` applied), then hand it to the `Launcher`
(`trainingrun.local.launcher`), print the summary table and, for a failed run, the failing process and its log tail.
See the package docstring (`trainingrun.local`) and docs/local.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainingrun.api import load_trainingrun
from trainingrun.api.yamlcodec import ManifestError, parse_yaml
from trainingrun.cliargs import positive_seconds, seconds
from trainingrun.diskspace import describe
from trainingrun.local.history import eval_records, step_records
from trainingrun.local.launcher import LAUNCHER_LOG, Launcher, already_succeeded, spec_yaml
from trainingrun.local.plot import PLOT_FILE, write_plot
from trainingrun.local.report import summary_table
from trainingrun.local.progress import ProgressLine
from trainingrun.local.rundir import (
    RunDirBusy,
    RunDirLock,
    check_out_dir,
    clear_for_fresh,
    is_run_dir,
    resize_only,
    spec_change,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="TrainingRun manifest (YAML)")
    parser.add_argument("--out", metavar="DIR", help="run directory (default: runs/<metadata.name>); "
                        "running again with the same DIR resumes from its checkpoints")
    parser.add_argument("--trainers", type=int, metavar="N", help="trainer processes (overrides spec.trainer.replicas)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                        help="override one field before validation, e.g. --set trainer.optimizer.lr=1e-4 (PATH is "
                             "under spec unless it starts with spec. or metadata.; VALUE is a YAML scalar); "
                             "repeatable")
    parser.add_argument("--grace-seconds", type=seconds, default=15.0, metavar="S",
                        help="how long children get to exit after SIGTERM before SIGKILL (default 15)")
    parser.add_argument("--progress-interval", type=positive_seconds, default=5.0, metavar="S",
                        help="seconds between plain progress lines when stdout is not a terminal (default 5)")
    parser.add_argument("--no-plot", dest="plot", action="store_false",
                        help="do not draw RUN_DIR/plot.png when the run ends (about 2 s of matplotlib; `trainingrun "
                             "plot DIR` draws it later)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true",
                      help="continue the run in DIR from its checkpoints, also when the spec changed (e.g. more "
                           "rollouts); without it a changed spec is refused, showing the difference")
    mode.add_argument("--fresh", action="store_true",
                      help="delete the earlier run in DIR (checkpoints, store, logs, metrics) and start over")


# ------------------------------------------------------------------------------------------------ spec handling
def parse_overrides(items: list[str]) -> dict[str, object]:
    """`--set PATH=VALUE` arguments as {"spec.PATH": value}. VALUE goes through the manifest loader's YAML parser
    (its limits and scalar rules: `8` is an integer, `1e-4` a float, `true` a boolean, `"8"` a string);
    ValueError naming the argument when one is malformed."""
    out: dict[str, object] = {}
    for item in items:
        path, sep, text = item.partition("=")
        path = path.strip()
        if not sep or not path or any(not part for part in path.split(".")):
            raise ValueError(f"--set {item}: expected PATH=VALUE, e.g. --set trainer.optimizer.lr=1e-4")
        if not path.startswith(("spec.", "metadata.")):
            path = f"spec.{path}"
        try:
            docs = parse_yaml(text, f"--set {path}")
        except ManifestError as exc:
            raise ValueError(str(exc)) from None
        if len(docs) != 1:
            raise ValueError(f"--set {item}: VALUE must be one YAML value (empty or several documents given)")
        out[path] = docs[0].value
    return out


def load_effective_run(path: str, trainers: int | None, overrides: list[str] | None = None):
    """The TrainingRun in `path` with `--set` and `--trainers` applied before validation, through the one strict
    loader; ManifestError (a ValueError) with the same one-line errors `trainingrun validate` prints."""
    changes = parse_overrides(overrides or [])
    if trainers is not None:
        changes["spec.trainer.replicas"] = trainers
    try:
        return load_trainingrun(path, overrides=changes or None)
    except ManifestError as exc:
        # a problem with an overridden value is the command line's, not the file line that held the old value
        flags = {p: ("--trainers" if p == "spec.trainer.replicas" and trainers is not None else f"--set {p}")
                 for p in changes}
        lines = []
        for line in exc.lines:
            where, sep, rest = line.partition(": ")
            field = rest.partition(": ")[0]
            lines.append(f"{flags[field]}: {rest}" if sep and field in flags else line)
        raise ManifestError(lines) from None


def resolve_input_paths(run, base: Path):
    """`run` with a relative `rollout.source.jsonl.path`, `model.hf`, `model.adapter` and the agent command's arguments
    that name a file there made absolute against `base` (the directory the user ran `trainingrun run` in). Children
    run in the output directory, where a relative input path would not be found; output paths
    (`trainer.checkpoint.path`) stay relative to the output directory on purpose."""
    spec = run.spec
    source = spec.rollout.source
    if source.type == "jsonl" and source.jsonl is not None and not Path(source.jsonl.path).is_absolute():
        jsonl = source.jsonl.model_copy(update={"path": str((base / source.jsonl.path).resolve())})
        rollout = spec.rollout.model_copy(update={"source": source.model_copy(update={"jsonl": jsonl})})
        spec = spec.model_copy(update={"rollout": rollout})
    for name in ("hf", "adapter"):  # model.hf, model.adapter (a PEFT directory, trainer.lora)
        value = getattr(spec.model, name)
        if value is not None and not Path(value).is_absolute():
            spec = spec.model_copy(update={"model": spec.model.model_copy(
                update={name: str((base / value).resolve())})})
    g = spec.rollout.source.generate
    if g is not None and g.agent is not None and g.agent.command is not None:
        # the agent's command: arguments naming a file or directory relative to `base` (its script) made absolute
        argv = [str((base / a).resolve()) if not Path(a).is_absolute() and (base / a).exists() else a
                for a in g.agent.command]
        if argv != g.agent.command:
            agent = g.agent.model_copy(update={"command": argv})
            source = spec.rollout.source.model_copy(update={"generate": g.model_copy(update={"agent": agent})})
            spec = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"source": source})})
    return run.model_copy(update={"spec": spec})


def local_checkpoint_path(run):
    """`run` with `trainer.checkpoint.path` = "checkpoints" (inside the run directory) when the spec does not set it:
    the API's default, /checkpoints, is a cluster volume's mount point, not a place on this machine."""
    ckpt = run.spec.trainer.checkpoint
    if "path" in ckpt.model_fields_set:
        return run
    trainer = run.spec.trainer.model_copy(update={"checkpoint": ckpt.model_copy(update={"path": "checkpoints"})})
    return run.model_copy(update={"spec": run.spec.model_copy(update={"trainer": trainer})})


def run(args: argparse.Namespace) -> int:
    try:
        effective_run = resolve_input_paths(load_effective_run(args.file, args.trainers, args.overrides), Path.cwd())
    except ValueError as exc:  # ManifestError: one line per problem, as `trainingrun validate` prints them
        print(str(exc), file=sys.stderr)
        return 1
    effective_run = local_checkpoint_path(effective_run)
    out_dir = Path(args.out) if args.out else Path("runs") / effective_run.metadata.name
    problem = check_out_dir(out_dir)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    try:
        lock = RunDirLock(out_dir).acquire()
    except RunDirBusy as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: --out {out_dir}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    try:
        return _run_locked(args, effective_run, out_dir)
    finally:
        lock.release()


def _run_locked(args: argparse.Namespace, effective_run, out_dir: Path) -> int:
    progress = ProgressLine(num_rollouts=effective_run.spec.rollout.num_rollouts, interval=args.progress_interval,
                        log_path=out_dir / "logs" / LAUNCHER_LOG)
    name = effective_run.metadata.name
    if args.fresh:
        removed = clear_for_fresh(out_dir)
        if removed:
            progress.event(f"--fresh: removed the earlier run in {out_dir} ({', '.join(removed)})")
            if effective_run.spec.store.url:
                progress.event(f"note: --fresh does not clear the external store {effective_run.spec.store.url}")
    elif args.resume and not (out_dir / "run.yaml").exists():
        print(f"error: --resume: {out_dir} holds no earlier run to resume (no run.yaml)", file=sys.stderr)
        return 1
    elif (resize := resize_only(out_dir, spec_yaml(effective_run))) is not None:
        progress.event(f"resizing the run in {out_dir}: {resize[0]} -> {resize[1]} trainer(s); the trainers reshard "
                       "the last checkpoint and re-schedule the rollouts published for the old size")
    elif not args.resume:
        diff = spec_change(out_dir, spec_yaml(effective_run))
        if diff is not None:
            print(f"error: {out_dir} holds an earlier run of a different spec; its results are kept. Pass --resume "
                  f"to continue it with the new spec, --fresh to delete it and start over, or another --out.\n{diff}",
                  file=sys.stderr)
            return 1
    t = effective_run.spec.trainer
    r = effective_run.spec.rollout
    progress.event(f"trainingrun run {name}: {t.replicas} trainer(s), {r.num_rollouts} rollouts "
                   f"of {r.samples_per_rollout} samples, output in {out_dir}")
    done = already_succeeded(effective_run, out_dir)
    if done is not None:
        print(summary_table(done))
        print(f"run {name} in {out_dir} already succeeded with this spec; nothing to do "
              f"(--fresh to train again from scratch, or another --out)", file=sys.stderr)
        return 0
    if is_run_dir(out_dir):
        earlier = step_records(out_dir)
        if earlier:
            progress.resume_from(earlier[-1])
            progress.event(f"resuming in {out_dir}: {len(earlier)} step(s) trained before, the trainers continue "
                           "from their newest checkpoint")
    launcher = Launcher(effective_run, out_dir, grace=args.grace_seconds, progress=progress)
    try:
        code, summary = launcher.execute()
    except OSError as exc:  # the run directory itself could not be set up (e.g. a full volume): nothing started
        print(f"error: {describe(exc, launcher.volumes()) or exc}", file=sys.stderr)
        return 1
    if args.plot:
        write_run_plot(out_dir, progress)
    print(summary_table(summary))
    if not launcher.summary_written:
        print(f"error: could not write {out_dir / 'summary.json'} (see the warning above); the summary is the table "
              "above", file=sys.stderr)
    if summary["failure"]:
        f = summary["failure"]
        print(f"error: run {summary['run']} failed: {f['process']}: {f['reason']}", file=sys.stderr)
        if f["log"]:
            print(f"--- last lines of {f['log']} ---\n{f['log_tail']}\n---", file=sys.stderr)
    elif summary["status"] == "interrupted":
        print(f"run {summary['run']} stopped; run the same command again to resume from the last checkpoint",
              file=sys.stderr)
    return code


def write_run_plot(out_dir: Path, progress: ProgressLine) -> None:
    """The finished (or stopped) run's plot, RUN_DIR/plot.png; a failure to plot never fails the run."""
    records = step_records(out_dir)
    if not records:
        return
    try:
        path = write_plot(records, out_dir / PLOT_FILE, title=out_dir.resolve().name, evals=eval_records(out_dir))
    except Exception as exc:  # noqa: BLE001 - matplotlib missing, disk full: the run's results are written already
        progress.event(f"warning: no plot written: {type(exc).__name__}: {exc}")
        return
    progress.event(f"plot: {path}  (trainingrun plot {out_dir} redraws it; tensorboard --logdir "
                   f"{out_dir / 'tensorboard'})")
