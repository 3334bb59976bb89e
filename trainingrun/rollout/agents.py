"""Agents through the gateway (`rollout.source.generate.agent`; docs/rl.md, "Agents"): any agent program or service
trains the policy by calling the rollout's OpenAI-compatible gateway (`rollout/gateway.py`).

Each prompt starts groupSize episodes, `concurrency` at a time. An episode gets a fresh random key; the gateway
attributes requests to episodes by it (`rollout/sessions.py`: token in, token out). The task is the prompt record as
JSON, `{"prompt": text, "answer": reference, "meta": {...}}`.

    command   the argv is run once per episode as a child of the rollout process (in a cluster: in the rollout pod's
              image), in a process group of its own that dies with the rollout (`childproc.dying_with_parent`), with
              the environment
                  OPENAI_BASE_URL   http://127.0.0.1:PORT/v1 (the gateway)
                  OPENAI_API_KEY    the episode's key
                  TRAININGRUN_TASK  the task (the same JSON, and a newline, on stdin)
                  OMP_NUM_THREADS   1
              (the rollout's own TRAININGRUN_* variables are not passed on). It ends the episode by printing
              {"reward": R} as its last stdout line and exiting 0. When it exits, runs past timeoutSeconds, or its
              episode fails at the gateway, its process group is killed (so nothing it started outlives the episode).
    url       POST url {"task": ..., "base_url": ..., "api_key": ...}, answered {"reward": R} within timeoutSeconds.

An episode fails — reward failedReward, counted by reason (`contract.published.AGENT_FAILURE_REASONS`), its tokens
so far train as they are, the other episodes go on — when its agent exits non-zero (`exit`), runs past
timeoutSeconds (`timeout`), ends without a reward line or with one that is not a finite number (`no_reward`), sends a
malformed request (`invalid`) or one past the caps (`limit`), when the engine refuses a request (`engine`), or when
the service cannot be reached or answers an error (`error`). A command that cannot be started is a configuration
error (exit 78); no live engine left fails the rollout (exit 1, restarted) after its agents were stopped.

The episode's reward is the agent's; its samples are built as an environment's (`episodes.build_group` with
`EpisodeRules(episode_reward="final", sequence_ids=True)`): one per token sequence (`samples: episode`; sample id
(g·n + i)·maxTurns + s for sequence s of episode i of group g) or one per turn (`turn`; as for environments).
Episodes are not reproducible: the agents' timing decides which requests share an engine call.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from trainingrun.childproc import dying_with_parent
from trainingrun.contract.engine import Engine, Sampling
from trainingrun.contract.errors import ConfigError
from trainingrun.rollout.episodes import Episode, EpisodeRules, TurnCodec
from trainingrun.rollout.gateway import FIELD, Gateway
from trainingrun.rollout.prompts import Prompt
from trainingrun.rollout.sessions import EngineGate, Limits, Session

STDOUT_TAIL = 64 * 1024  # bytes of an agent's stdout kept (the reward line is the last)
STDERR_TAIL = 2 * 1024  # ... of its stderr (for a failure's message)


def parse_reward(stdout: bytes) -> tuple[float | None, str]:
    """(the reward of the last non-empty stdout line `{"reward": R}`, "") or (None, what is wrong)."""
    lines = [ln for ln in stdout.decode("utf-8", errors="replace").splitlines() if ln.strip()]
    if not lines:
        return None, "no output: the last stdout line must be {\"reward\": R}"
    return reward_of(lines[-1], "the last stdout line")


def reward_of(text: str, where: str) -> tuple[float | None, str]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    reward = value.get("reward") if isinstance(value, dict) else None
    if (not isinstance(reward, (int, float)) or isinstance(reward, bool)) or not math.isfinite(reward):
        return None, f"{where} is not {{\"reward\": R}} with a finite number R: {text[:200]!r}"
    return float(reward), ""


def agent_environment(base_url: str, key: str, task: str) -> dict[str, str]:
    """The environment of an agent process (module docstring)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAININGRUN_")}
    env.update({"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": key, "TRAININGRUN_TASK": task,
                "OMP_NUM_THREADS": "1"})
    return env


