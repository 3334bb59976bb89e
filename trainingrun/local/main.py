"""`trainingrun run FILE.yaml [--out DIR] [--trainers N]`: run a whole TrainingRun on this machine.

The command line: load and check the spec (`--trainers` applied), then hand it to the `Launcher`
(`trainingrun.local.launcher`), print the summary table and, for a failed run, the failing process and its log tail.
See the package docstring (`trainingrun.local`) and docs/local.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainingrun.local.launcher import Launcher, already_succeeded
from trainingrun.local.report import Progress, summary_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="TrainingRun manifest (YAML)")
    parser.add_argument("--out", metavar="DIR", help="run directory (default: runs/<metadata.name>); "
                        "running again with the same DIR resumes from its checkpoints")
    parser.add_argument("--trainers", type=int, metavar="N", help="trainer processes (overrides spec.trainer.replicas)")
    parser.add_argument("--grace-seconds", type=float, default=15.0, metavar="S",
                        help="how long children get to exit after SIGTERM before SIGKILL (default 15)")
    parser.add_argument("--progress-interval", type=float, default=5.0, metavar="S",
                        help="seconds between plain progress lines when stdout is not a terminal (default 5)")


# ------------------------------------------------------------------------------------------------ spec handling
def load_effective_run(path: str, trainers: int | None):
    """The TrainingRun in `path` with `--trainers` applied before validation, through the one strict loader;
    ManifestError (a ValueError) with the same one-line errors `trainingrun validate` prints."""
    from trainingrun.api import load_trainingrun

    return load_trainingrun(path, overrides=None if trainers is None else {"spec.trainer.replicas": trainers})


def resolve_input_paths(run, base: Path):
    """`run` with a relative `rollout.source.jsonl.path` and `model.hf` made absolute against `base` (the directory
    the user ran `trainingrun run` in). Children run in the output directory, where a relative input path would not
    be found; output paths (`trainer.checkpoint.path`) stay relative to the output directory on purpose."""
    spec = run.spec
    source = spec.rollout.source
    if source.type == "jsonl" and source.jsonl is not None and not Path(source.jsonl.path).is_absolute():
        jsonl = source.jsonl.model_copy(update={"path": str((base / source.jsonl.path).resolve())})
        rollout = spec.rollout.model_copy(update={"source": source.model_copy(update={"jsonl": jsonl})})
        spec = spec.model_copy(update={"rollout": rollout})
    if spec.model.hf is not None and not Path(spec.model.hf).is_absolute():
        spec = spec.model_copy(update={"model": spec.model.model_copy(
            update={"hf": str((base / spec.model.hf).resolve())})})
    return run.model_copy(update={"spec": spec})


def run(args: argparse.Namespace) -> int:
    try:
        the_run = resolve_input_paths(load_effective_run(args.file, args.trainers), Path.cwd())
    except ValueError as exc:  # ManifestError: one line per problem, as `trainingrun validate` prints them
        print(str(exc), file=sys.stderr)
        return 1
    out_dir = Path(args.out) if args.out else Path("runs") / the_run.metadata.name
    progress = Progress(num_rollouts=the_run.spec.rollout.num_rollouts, interval=args.progress_interval)
    t = the_run.spec.trainer
    progress.event(f"trainingrun run {the_run.metadata.name}: {t.replicas} trainer(s), "
                   f"{the_run.spec.rollout.num_rollouts} rollouts of {the_run.spec.rollout.samples_per_rollout} "
                   f"samples, output in {out_dir}")
    done = already_succeeded(the_run, out_dir)
    if done is not None:
        print(summary_table(done))
        print(f"run {the_run.metadata.name} in {out_dir} already succeeded with this spec; nothing to do "
              f"(remove {out_dir} or use another --out to train again)", file=sys.stderr)
        return 0
    launcher = Launcher(the_run, out_dir, grace=args.grace_seconds, progress=progress)
    code, summary = launcher.execute()
    print(summary_table(summary))
    if summary["failure"]:
        f = summary["failure"]
        print(f"error: run {summary['run']} failed: {f['process']}: {f['reason']}", file=sys.stderr)
        if f["log"]:
            print(f"--- last lines of {f['log']} ---\n{f['log_tail']}\n---", file=sys.stderr)
    elif summary["status"] == "interrupted":
        print(f"run {summary['run']} stopped; run the same command again to resume from the last checkpoint",
              file=sys.stderr)
    return code
