"""The local launcher: runs the attempts of one TrainingRun as processes in a run directory, applying the failure
policy (`trainingrun.failure_policy`) the operator applies to pods.

An attempt is the plan's processes (`trainingrun.plan.build_plan`) started by `trainingrun.local.procs`; `watch`
polls them and rank 0's step records (`trainingrun.local.report`) until the attempt succeeds, fails, stalls or the
launcher is signalled; `execute` restarts the group while the policy allows and writes metrics.jsonl and
summary.json.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainingrun.api.yamlcodec import dump_yaml
from trainingrun.diskspace import describe as describe_no_space
from trainingrun.diskspace import full_volume
from trainingrun.local.procs import (
    ProcessGroup,
    describe_exit,
    free_port,
    metrics_port_block,
    tail,
    write_json_atomic,
)
from trainingrun.local.report import (
    REQUIRED_FIELDS,
    MetricsTail,
    merge_metrics,
    raw_metrics_files,
    raw_metrics_path,
    summarize,
    summary_table,
    write_metrics,
)
from trainingrun import failure_policy as policy
from trainingrun.contract.env import ProcessEnv
from trainingrun.local.engine import LocalEnginePool, needs_local_engine
from trainingrun.local.progress import ProgressLine
from trainingrun.plan import build_plan
from trainingrun.rollout.main import data_report
from trainingrun.store import StoreError, open_store

POLL_SECONDS = 0.2
ENGINE_START_TIMEOUT = 900.0  # vLLM on CPU: ~1 min on a quiet machine, several under load


def spec_yaml(run) -> str:
    doc = run.model_dump(by_alias=True, exclude_none=True, mode="json", exclude={"status"})
    return dump_yaml(doc, sort_keys=False)


def stalled(last_progress: float, deadline_s: float | None) -> bool:
    """No new step for longer than progressDeadlineSeconds (monotonic clock)."""
    left = policy.seconds_left(last_progress, deadline_s, time.monotonic())
    return left is not None and left < 0


_ATTEMPT_LOG_RE = re.compile(r"\.attempt(\d+)\.log$")
LAUNCHER_LOG = "launcher.log"


def next_attempt(out_dir: Path) -> int:
    """0 for a fresh run directory; after an earlier invocation, one more than its last attempt (logs are kept)."""
    seen = [a for a, _ in raw_metrics_files(out_dir)]
    logs = out_dir / "logs"
    if logs.is_dir():
        for p in logs.glob("*.log"):
            if p.name == LAUNCHER_LOG:  # the launcher's own events, over all attempts
                continue
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
    failure: policy.Failure | None = None  # what the failure policy decides on (failed, config_error)


class Launcher:
    """Runs the attempts of one TrainingRun in `out_dir` (see the module docstring)."""

    def __init__(self, run, out_dir: Path, *, grace: float = 15.0, progress: ProgressLine | None = None):
        self.run = run
        self.spec = run.spec
        self.name = run.metadata.name
        self.out_dir = out_dir
        self.grace = grace
        self.progress = progress or ProgressLine(num_rollouts=run.spec.rollout.num_rollouts)
        self.signals = Signals()
        self.attempts: list[dict[str, Any]] = []
        self.tokens_this_run = 0.0
        self.missing_warned = False
        self.first_attempt = 0
        self.write_failures: set[str] = set()  # outputs the launcher could not write (a full volume), said once each
        self.summary_written = False
        self.engine: LocalEnginePool | None = None  # the run's vLLM servers (rollout.engine.type vllm without url)
        self.restarts = 0  # restarts the failure policy counted (group and engine alike)
        self._pids: dict[str, Any] | None = None  # pids.json of the current attempt
        self._engine_starts = 0

    def volumes(self) -> list[Path]:
        """Where the run writes: the run directory, the checkpoints (relative to it) and a file store."""
        paths = [self.out_dir, self.out_dir / self.spec.trainer.checkpoint.path]
        url = self.spec.store.url
        if url and url.startswith("file://"):
            paths.append(Path(url.split("://", 1)[1].split("?", 1)[0]))
        return paths

    def try_write(self, what: str, write) -> bool:
        """Run `write()`; a full volume (or another OS error) is one warning line per output, never a crash."""
        try:
            write()
            return True
        except OSError as exc:
            if what not in self.write_failures:
                self.write_failures.add(what)
                reason = describe_no_space(exc, self.volumes()) or (exc.strerror or str(exc))
                self.progress.event(f"warning: cannot write {what}: {reason}")
            return False

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
            extra_env=ProcessEnv(
                metrics_jsonl=str(raw.resolve()),
                output_dir=str(self.out_dir.resolve()),  # TensorBoard / W&B files go into the run directory
                log_timestamps=True,  # children start every line with the time (trainingrun.childlog)
                engine_url=self.engine.url if self.engine is not None else None,
            ).to_env(),
        )
        self.progress.reopen()
        group = ProcessGroup.start(plan, cwd=self.out_dir.resolve(), log_dir=self.out_dir / "logs")
        self._pids = {
            "launcher": os.getpid(),
            "attempt": attempt,
            "first_attempt": self.first_attempt,  # this invocation's first (attempt - first_attempt = its restarts)
            "store_url": store_url,
            "master_port": int(plan.trainers[0].env["MASTER_PORT"]) if plan.trainers else None,
            "processes": {
                c.name: {"pid": c.proc.pid, "role": c.plan.role, "rank": c.plan.rank,
                         "metrics_port": c.plan.metrics_port, "workers": c.plan.workers,
                         "metrics_ports": list(c.plan.metrics_ports), "log": str(c.log)}
                for c in group.children
            },
        }
        self.write_pids()
        ports = ", ".join(
            f"{c.name}={c.plan.metrics_port}" if c.plan.workers == 1
            else f"{c.name}={c.plan.metrics_ports[0]}-{c.plan.metrics_ports[-1]}" for c in group.children)
        workers = f" of {plan.trainers[0].workers} workers each" if plan.trainers and plan.trainers[0].workers > 1 else ""
        self.progress.event(f"attempt {attempt}: started {len(group.children)} processes "
                            f"(1 rollout, {len(plan.trainers)} trainers{workers}); logs in {self.out_dir / 'logs'}; "
                            f"metrics ports {ports}")
        return group

    def write_pids(self) -> None:
        """pids.json: the attempt's processes and the run's engines (`engine-<i>`, rewritten when one restarts)."""
        if self._pids is None:
            return
        doc = dict(self._pids)
        if self.engine is not None:
            doc["processes"] = {**doc["processes"], **self.engine.processes()}
        self.try_write("pids.json", lambda: write_json_atomic(self.out_dir / "pids.json", doc))

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
            for engine_failure in self.engine.check() if self.engine is not None else []:
                outcome = self._engine_failed(engine_failure)
                if outcome is not None:
                    return outcome
            if self.engine is not None and self.engine.starts() != self._engine_starts:  # a replica restarted
                self._engine_starts = self.engine.starts()
                self.write_pids()
            failed = {c.name: c for c in group.children if c.returncode not in (None, 0)}
            if failed:
                # Several may have died in one poll (a rank's death breaks its peers' collectives): the policy names
                # the one to report.
                cause = policy.root_cause(
                    policy.Failure(name=c.name, kind=policy.classify(c.returncode), description=describe_exit(c.returncode),
                                   role=c.plan.role, rank=c.plan.rank, code=c.returncode) for c in failed.values())
                assert cause is not None
                c = failed[cause.name]
                full = full_volume(self.volumes())
                if full is not None:  # no restart can fix a full disk: stop cleanly, whatever the exit code
                    return Outcome("failed", culprit=c.name, reason=f"{cause.description}: {full}", log=c.log)
                status = "config_error" if cause.kind is policy.ExitKind.CONFIG_ERROR else "failed"
                return Outcome(status, culprit=c.name, reason=cause.description, log=c.log, failure=cause)
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
            elif stalled(last_progress, deadline_s):
                reason = f"no new training step for {deadline_s}s (spec.failurePolicy.progressDeadlineSeconds)"
                return Outcome("failed", culprit="progress deadline", reason=reason, failure=policy.Failure(
                    name="progress deadline", kind=policy.ExitKind.FAILURE, description=reason))
            time.sleep(POLL_SECONDS)

    def _engine_failed(self, failure: policy.Failure) -> Outcome | None:
        """A vLLM server of the run's pool exited: restart only that replica (after the policy's backoff, counted as a
        restart) while the budget allows — the rollout sends its prompts to the other replicas meanwhile and loads
        the current weight version into it when it is back — else leave it down; the run fails only when no replica
        is left (naming every replica and its last exit).

        Issue 22 (failurePolicy.rules / RestartRole, branch h22-operator) replaces the budget below: the verdict is
        then `self.policy.decide(failure, self.counts())` (failure.role "engine", failure.rank the replica's index),
        RestartRole → `replica.restart_after(verdict.backoff)` counted in role_restarts["engine"], FailRun /
        BackoffLimitExceeded → the `give_up` branch below, RestartGroup → that branch's group restart. The pool
        parts (replica by name, give_up, live(), pids.json, the empty-pool outcome) stay as they are."""
        fp = self.spec.failure_policy
        assert self.engine is not None
        replica = self.engine.replica(failure.name)
        verdict = policy.on_failure(failure, restarts=self.restarts, max_restarts=fp.max_restarts)
        self.progress.event(f"engine failed: {failure.description}")
        if not verdict.restart:
            replica.give_up()
            self.write_pids()
            left = self.engine.live()
            status = "config_error" if failure.kind is policy.ExitKind.CONFIG_ERROR else "failed"
            if left and status != "config_error":
                self.progress.event(f"{replica.name} stays down: no restarts left ({self.restarts}/{fp.max_restarts} "
                                    f"used); {len(left)} engine(s) left in the pool: "
                                    f"{', '.join(r.name for r in left)}")
                return None
            self.progress.event(f"no restarts left ({self.restarts}/{fp.max_restarts} used)")
            reason = failure.description if len(self.engine.replicas) == 1 else (
                "no engine of the pool is left: " + "; ".join(f"{r.name}: {r.last_exit or 'down'}"
                                                              for r in self.engine.replicas))
            return Outcome(status, culprit="engine" if len(self.engine.replicas) == 1 else "engines", reason=reason,
                           log=replica.server.log_path, failure=failure)
        self.restarts += int(verdict.counted)
        backoff = policy.backoff_seconds(fp.backoff_seconds, self.restarts, counted=verdict.counted)
        self.progress.event(f"restarting {replica.name} in {backoff:g}s (restart {self.restarts}/{fp.max_restarts}); "
                            "the rollout sends its prompts to the other engines or waits for it")
        replica.restart_after(backoff)
        return None

    def start_engine(self) -> Outcome | None:
        """Start the run's own vLLM server and wait until it is healthy (None), or the Outcome that ends the run."""
        if not needs_local_engine(self.spec):
            return None
        try:
            self.engine = LocalEnginePool(self.spec, self.out_dir)
        except ValueError as exc:
            return Outcome("config_error", culprit="engine", reason=str(exc), failure=policy.Failure(
                name="engine", kind=policy.ExitKind.CONFIG_ERROR, description=str(exc), role="engine"))
        self.engine.start()
        for r in self.engine.replicas:
            self.progress.event(f"engine: starting vLLM {r.name} at {r.url} (log {r.server.log_path})")
        t0 = time.monotonic()
        while not self.engine.healthy():
            if self.signals.received:
                return Outcome("interrupted", reason=f"{signal.Signals(self.signals.received).name} received")
            failures = self.engine.check()
            if failures or time.monotonic() - t0 > ENGINE_START_TIMEOUT:
                waiting = [r for r in self.engine.replicas if not r.healthy()]
                reason = (failures[0].description if failures
                          else f"vLLM server(s) {', '.join(r.name for r in waiting)} not healthy after "
                               f"{ENGINE_START_TIMEOUT:.0f}s")
                culprit = failures[0].name if failures else waiting[0].name
                return Outcome("failed", culprit=culprit, reason=reason,
                               log=self.engine.replica(culprit).server.log_path,
                               failure=failures[0] if failures else policy.Failure(
                                   name=culprit, kind=policy.ExitKind.FAILURE, description=reason, role="engine"))
            time.sleep(1.0)
        self.progress.event(f"engine: {len(self.engine.replicas)} vLLM server(s) healthy after "
                            f"{time.monotonic() - t0:.0f}s")
        return None

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
        fp = self.spec.failure_policy
        store_url, config = self.prepare()
        attempt = next_attempt(self.out_dir)
        first_attempt = self.first_attempt = attempt
        self.restarts = 0
        outcome = Outcome("failed", reason="not started")
        self.signals.install()
        try:
            engine_outcome = self.start_engine()
            while engine_outcome is None:
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
                self.try_write("metrics.jsonl", lambda: write_metrics(self.out_dir, merge_metrics(self.out_dir)))
                if outcome.status in ("succeeded", "interrupted") or outcome.failure is None:
                    break
                verdict = policy.on_failure(outcome.failure, restarts=self.restarts, max_restarts=fp.max_restarts)
                if outcome.status == "failed":
                    self.progress.event(f"attempt {attempt} failed: {outcome.culprit}: {outcome.reason}")
                if not verdict.restart:
                    if outcome.status == "failed":
                        self.progress.event(f"no restarts left ({self.restarts}/{fp.max_restarts} used)")
                    break
                self.restarts += int(verdict.counted)
                attempt += 1
                backoff = policy.backoff_seconds(fp.backoff_seconds, self.restarts, counted=verdict.counted)
                self.progress.event(f"restarting the group in {backoff:g}s "
                                    f"(restart {self.restarts}/{fp.max_restarts}, attempt {attempt})")
                if not self._sleep(backoff):
                    outcome = Outcome("interrupted", reason="signal received during backoff")
                    break
            if engine_outcome is not None:
                outcome = engine_outcome
                if outcome.status != "interrupted":
                    self.progress.event(f"engine failed to start: {outcome.reason}")
        finally:
            self.signals.restore()
            self.progress.close()
            if self.engine is not None:
                self.engine.stop()
        restarts = self.restarts
        wall = time.monotonic() - started
        records = merge_metrics(self.out_dir)
        self.try_write("metrics.jsonl", lambda: write_metrics(self.out_dir, records))
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
        self.summary_written = self.try_write("summary.json",
                                              lambda: write_json_atomic(self.out_dir / "summary.json", summary))
        code = {"succeeded": 0, "config_error": policy.EXIT_CONFIG_ERROR, "failed": 1}.get(outcome.status)
        if outcome.status == "interrupted":
            code = 128 + (self.signals.received or signal.SIGINT)
        return int(code), summary


def already_succeeded(run, out_dir: Path) -> dict[str, Any] | None:
    """The summary of an earlier invocation in `out_dir` that succeeded with exactly this spec, else None.
    (With a changed spec, e.g. more rollouts, the run continues from its checkpoints instead.)"""
    try:
        summary = json.loads((out_dir / "summary.json").read_text())
        same = (out_dir / "run.yaml").read_text() == spec_yaml(run)
    except (OSError, ValueError):
        return None
    return summary if same and summary.get("status") == "succeeded" else None