def gateway_address(agent) -> tuple[str, str]:
    """(the address the gateway listens on, the one agents are given): loopback for the rollout's own agents and
    locally; in a cluster an agent service reaches the pod's address (its host name resolves to it)."""
    if agent.command is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        return "0.0.0.0", socket.gethostbyname(socket.gethostname())
    return "127.0.0.1", "127.0.0.1"


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of `proc` (its leader is not reaped yet, so the group id is still its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class ProcessIO(threading.Thread):
    """Feeds an agent process its stdin, keeps the tails of its stdout and stderr, and sets `exited` (and `wake`)
    once it exited — without reaping it, so its process group cannot be reused before it is killed."""

    def __init__(self, proc: subprocess.Popen, stdin: bytes, wake: threading.Event):
        super().__init__(name=f"agent-io-{proc.pid}", daemon=True)
        self.proc, self.stdin, self.wake = proc, stdin, wake
        self.stdout, self.stderr = bytearray(), bytearray()
        self.exited = threading.Event()

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        p = self.proc
        assert p.stdin is not None and p.stdout is not None and p.stderr is not None
        os.set_blocking(p.stdin.fileno(), False)
        sel.register(p.stdin, selectors.EVENT_WRITE)
        sel.register(p.stdout, selectors.EVENT_READ, (self.stdout, STDOUT_TAIL))
        sel.register(p.stderr, selectors.EVENT_READ, (self.stderr, STDERR_TAIL))
        sent = 0
        try:
            while sel.get_map():
                for key, _ in sel.select(timeout=0.2):
                    if key.fileobj is p.stdin:
                        try:
                            sent += os.write(p.stdin.fileno(), self.stdin[sent:])
                        except (BrokenPipeError, OSError):
                            sent = len(self.stdin)
                        if sent >= len(self.stdin):
                            sel.unregister(p.stdin)
                            p.stdin.close()
                        continue
                    buf, tail = key.data
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    buf += chunk
                    del buf[:-tail]
                self._check_exit()
            while not self.exited.is_set():
                self._check_exit()
                self.exited.wait(0.05)
        finally:
            sel.close()

    def _check_exit(self) -> None:
        if self.exited.is_set():
            return
        try:
            done = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped already
            done = True
        if done:
            self.exited.set()
            self.wake.set()


class AgentRunner:
    """Runs the episodes of a rollout's prompts with the spec's agent (module docstring); the counterpart of
    `episodes.EpisodeRunner`. `agent` is the spec's AgentSpec; `model` the name /v1/models gives."""

    def __init__(self, agent, *, tokenizer, stop_ids: Sequence[int], stops: Sequence[str], max_new_tokens: int,
                 seq_length: int, model: str, say: Callable[[str], None] | None = None):
        self.agent = agent
        self.say = say or (lambda _msg: None)
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{FIELD}: the gateway renders chat messages with the model's chat template, and "
                              "model.hf's tokenizer has none (tokenizer_config.json chat_template)")
        if agent.max_tokens is not None and agent.max_tokens > seq_length:
            raise ConfigError(f"{FIELD}.maxTokens: {agent.max_tokens} exceeds model seqLength {seq_length}")
        # no probe of the roles: a template that renders earlier turns differently later makes new segments here
        self.codec = TurnCodec(tokenizer, chat=True, eos_id=getattr(tokenizer, "eos_id", None), field=FIELD,
                               probe_roles=False)
        self.limits = Limits(max_turns=agent.max_turns, cap=agent.max_tokens or seq_length,
                             max_new_tokens=max_new_tokens, stop_ids=tuple(stop_ids), stops=tuple(stops))
        self.rules = EpisodeRules(samples=agent.samples, max_turns=agent.max_turns, failed_reward=agent.failed_reward,
                                  episode_reward="final", sequence_ids=True)
        if agent.command is not None and shutil.which(agent.command[0]) is None:
            raise ConfigError(f"{FIELD}.command: {agent.command[0]!r} is not a program this rollout can run (not "
                              "found, or not executable)")
        host, advertise = gateway_address(agent)
        self.gateway = Gateway(host=host, port=agent.port or 0, advertise=advertise, model=model,
                               max_handlers=max(64, 4 * agent.concurrency), say=self.say).start()
        self.say(f"rollout: the agents' gateway listens at {self.gateway.base_url}")
        self.messages: list[str] = []  # the first few failures of the last run
        self.sessions: list[Session] = []  # the last run's
        self.fatal: BaseException | None = None
        self._live = 0
        self._lock = threading.Lock()

    def close(self) -> None:
        self.gateway.close()

    # ---- one rollout's episodes
    def run(self, engine: Engine, prompts: Sequence[Prompt], n: int, sampling: Sampling, *, seed: int,
            dataset: dict[str, Any] | None = None) -> list[list[Episode]]:
        """groupSize (`n`) episodes of every prompt, in prompt order (`dataset` is unused: the task is the prompt
        record). Raises what ended the rollout: ConfigError (the command cannot run), EngineUnavailable."""
        del dataset
        self.messages, self.fatal = [], None
        episodes = [Episode(key=j * n + i, group=j, member=i) for j in range(len(prompts)) for i in range(n)]
        calls = itertools.count()
        gate = EngineGate(engine, sampling, live=lambda: self._live,
                          seeds=lambda: int(np.random.SeedSequence([seed, next(calls), 0xC4]).generate_state(1)[0]))
        self.sessions = [Session(e, f"tr-{secrets.token_urlsafe(24)}", codec=self.codec, gate=gate,
                                 limits=self.limits,
                                 seed=int(np.random.SeedSequence([seed, e.key, 0xE8]).generate_state(1)[0]))
                         for e in episodes]
        left, done = [len(self.sessions)], threading.Event()

        def episode(s: Session) -> None:
            try:
                self._episode(s, prompts[s.episode.group], gate)
            finally:
                with self._lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()

        try:
            with ThreadPoolExecutor(self.agent.concurrency, thread_name_prefix="agent") as pool:
                futures = [pool.submit(episode, s) for s in self.sessions]
                try:
                    gate.serve(done)  # the engine's calls, in this thread
                except BaseException as exc:
                    self._stop_all(exc)
                    gate.close()
                for f in futures:
                    f.result()
        finally:
            gate.close()
        if self.fatal is not None:
            raise self.fatal
        return [episodes[j * n:(j + 1) * n] for j in range(len(prompts))]

    def counts_extra(self) -> dict[str, Any]:
        """The last run's gateway counts (fields of contract.published.EpisodeCounts)."""
        return {"agent": True, "requests": sum(s.requests for s in self.sessions),
                "request_seconds": float(sum(sum(s.latencies) for s in self.sessions)),
                "unauthorized": self.gateway.take_unauthorized(), "rewrites": sum(s.rewrites for s in self.sessions)}

    def latencies(self) -> list[float]:
        return [x for s in self.sessions for x in s.latencies]

    def _episode(self, session: Session, prompt: Prompt, gate: EngineGate) -> None:
        task = {"prompt": prompt.text, "answer": prompt.reference, "meta": prompt.meta}
        reward, reason, message = None, "error", "not started: the rollout is failing"
        if self.fatal is None:
            with self._lock:
                self._live += 1
            self.gateway.open(session.key, session)
            try:
                run = self._process if self.agent.command is not None else self._service
                reward, reason, message = run(session, json.dumps(task, default=str))
            except BaseException as exc:  # noqa: BLE001 - ends the rollout (raised by run)
                self._stop_all(exc)
            finally:
                self.gateway.close_key(session.key)
                with self._lock:
                    self._live -= 1
                gate.notify()
        if session.fatal is not None:
            self._stop_all(session.fatal)
        session.finish(reward, reason, message)
        e = session.episode
        if e.end == "failed" and len(self.messages) < 5:
            self.messages.append(f"{e.failure}: {e.message}")

    def _stop_all(self, exc: BaseException) -> None:
        """The rollout fails: every running agent is stopped, no other one starts."""
        if self.fatal is None:
            self.fatal = exc
        for s in self.sessions:
            s.wake.set()

    def _process(self, session: Session, task: str) -> tuple[float | None, str | None, str]:
        argv, preexec = dying_with_parent(self.agent.command)
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=agent_environment(self.gateway.base_url, session.key, task),
                                    start_new_session=True, preexec_fn=preexec, close_fds=True)
        except OSError as exc:
            raise ConfigError(f"{FIELD}.command: cannot run {self.agent.command}: {exc.strerror or exc}") from None
        io = ProcessIO(proc, task.encode() + b"\n", session.wake)
        io.start()
        fired = session.wake.wait(self.agent.timeout_seconds)
        kill_group(proc)
        proc.wait()
        io.join(10)
        if not fired:
            return None, "timeout", f"ran past timeoutSeconds {self.agent.timeout_seconds:g}; its process group " \
                                    "was killed"
        if not io.exited.is_set() or session.episode.end is not None:
            return None, "error", "stopped"  # failed at the gateway, or the rollout fails: the earlier cause stays
        if proc.returncode != 0:
            err = [ln for ln in io.stderr.decode("utf-8", errors="replace").splitlines() if ln.strip()]
            return None, "exit", f"exited with {proc.returncode}" + (f": {err[-1][:300]}" if err else "")
        reward, why = parse_reward(bytes(io.stdout))
        return (reward, None, "") if reward is not None else (None, "no_reward", why)

    def _service(self, session: Session, task: str) -> tuple[float | None, str | None, str]:
        assert self.agent.url is not None
        body = json.dumps({"task": json.loads(task), "base_url": self.gateway.base_url,
                           "api_key": session.key}).encode()
        out: dict[str, tuple[float | None, str | None, str]] = {}

        def post() -> None:
            request = urllib.request.Request(self.agent.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.agent.timeout_seconds) as r:
                    text = r.read(STDOUT_TAIL).decode("utf-8", errors="replace")
                reward, why = reward_of(text.strip(), "the service's answer")
                out["result"] = (reward, None, "") if reward is not None else (None, "no_reward", why)
            except urllib.error.HTTPError as exc:
                out["result"] = (None, "error", f"HTTP {exc.code} from {self.agent.url}: "
                                                f"{exc.read(300).decode('utf-8', errors='replace')}")
            except (TimeoutError, socket.timeout):
                out["result"] = (None, "timeout", f"no answer within timeoutSeconds {self.agent.timeout_seconds:g}")
            except (urllib.error.URLError, OSError, ValueError) as exc:
                reason = getattr(exc, "reason", exc)
                out["result"] = ((None, "timeout", f"no answer within timeoutSeconds {self.agent.timeout_seconds:g}")
                                 if isinstance(reason, TimeoutError) else
                                 (None, "error", f"{self.agent.url}: {reason}"))
            finally:
                session.wake.set()

        threading.Thread(target=post, name="agent-post", daemon=True).start()
        if not session.wake.wait(self.agent.timeout_seconds + 5) or "result" not in out:
            if session.episode.end is not None or self.fatal is not None:
                return None, "error", "stopped"
            return None, "timeout", f"no answer within timeoutSeconds {self.agent.timeout_seconds:g}"
        return out["result"]


def model_name(hf: str | None) -> str:
    """The policy's name at /v1/models: model.hf's directory name."""
    return Path(hf).name if hf else "policy"
