"""`trainingrun run FILE.yaml [--out DIR] [--trainers N]`: run a whole TrainingRun on this machine.

The launcher renders the same RunPlan the operator renders into pods (`trainingrun.plan.build_plan`) into local
processes: one rollout and N trainer ranks (`python -m trainingrun rollout|trainer`), all with cwd DIR, a file store
under DIR/store (or the spec's store URL), distinct metrics ports and a fresh torch.distributed master port per
attempt. It shows live progress, applies the operator's failure policy, and writes DIR/metrics.jsonl and
DIR/summary.json. See docs/local.md.

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
progressDeadlineSeconds) stops the whole group; after backoffSeconds the rollout and all trainers start again with
attempt+1 (trainers resume from their newest checkpoint, the rollout from its state in the store), at most
maxRestarts times. Exit code 78 (a configuration error) fails the run at once.

Exit status: 0 succeeded; 1 bad spec or failed run; 78 a process reported a configuration error; 130/143 stopped
by SIGINT/SIGTERM (every child is stopped first).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainingrun.local_procs import (
    ProcessGroup,
    describe_exit,
    log_path,
    tail,
    write_json_atomic,
)
from trainingrun.local_report import (
    REQUIRED_FIELDS,
    MetricsTail,
    Progress,
    merge_metrics,
    raw_metrics_files,
    raw_metrics_path,
    summarize,
    summary_table,
    write_metrics,
)
from trainingrun.plan import EXIT_CONFIG_ERROR, build_plan

POLL_SECONDS = 0.2


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
    """The TrainingRun in `path` with `--trainers` applied, validated; ValueError with one line per bad field."""
    from pydantic import ValidationError

    from trainingrun.api import describe_errors, load_trainingrun, parse_trainingrun

    run = load_trainingrun(path)  # ValueError naming file and fields
    if trainers is None:
        return run
    doc = run.model_dump(by_alias=True, exclude_none=True, mode="json")
    doc["spec"]["trainer"]["replicas"] = trainers
    try:
        return parse_trainingrun(doc)
    except ValidationError as exc:
        raise ValueError(describe_errors(exc, f"{path}: invalid TrainingRun with --trainers {trainers}:")) from None


def resolve_input_paths(run, base: Path):
    """`run` with a relative `rollout.source.jsonl.path` made absolute against `base` (the directory the user ran
    `trainingrun run` in). Children run in the output directory, where a relative input path would not be found;
    output paths (`trainer.checkpoint.path`) stay relative to the output directory on purpose."""
    source = run.spec.rollout.source
    if source.type != "jsonl" or source.jsonl is None or Path(source.jsonl.path).is_absolute():
        return run
    jsonl = source.jsonl.model_copy(update={"path": str((base / source.jsonl.path).resolve())})
    rollout = run.spec.rollout.model_copy(update={"source": source.model_copy(update={"jsonl": jsonl})})
    return run.model_copy(update={"spec": run.spec.model_copy(update={"rollout": rollout})})


def spec_yaml(run) -> str:
    doc = run.model_dump(by_alias=True, exclude_none=True, mode="json", exclude={"status"})
    return yaml.safe_dump(doc, sort_keys=False)


# ------------------------------------------------------------------------------------------------------- ports
def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def metrics_port_block(base: int, count: int, tries: int = 200) -> int:
    """The first port p >= base with p .. p+count-1 all free (the spec's port when it is free)."""
    p = base
    for _ in range(tries):
        if p + count - 1 > 65535:
            break
        if all(_port_free(p + i) for i in range(count)):
            return p
        p += count
    raise RuntimeError(f"no {count} free consecutive metrics ports from {base} (spec.metrics.port)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_ATTEMPT_LOG_RE = re.compile(r"\.attempt(\d+)\.log$")


def next_attempt(out_dir: Path) -> int:
    """0 for a fresh run directory; after an earlier invocation, one more than its last attempt (logs are kept)."""
    seen = [a for a, _ in raw_metrics_files(out_dir)]
    logs = out_dir / "logs"
    if logs.is_dir():
        for p in logs.glob("*.log"):
            m = _ATTEMPT_LOG_RE.search(p.name)
            seen.append(int(m.group(1)) if m else 0)
    return max(seen) + 1 if seen else 0


# -------------------------------------------------------------------------------------------------- supervisor
@dataclass
class Signals:
    """SIGINT/SIGTERM received by the launcher: the first stops the run cleanly, a second one hurries it."""

    received: int | None = None
    count: int = 0
    _old: dict[int, Any] = field(default_factory=dict)

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.received = self.received or signum
        self.count += 1


@dataclass
class Outcome:
    status: str  # succeeded | failed | config_error | interrupted
    culprit: str | None = None  # process name, or "progress deadline"
    reason: str = ""
    log: Path | None = None


class Launcher:
    """Runs the attempts of one TrainingRun in `out_dir` (see the module docstring)."""

    def __init__(self, run, out_dir: Path, *, grace: float = 15.0, progress: Progress | None = None):
        self.run = run
        self.spec = run.spec
        self.name = run.metadata.name
        self.out_dir = out_dir
        self.grace = grace
        self.progress = progress or Progress(num_rollouts=run.spec.rollout.num_rollouts)
        self.signals = Signals()
        self.attempts: list[dict[str, Any]] = []
        self.tokens_this_run = 0.0
        self.missing_warned = False

    # -- setup
    def prepare(self) -> tuple[str, Path]:
        out = self.out_dir
        out.mkdir(parents=True, exist_ok=True)
        (out / "logs").mkdir(exist_ok=True)
        (out / "raw").mkdir(exist_ok=True)
        config = out / "run.yaml"
        text = spec_yaml(self.run)
        if config.exists() and config.read_text() != text:
            self.progress.event(f"note: {config} differs from the spec given; it is replaced (checkpoints in {out} "
                                "are resumed as they are)")
        tmp = config.with_name(".run.yaml.tmp")
        tmp.write_text(text)
        tmp.replace(config)
        if self.spec.store.url:
            store_url = self.spec.store.url
        else:
            (out / "store").mkdir(exist_ok=True)
            store_url = f"file://{(out / 'store').resolve()}"
        return store_url, config.resolve()

    # -- one attempt
    def start_attempt(self, attempt: int, store_url: str, config: Path) -> ProcessGroup:
        # the rollout, then max(gpusPerReplica, 1) worker ports per trainer process (plan.build_plan)
        t = self.spec.trainer
        base = metrics_port_block(self.spec.metrics.port, 1 + t.replicas * max(t.gpus_per_replica, 1))
        raw = raw_metrics_path(self.out_dir, attempt)
        plan = build_plan(
            self.run,
            store_url=store_url,
            config_path=str(config),
            master_addr="127.0.0.1",
            master_port=free_port(),
            attempt=attempt,
            metrics_port=base,
            distinct_ports=True,
            extra_env={"TRAININGRUN_METRICS_JSONL": str(raw.resolve())},
        )
        group = ProcessGroup.start(plan, cwd=self.out_dir.resolve(), log_dir=self.out_dir / "logs")
        write_json_atomic(self.out_dir / "pids.json", {
            "launcher": os.getpid(),
            "attempt": attempt,
            "store_url": store_url,
            "master_port": int(plan.trainers[0].env["MASTER_PORT"]) if plan.trainers else None,
            "processes": {
                c.name: {"pid": c.proc.pid, "role": c.plan.role, "rank": c.plan.rank,
                         "metrics_port": c.plan.metrics_port, "workers": c.plan.workers,
                         "metrics_ports": list(c.plan.metrics_ports), "log": str(c.log)}
                for c in group.children
            },
        })
        ports = ", ".join(
            f"{c.name}={c.plan.metrics_port}" if c.plan.workers == 1
            else f"{c.name}={c.plan.metrics_ports[0]}-{c.plan.metrics_ports[-1]}" for c in group.children)
        workers = f" of {plan.trainers[0].workers} workers each" if plan.trainers and plan.trainers[0].workers > 1 else ""
        self.progress.event(f"attempt {attempt}: started {len(group.children)} processes "
                            f"(1 rollout, {len(plan.trainers)} trainers{workers}); logs in {self.out_dir / 'logs'}; "
                            f"metrics ports {ports}")
        return group

    def watch(self, group: ProcessGroup, attempt: int) -> Outcome:
        """Poll the children until the attempt succeeds, fails, stalls or the launcher is signalled."""
        follower = MetricsTail(raw_metrics_path(self.out_dir, attempt))
        deadline_s = self.spec.failure_policy.progress_deadline_seconds
        last_progress = time.monotonic()
        trainers = [c for c in group.children if c.plan.role == "trainer"]
        trainers_done_at: float | None = None
        while True:
            if self.signals.received:
                return Outcome("interrupted", reason=f"{signal.Signals(self.signals.received).name} received")
            records = follower.poll()
            if records:
                last_progress = time.monotonic()
                self.progress.add(records)
                self.tokens_this_run += sum(float(r.get("tokens", 0) or 0) for r in records)
                self._check_fields(records[-1])
            self.progress.tick()
            failed = [c for c in group.children if c.returncode not in (None, 0)]
            if failed:
                config = [c for c in failed if c.returncode == EXIT_CONFIG_ERROR]
                # Several may have died in one poll (a rank's death breaks its peers' collectives): name the one that
                # was killed by a signal before those that exited with an error.
                c = config[0] if config else sorted(failed, key=lambda c: c.returncode >= 0)[0]
                status = "config_error" if config else "failed"
                return Outcome(status, culprit=c.name, reason=describe_exit(c.returncode), log=c.log)
            if all(c.returncode == 0 for c in trainers):
                # Training is complete; the rollout normally has finished too. Give it a moment, then stop it.
                trainers_done_at = trainers_done_at or time.monotonic()
                rollout_alive = [c for c in group.children if c.plan.role == "rollout" and c.returncode is None]
                if not rollout_alive or time.monotonic() - trainers_done_at > min(self.grace, 5.0):
                    follower_tail = follower.poll()
                    if follower_tail:
                        self.progress.add(follower_tail)
                        self.tokens_this_run += sum(float(r.get("tokens", 0) or 0) for r in follower_tail)
                    return Outcome("succeeded")
            elif deadline_s and time.monotonic() - last_progress > deadline_s:
                return Outcome("failed", culprit="progress deadline",
                               reason=f"no new training step for {deadline_s}s "
                                      "(spec.failurePolicy.progressDeadlineSeconds)")
            time.sleep(POLL_SECONDS)

    def _check_fields(self, rec: dict[str, Any]) -> None:
        missing = [f for f in REQUIRED_FIELDS if f not in rec]
        if missing and not self.missing_warned:
            self.missing_warned = True
            self.progress.event(f"warning: step records lack fields {missing} (see the metrics.jsonl contract)")

    def _sleep(self, seconds: float) -> bool:
        """Sleep, waking early on a signal; False if interrupted."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.signals.received:
                return False
            time.sleep(min(POLL_SECONDS, max(0.0, end - time.monotonic())))
        return not self.signals.received

    def data_report(self, store_url: str) -> dict[str, Any] | None:
        """The rollout's account of the data (produced, filtered, trained, left over), or None if unreadable."""
        from trainingrun.rollout.main import data_report
        from trainingrun.store import StoreError, open_store

        try:
            store = open_store(store_url)
        except (ValueError, StoreError):
            return None
        try:
            return data_report(store)
        except (StoreError, ValueError, KeyError, TypeError) as exc:
            self.progress.event(f"warning: cannot read the rollout's data report from {store_url}: {exc}")
            return None
        finally:
            store.close()

    def stop_group(self, group: ProcessGroup) -> None:
        grace = 0.0 if self.signals.count > 1 else self.grace
        group.stop(grace=grace)

    # -- the whole run
    def execute(self) -> tuple[int, dict[str, Any]]:
        started = time.monotonic()
        policy = self.spec.failure_policy
        store_url, config = self.prepare()
        attempt = next_attempt(self.out_dir)
        first_attempt = attempt
        restarts = 0
        outcome = Outcome("failed", reason="not started")
        self.signals.install()
        try:
            while True:
                group = self.start_attempt(attempt, store_url, config)
                try:
                    outcome = self.watch(group, attempt)
                finally:
                    if outcome.status != "succeeded":
                        self.progress.close()
                    self.stop_group(group)
                self.attempts.append({"attempt": attempt, "outcome": outcome.status, "culprit": outcome.culprit,
                                      "reason": outcome.reason, "exit_codes": group.exit_codes(),
                                      "pids": group.pids()})
                write_metrics(self.out_dir, merge_metrics(self.out_dir))
                if outcome.status in ("succeeded", "interrupted", "config_error"):
                    break
                self.progress.event(f"attempt {attempt} failed: {outcome.culprit}: {outcome.reason}")
                if restarts >= policy.max_restarts:
                    self.progress.event(f"no restarts left ({restarts}/{policy.max_restarts} used)")
                    break
                restarts += 1
                attempt += 1
                self.progress.event(f"restarting the group in {policy.backoff_seconds}s "
                                    f"(restart {restarts}/{policy.max_restarts}, attempt {attempt})")
                if not self._sleep(policy.backoff_seconds):
                    outcome = Outcome("interrupted", reason="signal received during backoff")
                    break
        finally:
            self.signals.restore()
            self.progress.close()
        wall = time.monotonic() - started
        records = merge_metrics(self.out_dir)
        write_metrics(self.out_dir, records)
        failure = None
        if outcome.status in ("failed", "config_error"):
            failure = {"process": outcome.culprit, "reason": outcome.reason,
                       "log": str(outcome.log) if outcome.log else None,
                       "log_tail": tail(outcome.log, 20) if outcome.log else ""}
        status = {"succeeded": "succeeded", "interrupted": "interrupted"}.get(outcome.status, "failed")
        summary = summarize(records, status=status, restarts=restarts, wall_seconds=wall,
                            tokens_this_run=self.tokens_this_run, attempts=self.attempts, failure=failure,
                            name=self.name, out_dir=self.out_dir, data=self.data_report(store_url))
        summary["first_attempt"] = first_attempt
        data = summary.get("data") or {}
        if data.get("finished") and data.get("leftover_samples"):
            self.progress.event(
                f"note: {data['leftover_groups']} group(s) / {data['leftover_samples']} sample(s) were left over at "
                "the end: they did not fill a step and were not trained (summary.json: data)")
        write_json_atomic(self.out_dir / "summary.json", summary)
        code = {"succeeded": 0, "config_error": EXIT_CONFIG_ERROR, "failed": 1}.get(outcome.status)
        if outcome.status == "interrupted":
            code = 128 + (self.signals.received or signal.SIGINT)
        return int(code), summary


def already_succeeded(the_run, out_dir: Path) -> dict[str, Any] | None:
    """The summary of an earlier invocation in `out_dir` that succeeded with exactly this spec, else None.
    (With a changed spec, e.g. more rollouts, the run continues from its checkpoints instead.)"""
    import json

    try:
        summary = json.loads((out_dir / "summary.json").read_text())
        same = (out_dir / "run.yaml").read_text() == spec_yaml(the_run)
    except (OSError, ValueError):
        return None
    return summary if same and summary.get("status") == "succeeded" else None


def run(args: argparse.Namespace) -> int:
    try:
        the_run = resolve_input_paths(load_effective_run(args.file, args.trainers), Path.cwd())
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
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


__all__ = [
    "Launcher", "add_arguments", "load_effective_run", "log_path", "metrics_port_block", "next_attempt",
    "resolve_input_paths", "run",
]
