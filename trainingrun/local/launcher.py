"""The local launcher: runs the attempts of one TrainingRun as processes in a run directory, applying the failure
policy (`trainingrun.failure_policy`) the operator applies to pods.

An attempt is the plan's processes (`trainingrun.plan.build_plan`) started by `trainingrun.local.procs`; `watch`
polls them and rank 0's step records (`trainingrun.local.report`) until the attempt succeeds, fails, stalls or the
launcher is signalled; `execute` restarts the group while the policy allows and writes metrics.jsonl and
summary.json.

Every failure goes through `Policy.decide` (the run's rules, then the defaults) with the launcher's counters
(`counts`): RestartGroup ends the attempt and `execute` starts the next one after the backoff; RestartRole restarts
one process alone while the others run on — the rollout (`_restart_rollout`: the same attempt, its next generation in
TRAININGRUN_ROLE_ATTEMPT, resuming from its state in the store; the trainers keep waiting for its next rollout) or the
run's engine servers (`_engine_failed`: the engine replica, `trainingrun.local.engine`); FailRun ends the run. Counted
restarts of a role use that role's budget (failurePolicy.roles.<role>). While it watches, `_resize` applies a
`trainingrun scale` request to the engine pool (`trainingrun.local.scale`, `LocalEnginePool.resize_to`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trainingrun.api.manifest import sha256_of
from trainingrun.api.yamlcodec import dump_yaml
from trainingrun.diskspace import describe as describe_no_space
from trainingrun.diskspace import FULL_BELOW_BYTES, full_volume, usage
from trainingrun.local.procs import (
    ProcessGroup,
    describe_exit,
    metrics_port_block,
    quiet_port_block,
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
from trainingrun.contract.rollout_state import DataAccount, data_account
from trainingrun.local.engine import LocalEnginePool, needs_local_engine
from trainingrun.local.progress import ProgressLine
from trainingrun.local.scale import ScaleRequests
from trainingrun.plan import build_plan
from trainingrun.store import StoreError, open_store
from trainingrun.trainer.checkpoint import latest_checkpoint

POLL_SECONDS = 0.2
# A full volume or a configuration error that one trainer rank reports is one its peers meet too: each says so in its
# own line and exits 78 on its own. They get this long to do it before the group is stopped (SIGTERM would cut a
# slower rank off before its line: seen under load, rank 0 still removing the partial checkpoint).
PEER_EXIT_SECONDS = 5.0
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
        self.engine: LocalEnginePool | None = None  # the run's own engine servers (`engines.table.own_servers`)
        self.policy = policy.Policy.from_spec(run.spec.failure_policy)
        self.restarts = 0  # restarts the failure policy counted (group and roles alike): summary.json's `restarts`
        self.group_restarts = 0  # counted restarts of the whole group (failurePolicy.maxRestarts)
        self.role_restarts: dict[str, int] = {}  # counted restarts of each role alone (failurePolicy.roles.<role>)
        self.generations: dict[str, int] = {}  # restarts of the rollout alone, counted or not (its generation)
        self.role_events: list[dict[str, Any]] = []  # this attempt's restarts of a role alone (summary: attempts)
        self._pids_of: tuple[ProcessGroup, int, str] | None = None  # pids.json: the attempt's group, attempt, store
        self._engine_starts = 0
        self.scale_requests: ScaleRequests | None = None  # `trainingrun scale` (read once the engine servers run)
        self.engine_resizes: list[dict[str, Any]] = []  # summary.json: each resize, when asked and how long it took

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / self.spec.trainer.checkpoint.path  # relative to the run directory

    def volumes(self) -> list[Path]:
        """Where the run writes: the run directory, the checkpoints (relative to it) and a file store."""
        paths = [self.out_dir, self.checkpoint_dir]
        url = self.spec.store.url
        if url and url.startswith("file://"):
            paths.append(Path(url.split("://", 1)[1].split("?", 1)[0]))
        return paths

    def full_volume(self) -> str | None:
        """A line naming a volume of the run that is full (`diskspace`): the checkpoints' when the newest checkpoint
        would no longer fit on it, else any with less than 1 MiB available; None when none is."""
        newest = latest_checkpoint(self.checkpoint_dir)
        need = usage(newest) if newest is not None else 0
        line = full_volume([self.checkpoint_dir], need, what="a checkpoint") if need > FULL_BELOW_BYTES else None
        return line or full_volume(self.volumes())

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

    def counts(self) -> policy.Counts:
        """The restarts used so far, for `Policy.decide`."""
        return policy.Counts(restarts=self.group_restarts, role_restarts=dict(self.role_restarts))

    def count(self, verdict: policy.Verdict) -> int:
        """Count a restart of `verdict`'s role alone (the rollout, or one engine replica: `verdict.rank`); its new
        generation (of that replica)."""
        assert verdict.role is not None
        if verdict.counted:
            self.restarts += 1
            self.role_restarts[verdict.role] = self.role_restarts.get(verdict.role, 0) + 1
        key = verdict.role if verdict.role == "rollout" else f"{verdict.role}-{verdict.rank or 0}"
        self.generations[key] = self.generations.get(key, 0) + 1
        return self.generations[key]

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
            master_port=quiet_port_block(),  # not one bind(0) can take before rank 0 binds it
            attempt=attempt,
            metrics_port=base,
            distinct_ports=True,
            extra_env=ProcessEnv(
                config_sha256=sha256_of(config.read_bytes()),  # the children skip the checks run here (manifest.py)
                metrics_jsonl=str(raw.resolve()),
                output_dir=str(self.out_dir.resolve()),  # TensorBoard / W&B files go into the run directory
                log_timestamps=True,  # children start every line with the time (trainingrun.childlog)
                engine_url=self.engine.url if self.engine is not None else None,
                # the list follows `trainingrun scale` (engine.py, "Resize")
                engine_url_file=str(self.engine.url_file.resolve()) if self.engine is not None else None,
                engine_url_applied_file=str(self.engine.applied_file.resolve()) if self.engine is not None else None,
            ).to_env(),
            engine_replicas=len(self.engine.replicas) if self.engine is not None else 0,
        )
        self.progress.reopen()
        self.role_events = []
        rollout = replace(plan.rollout, env={**plan.rollout.env,
                                             **ProcessEnv(role_attempt=self.generations.get("rollout", 0)).to_env()})
        plan = replace(plan, processes=tuple(rollout if p.role == "rollout" else p for p in plan.processes))
        group = ProcessGroup.start(plan, cwd=self.out_dir.resolve(), log_dir=self.out_dir / "logs")
        self._pids_of = (group, attempt, store_url)
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
        """pids.json: the launcher, the attempt and every process of it now, and the run's engines (`engine-<i>`);
        rewritten when one restarts alone."""
        if self._pids_of is None:
            return
        group, attempt, store_url = self._pids_of
        trainers = [c for c in group.children if c.plan.role == "trainer"]
        processes = {
            c.name: {"pid": c.proc.pid, "role": c.plan.role, "rank": c.plan.rank,
                     "metrics_port": c.plan.metrics_port, "workers": c.plan.workers,
                     "metrics_ports": list(c.plan.metrics_ports), "log": str(c.log)}
            for c in group.children
        }
        if self.engine is not None:
            processes.update(self.engine.processes())
        size = self.engine.size() if self.engine is not None else None
        self.try_write("pids.json", lambda: write_json_atomic(self.out_dir / "pids.json", {
            "engine_replicas": size,  # the pool's size: wanted, listed for the rollout, leaving
            "launcher": os.getpid(),
            "attempt": attempt,
            "first_attempt": self.first_attempt,  # this invocation's first (attempt - first_attempt = its restarts)
            "store_url": store_url,
            "master_port": int(trainers[0].plan.env["MASTER_PORT"]) if trainers else None,
            "processes": processes,
        }))

    def _restart_rollout(self, group: ProcessGroup, failure: policy.Failure, verdict: policy.Verdict,
                         attempt: int, store_url: str) -> bool:
        """Restart the rollout process alone after the role's backoff (the trainers keep waiting for its next
        rollout); False when a signal came during the backoff."""
        generation = self.count(verdict)
        budget = self.policy.roles["rollout"].max_restarts
        self.progress.event(f"rollout failed: {failure.description}; restarting the rollout alone in "
                            f"{verdict.backoff:g}s (generation {generation}; "
                            + (f"restart {self.role_restarts['rollout']}/{budget} of failurePolicy.roles.rollout"
                               if verdict.counted else verdict.why) + "); the trainers keep running")
        self.role_events.append({"process": "rollout", "reason": failure.description, "counted": verdict.counted,
                                 "generation": generation, "rule": verdict.rule})
        if not self._sleep(verdict.backoff):
            return False
        group.restart("rollout", cwd=self.out_dir.resolve(), why=f"attempt {attempt} generation {generation} "
                      "(restarted alone)", extra_env=ProcessEnv(role_attempt=generation).to_env())
        self.write_pids()
        return True

    def watch(self, group: ProcessGroup, attempt: int, store_url: str = "") -> Outcome:
        """Poll the children until the attempt succeeds, fails, stalls or the launcher is signalled."""
        follower = MetricsTail(raw_metrics_path(self.out_dir, attempt))
        deadline_s = self.spec.failure_policy.progress_deadline_seconds
        last_progress = time.monotonic()
        trainers = [c for c in group.children if c.plan.role == "trainer"]
        trainers_done_at: float | None = None
        while True:
            if self.signals.received:
                return Outcome("interrupted", reason=f"{signal.Signals(self.signals.received).name} received")
            self._resize()
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
                full = self.full_volume()
                if cause.role == "trainer" and (full is not None or cause.kind is policy.ExitKind.CONFIG_ERROR):
                    self._let_trainers_finish(group)  # its peers meet the same and say so themselves
                if full is not None:  # no restart can fix a full disk: stop cleanly, whatever the exit code
                    return Outcome("failed", culprit=c.name, reason=f"{cause.description}: {full}", log=c.log)
                verdict = self.policy.decide(cause, self.counts())
                if verdict.alone and cause.role == "rollout":
                    if not self._restart_rollout(group, cause, verdict, attempt, store_url):
                        return Outcome("interrupted", reason="signal received during backoff")
                    last_progress = time.monotonic()  # the deadline counts from the rollout's return
                    continue
                status = "config_error" if cause.kind is policy.ExitKind.CONFIG_ERROR else "failed"
                reason = cause.description
                engine_errors = self.engine.errors() if self.engine is not None and cause.role == "rollout" else ""
                if engine_errors:  # the engines' own errors, which the rollout saw only as their HTTP answers
                    reason += f"; engine error ({engine_errors})"
                return Outcome(status, culprit=c.name, reason=reason, log=c.log, failure=cause)
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

    @staticmethod
    def _let_trainers_finish(group: ProcessGroup, seconds: float = PEER_EXIT_SECONDS) -> None:
        """Wait up to `seconds` for the trainers still running to exit on their own (PEER_EXIT_SECONDS)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(
                c.returncode is None for c in group.children if c.plan.role == "trainer"):
            time.sleep(POLL_SECONDS)

    def _engine_failed(self, failure: policy.Failure) -> Outcome | None:
        """An engine server of the run's pool exited (or stopped serving: killed): a replica that failed with the
        same error again after its restart ends the run at once (exit 78, naming the error); otherwise the failure
        policy decides for that replica (failure.rank) — by
        default it restarts alone (after the engine role's backoff, on the role's budget, all replicas together)
        while the rollout sends its prompts to the other replicas and loads the current weight version into it
        when it is back; a RestartGroup rule restarts the group and that replica; FailRun (a rule, exit 78) fails
        the run. With the budget spent the replica leaves the pool (stays down); the run fails only when no replica
        is left, naming every replica and its last exit."""
        assert self.engine is not None
        replica = self.engine.replicas[failure.rank or 0]
        self.progress.event(f"engine failed: {failure.description}")
        again = replica.failed_again()
        if again:  # deterministic: a restart meets the same error
            reason = (f"{replica.name} failed with the same error again after its restart: {again}; not restarting "
                      "(a restart meets the same error)")
            return Outcome("config_error", culprit=replica.name, reason=reason, log=replica.server.log_path,
                           failure=replace(failure, kind=policy.ExitKind.CONFIG_ERROR, code=policy.EXIT_CONFIG_ERROR,
                                           description=reason))
        verdict = self.policy.decide(failure, self.counts())
        pool = len(self.engine.replicas)
        if not verdict.restart:
            if verdict.reason == "BackoffLimitExceeded":
                replica.give_up()
                self.write_pids()
                left = self.engine.live()
                if left:
                    self.progress.event(f"{replica.name} leaves the pool ({verdict.why}); {len(left)} engine(s) "
                                        f"left: {', '.join(r.name for r in left)}")
                    return None
                self.progress.event(f"no restarts left ({verdict.why})")
            else:
                self.progress.event(f"not restarting: {verdict.why}")
            status = "config_error" if verdict.reason == "ConfigError" else "failed"
            reason = failure.description if pool == 1 or verdict.reason != "BackoffLimitExceeded" else (
                "no engine of the pool is left: " + "; ".join(f"{r.name}: {r.last_exit or 'down'}"
                                                              for r in self.engine.replicas))
            return Outcome(status, culprit="engine" if pool == 1 else "engines", reason=reason,
                           log=replica.server.log_path, failure=failure)
        if not verdict.alone:  # RestartGroup: the group's next attempt, with the replica started again meanwhile
            replica.restart_after(verdict.backoff)
            return Outcome("failed", culprit="engine" if pool == 1 else replica.name, reason=failure.description,
                           log=replica.server.log_path, failure=failure)
        generation = self.count(verdict)
        budget = self.policy.roles["engine"].max_restarts
        what = (f"restart {self.role_restarts['engine']}/{budget} of failurePolicy.roles.engine" if verdict.counted
                else verdict.why)
        self.progress.event(f"restarting the engine {replica.name} alone in {verdict.backoff:g}s (engine replica "
                            f"{failure.rank or 0}, generation {generation}; {what}); the rollout sends its prompts "
                            "to the other engines or waits for it")
        self.role_events.append({"process": replica.name, "reason": failure.description, "counted": verdict.counted,
                                 "generation": generation, "rule": verdict.rule})
        replica.restart_after(verdict.backoff)
        return None

    def _resize(self) -> None:
        """A `trainingrun scale` request (`trainingrun.local.scale`) started, and a resize under way advanced
        (`LocalEnginePool.step`); pids.json rewritten when the pool changed."""
        if self.engine is None or self.scale_requests is None:
            return
        n, problem = self.scale_requests.poll()
        if problem:
            self.progress.event(f"warning: trainingrun scale: {problem}")
        if n is not None and n != self.engine.wanted:
            self.progress.event(f"engine: resizing the pool from {self.engine.wanted} to {n} server(s) "
                                "(trainingrun scale); the trainers and the rollout keep running")
            self.engine_resizes.append({"from": self.engine.wanted, "to": n, "at": time.time(), "reached_after": None})
            self.engine.resize_to(n)
            self.write_pids()
        events = self.engine.step()
        for line in events:
            self.progress.event(f"engine: {line}")
        if events:
            self.write_pids()
        last = self.engine_resizes[-1] if self.engine_resizes else None
        if last is not None and last["reached_after"] is None and self.engine.size() == {
                "wanted": last["to"], "listed": last["to"], "leaving": 0}:
            last["reached_after"] = round(time.time() - last["at"], 1)
            self.progress.event(f"engine: the pool has {last['to']} server(s) ({last['reached_after']:g}s)")

    def start_engine(self) -> Outcome | None:
        """Start the run's own engine servers (the plan's engine roles) and wait until they are healthy (None), or
        the Outcome that ends the run."""
        if not needs_local_engine(self.spec):
            return None
        self.scale_requests = ScaleRequests(self.out_dir)  # before the servers start: a request meanwhile counts
        try:
            self.engine = LocalEnginePool(self.run, self.out_dir)
        except ValueError as exc:
            return Outcome("config_error", culprit="engine", reason=str(exc), failure=policy.Failure(
                name="engine", kind=policy.ExitKind.CONFIG_ERROR, description=str(exc), role="engine"))
        self.engine.start()
        for r in self.engine.replicas:
            self.progress.event(f"engine: starting {r.title} {r.name} at {r.url} (log {r.server.log_path})")
        t0 = time.monotonic()
        while not self.engine.healthy():
            if self.signals.received:
                return Outcome("interrupted", reason=f"{signal.Signals(self.signals.received).name} received")
            failures = self.engine.check()
            if failures or time.monotonic() - t0 > ENGINE_START_TIMEOUT:
                waiting = [r for r in self.engine.replicas if not r.healthy()]
                reason = (failures[0].description if failures
                          else f"{self.engine.title} server(s) {', '.join(r.name for r in waiting)} not healthy after "
                               f"{ENGINE_START_TIMEOUT:.0f}s")
                culprit = failures[0].name if failures else waiting[0].name
                return Outcome("failed", culprit=culprit, reason=reason,
                               log=self.engine.replica(culprit).server.log_path,
                               failure=failures[0] if failures else policy.Failure(
                                   name=culprit, kind=policy.ExitKind.FAILURE, description=reason, role="engine"))
            time.sleep(1.0)
        self.progress.event(f"engine: {len(self.engine.replicas)} {self.engine.title} server(s) healthy after "
                            f"{time.monotonic() - t0:.0f}s")
        self.engine.join_all()
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

    def data_account(self, store_url: str) -> DataAccount | None:
        """The rollout's account of the data (produced, filtered, trained, left over), or None if unreadable."""
        try:
            store = open_store(store_url)
        except (ValueError, StoreError):
            return None
        try:
            return data_account(store)
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
        self.restarts = self.group_restarts = 0
        self.role_restarts, self.generations = {}, {}
        outcome = Outcome("failed", reason="not started")
        self.signals.install()
        try:
            engine_outcome = self.start_engine()
            while engine_outcome is None:
                group = self.start_attempt(attempt, store_url, config)
                try:
                    outcome = self.watch(group, attempt, store_url)
                finally:
                    if outcome.status != "succeeded":
                        self.progress.close()
                    self.stop_group(group)
                self.attempts.append({"attempt": attempt, "outcome": outcome.status, "culprit": outcome.culprit,
                                      "reason": outcome.reason, "exit_codes": group.exit_codes(),
                                      "pids": group.pids(), "role_restarts": self.role_events})
                self.try_write("metrics.jsonl", lambda: write_metrics(self.out_dir, merge_metrics(self.out_dir)))
                if outcome.status in ("succeeded", "interrupted") or outcome.failure is None:
                    break
                verdict = self.policy.decide(outcome.failure, self.counts())
                if verdict.alone:  # (the launcher restarts a role alone while it watches; a group end is a group's)
                    verdict = policy.Verdict(policy.Action.RESTART_GROUP, verdict.reason, verdict.why, verdict.rule,
                                             counted=verdict.counted, backoff=verdict.backoff)
                if outcome.status == "failed":
                    self.progress.event(f"attempt {attempt} failed: {outcome.culprit}: {outcome.reason}")
                if not verdict.restart:
                    if outcome.status == "failed":
                        self.progress.event(f"no restarts left ({verdict.why})" if verdict.reason ==
                                            "BackoffLimitExceeded" else f"not restarting: {verdict.why}")
                    if verdict.reason == "FailurePolicyRule":
                        outcome.reason = f"{outcome.reason}; {verdict.why}"
                    break
                self.restarts += int(verdict.counted)
                self.group_restarts += int(verdict.counted)
                attempt += 1
                self.progress.event(f"restarting the group in {verdict.backoff:g}s "
                                    f"(restart {self.group_restarts}/{fp.max_restarts}, attempt {attempt})")
                if not self._sleep(verdict.backoff):
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
        data = self.data_account(store_url)
        summary = summarize(records, status=status, restarts=restarts, wall_seconds=wall,
                            tokens_this_run=self.tokens_this_run, attempts=self.attempts, failure=failure,
                            name=self.name, out_dir=self.out_dir, data=data)
        summary["first_attempt"] = first_attempt
        summary["role_restarts"] = dict(self.role_restarts)
        if self.engine_resizes:
            summary["engine_resizes"] = self.engine_resizes
        if data is not None and data.left_over:
            self.progress.event(
                f"note: {data.leftover_groups} group(s) / {data.leftover_samples} sample(s) were left over at "
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
