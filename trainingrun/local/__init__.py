"""The local launcher, `trainingrun run`: a whole TrainingRun on one machine, without a cluster. It mirrors
`trainingrun.operator`: the same RunPlan (`trainingrun.plan.build_plan`) rendered into processes instead of pods, the
same failure policy (`trainingrun.failure_policy`).

Module map:
  main.py      the command line (`add_arguments`, `run`): load the spec, launch, print the summary
  launcher.py  the `Launcher`: attempts, supervision, restarts, the run directory
  procs.py     child processes: start one attempt's processes, stop them without orphans; metrics ports
               (the child command prefix and die-with-parent: `trainingrun.childproc`)
  report.py    merged per-step metrics, live progress, summary.json and the summary table
  progress.py  the live progress line and timestamped events
  rundir.py    the run directory's lock and safety rules (--resume, --fresh, changed specs)
  engine.py    the run's own engine servers (the plan's engine roles) under the launcher, resized while it runs
  scale.py     `trainingrun scale RUN_DIR --replicas N`: the request to resize them, and the launcher's reader
  history.py   a run's per-step records (last attempt wins), local or a cluster's output directory
  status.py    `trainingrun status RUN_DIR`
  logs.py      `trainingrun logs RUN_DIR [PROCESS]`
  plot.py      `trainingrun plot RUN_DIR`

The run-directory tools (history.py, status.py, logs.py, plot.py) read what the launcher writes.

The launcher renders the plan into local processes: one rollout and N trainer ranks (`python -m trainingrun
rollout|trainer`), all with cwd DIR, a file store under DIR/store (or the spec's store URL), distinct metrics ports
and a fresh torch.distributed master port per attempt. It shows live progress, applies the operator's failure
policy, and writes DIR/metrics.jsonl and DIR/summary.json. See docs/local.md.

Run directory (DIR, default runs/<name>):
  run.yaml          the effective spec (TRAININGRUN_CONFIG of every process)
  store/            the file store (unless spec.store.url is set)
  checkpoints/      trainer checkpoints (spec.trainer.checkpoint.path is relative to DIR)
  logs/<name>.log   one log per process and attempt (<name>.attempt<k>.log after a restart)
  raw/              rank 0's per-attempt step records
  pids.json         the current attempt's process ids and metrics ports
  metrics.jsonl     one JSON object per training step (the last attempt's record of a re-run step wins)
  summary.json      steps, samples, first/final loss, restarts, wall time, tokens/s, status, exit codes

Failure policy (spec.failurePolicy, as the operator): a process that exits non-zero (or a run without a new step for
progressDeadlineSeconds) stops the whole group; after the backoff (backoffSeconds, doubling with each restart up to
max(backoffSeconds, 360 s)) the rollout and all trainers start again with attempt+1 (trainers resume from their newest
checkpoint, the rollout from its state in the store), at most maxRestarts times. Exit code 78 (a configuration
error) fails the run at once. The rules: `trainingrun.failure_policy`.

Exit status: 0 succeeded; 1 bad spec or failed run; 78 a process reported a configuration error; 130/143 stopped
by SIGINT/SIGTERM (every child is stopped first).
"""

from trainingrun.local.launcher import Launcher, next_attempt
from trainingrun.local.main import add_arguments, load_effective_run, resolve_input_paths, run
from trainingrun.local.procs import free_port, log_path, metrics_port_block

__all__ = [
    "Launcher", "add_arguments", "free_port", "load_effective_run", "log_path", "metrics_port_block", "next_attempt",
    "resolve_input_paths", "run",
]
