"""Rewards of generated rollouts (`rollout.source.generate.reward`): a table of reward types, run so that a bad reward
never stops the rollout.

A reward type scores a batch: it gets the batch's `RewardSample`s — each with the prompt (its text where there is text,
and its tokens), the response (the decoded text, or the token ids for token references) and its tokens, the
reference (the prompt's answer) and the prompt's meta — and returns one reward per sample (`REWARD_KINDS`):

    exact_match    1.0 if the response equals the reference, else 0.0 (token ids for the built-in tasks; text is
                   compared stripped of surrounding white space)
    token_match    fraction of reference positions the response gets right, over max(len(response), len(reference))
                   (a too long or too short answer loses the missing/extra positions); built-in tasks
    reasoning_gym  the reasoning-gym task's own `score_answer` on the prompt's dataset entry (the sample's `index`)
    math_verify    math-verify: 1.0 if the response's math equals the reference's (`\\boxed{18}`, `18 dollars`, ...)
    function       a user function `module:function` called as function(response, reference) -> float, per sample
    remote         a reward service of the user's own over HTTP, batches of samples per request
                   (`rollout/reward_services.py`)
    judge          an LLM judge behind an OpenAI-compatible chat endpoint, one request per sample; its raw answers are
                   kept (`Answer`, `Scored.raw`)

`exact_match` and `token_match` are pure comparisons and run in the rollout process, on the whole batch; `remote`
and `judge` too, their requests in a bounded thread pool with their own timeouts, retries and failure reasons
(`http`, `unreachable`, `timeout`, `invalid`, `nan`: `rollout/reward_services.py`). The others are *isolated*: they
run in `workers` spawned processes (`RewardPool`), one sample per call: each call gets `timeoutSeconds`; a call that
raises, times out (its worker is killed and replaced) or returns something that is not a finite number is a *failed*
reward: the sample gets `failedReward`, the failure is counted by reason (`error`, `timeout`, `nan`) and reported,
and the rollout goes on. An in-process reward type that raises fails its whole batch (`error`), as does one that
returns another number of rewards than it got samples; a per-sample type (`per_sample`) fails only the sample that
raised; a batch function may fail single samples with its own reason (`Failed(message, reason)`). Samples travel to
the workers as JSON over pipes (`RewardSample.to_json`; no pickle); for reasoning_gym each worker builds the same
seeded dataset.

A new reward type is one entry of `REWARD_KINDS` (a builder of its batch function from the `RewardConfig`, and
whether it is isolated), its value in the spec's `api.models.RewardType`, and a row in docs/rl.md ("Rewards").
"""

from __future__ import annotations

import importlib
import json
import math
import multiprocessing
import os
import multiprocessing.connection
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from trainingrun.childproc import PipeWorker
from trainingrun.rollout.prompts import Prompt, reasoning_gym_dataset
from trainingrun.rollout.reward_services import JudgeReward, RemoteReward, Service, Verdict, resolve_headers

FAILURE_REASONS = ("error", "timeout", "nan")  # always counted (0 when none); services add theirs when they occur


# ------------------------------------------------------------------------------------------------------ samples
@dataclass(frozen=True)
class RewardSample:
    """One sample as a reward type sees it (JSON-able: it travels to the reward workers as `to_json`)."""

    prompt: str | None  # the prompt's text (text tasks; None for token prompts)
    prompt_tokens: list[int]  # what the engine was given
    response: Any  # the completion's text without the stop token, or its token ids for token references
    response_tokens: list[int]  # the completion's token ids (stop token included)
    reference: Any  # the prompt's answer (token ids for the built-in tasks, text or a number otherwise; may be None)
    meta: dict[str, Any] = field(default_factory=dict)  # the prompt's meta (jsonl prompts)
    index: int = 0  # the prompt's position in its source (reasoning-gym: its dataset index)

    @classmethod
    def of(cls, prompt: Prompt, response: Any, response_tokens: Sequence[int]) -> RewardSample:
        """The sample of `prompt` answered by `response` (tokens `response_tokens`)."""
        return cls(prompt=prompt.text, prompt_tokens=[int(t) for t in prompt.tokens], response=response,
                   response_tokens=[int(t) for t in response_tokens], reference=prompt.reference,
                   meta=dict(prompt.meta), index=int(prompt.index))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RewardSample:
        return cls(**d)


@dataclass(frozen=True)
class Failed:
    """A sample a batch reward could not score (its place in the returned list): why, the reason it is counted under
    (`error` unless the reward says otherwise) and the service's raw answer, if any."""

    message: str
    reason: str = "error"
    raw: str | None = None


@dataclass(frozen=True)
class Answer:
    """A reward with the service's raw answer, kept for inspection (the judge's text)."""

    value: Any
    raw: str


BatchReward = Callable[[Sequence[RewardSample]], list[Any]]  # a batch → one reward (or `Failed`) per sample


def per_sample(fn: Callable[[RewardSample], Any]) -> BatchReward:
    """A reward of one sample as a batch reward: each sample scored on its own; one that raises is `Failed` alone."""
    def score(samples: Sequence[RewardSample]) -> list[Any]:
        out: list[Any] = []
        for s in samples:
            try:
                out.append(fn(s))
            except Exception as exc:  # noqa: BLE001 - a reward's failure is recorded, never raised
                out.append(Failed(f"{type(exc).__name__}: {exc}"))
        return out
    return score


# ------------------------------------------------------------------------------------------------------ rewards
def _text(x: Any) -> Any:
    return x.strip() if isinstance(x, str) else list(x)


def exact_match(response: Any, reference: Any) -> float:
    return 1.0 if _text(response) == _text(reference) else 0.0


def token_match(response: Sequence, reference: Sequence) -> float:
    response, reference = list(response), list(reference)
    n = max(len(response), len(reference))
    if n == 0:
        return 1.0
    return sum(a == b for a, b in zip(response, reference)) / n


def math_verify(response: str, reference: Any) -> float:
    from math_verify import parse, verify  # deferred: math_verify

    # timeouts off: math-verify's own use signal.alarm, which only works in a main thread; the pool enforces ours
    gold = parse(str(reference), parsing_timeout=None)
    answer = parse(str(response), parsing_timeout=None)
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0


def load_named(path: str, field: str) -> Callable:
    """`module:name` → that callable (a function or a class); ValueError naming `field` when it cannot be loaded."""
    module, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{field}: cannot load {path!r}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"{field}: {path!r} is not callable")
    return fn


def load_function(path: str) -> Callable[[Any, Any], float]:
    """`module:function` → the function; ValueError naming reward.function when it cannot be imported."""
    return load_named(path, "rollout.source.generate.reward.function")


@dataclass(frozen=True)
class RewardConfig:
    """What a worker needs to build its scorer (JSON-able: it is sent to spawned processes)."""

    type: str
    function: str | None = None
    dataset: dict[str, Any] | None = None  # reasoning_gym: name, config, seed, size
    service: dict[str, Any] | None = None  # remote, judge: reward.remote / reward.judge (headers: Secret references)
    timeout: float = 10.0  # remote, judge: seconds per request
    place: str = "reward"  # remote, judge: whose headers ("reward": the run's, "eval": the evaluation's; header_env)

    @classmethod
    def of(cls, reward, *, dataset: dict[str, Any] | None = None, place: str = "reward") -> RewardConfig:
        """The config of a `RewardSpec` (`place` as in `api.spec.rollout.header_env`)."""
        service = reward.service()
        return cls(type=reward.type, function=reward.function, dataset=dataset,
                   service=None if service is None else service.model_dump(), timeout=reward.timeout_seconds,
                   place=place)

    @property
    def kind(self) -> RewardKind:
        kind = REWARD_KINDS.get(self.type)
        if kind is None:
            raise ValueError(f"rollout.source.generate.reward.type: unknown {self.type!r}")
        return kind

    def scorer(self) -> BatchReward:
        """The reward type's batch function."""
        return self.kind.build(self)


def _pairs(fn: Callable[[Any, Any], float]) -> Callable[[RewardConfig], BatchReward]:
    """The builder of a reward of (response, reference), scored per sample."""
    return lambda config: per_sample(lambda s: fn(s.response, s.reference))


def _user_function(config: RewardConfig) -> BatchReward:
    """`reward.function`, called as function(response, reference) -> float (the user's contract), per sample."""
    assert config.function is not None
    return _pairs(load_function(config.function))(config)


def _reasoning_gym(config: RewardConfig) -> BatchReward:
    assert config.dataset is not None
    ds = reasoning_gym_dataset(**config.dataset)
    return per_sample(lambda s: float(ds.score_answer(answer=s.response, entry=ds[int(s.index)])))


class ServiceBatch:
    """A reward served over HTTP (`rollout/reward_services.py`) as a batch reward: samples go as their JSON objects,
    each `Verdict` comes back as a value, an `Answer` (with the judge's text) or a `Failed` with its reason."""

    def __init__(self, scorer: RemoteReward | JudgeReward):
        self.scorer = scorer

    def __call__(self, samples: Sequence[RewardSample]) -> list[Any]:
        return [self.outcome(v) for v in self.scorer([s.to_json() for s in samples])]

    @staticmethod
    def outcome(v: Verdict) -> Any:
        if v.reason is not None:
            return Failed(v.message, reason=v.reason, raw=v.raw)
        return Answer(v.value, v.raw) if v.raw is not None else v.value

    def close(self) -> None:
        self.scorer.close()


def _service(config: RewardConfig) -> Service:
    assert config.service is not None
    s = config.service
    at = {"reward": "rollout.source.generate.reward", "eval": "rollout.eval.reward"}.get(config.place, config.place)
    headers = resolve_headers(s.get("headers") or {}, config.place, field_path=f"{at}.{config.type}")
    return Service(url=s["url"], timeout=config.timeout, retries=s["retries"], concurrency=s["concurrency"],
                   headers=headers)


def _remote(config: RewardConfig) -> BatchReward:
    assert config.service is not None
    return ServiceBatch(RemoteReward(_service(config), batch_size=config.service["batch_size"]))


def _judge(config: RewardConfig) -> BatchReward:
    j = config.service
    assert j is not None
    return ServiceBatch(JudgeReward(_service(config), model=j["model"], template=j["template"], pattern=j["pattern"],
                                    scale=j["scale"], max_tokens=j["max_tokens"], temperature=j["temperature"]))


@dataclass(frozen=True)
class RewardKind:
    """One reward type (`reward.type`, module docstring)."""

    doc: str  # one line: what the reward is
    build: Callable[[RewardConfig], BatchReward]  # its batch function, built once per process
    isolated: bool = True  # scored in the worker pool, one sample per call with timeoutSeconds; False: in the
    #                        rollout process, the whole batch in one call


# The reward types: a new one is one entry here, its value in `api.models.RewardType` and a row in docs/rl.md;
# tests/unit/test_rewards_prompts.py keeps the keys equal to the Literal's values.
REWARD_KINDS: dict[str, RewardKind] = {
    "exact_match": RewardKind("1 if the response equals the reference (ids, or text stripped), else 0",
                              _pairs(exact_match), isolated=False),
    "token_match": RewardKind("fraction of positions right over max(len(response), len(reference))",
                              _pairs(token_match), isolated=False),
    "reasoning_gym": RewardKind("the reasoning-gym task's own score_answer on the prompt's dataset entry",
                                _reasoning_gym),
    "math_verify": RewardKind("math-verify: 1 if the response's math equals the reference's", _pairs(math_verify)),
    "function": RewardKind("reward.function called as function(response, reference) -> float", _user_function),
    "remote": RewardKind("a reward service over HTTP: POST {samples: [...]} -> {rewards: [...]}, batchSize per request",
                         _remote, isolated=False),
    "judge": RewardKind("an LLM judge (OpenAI-compatible chat): the first group of pattern in its answer / scale",
                        _judge, isolated=False),
}


# ------------------------------------------------------------------------------------------------------ scoring
class Result(NamedTuple):
    """One sample's scoring: its value (None when failed), the failure reason or None, why, the raw answer."""

    value: Any
    reason: str | None
    message: str = ""
    raw: str | None = None


@dataclass
class Scored:
    """Rewards of a batch and what failed."""

    rewards: list[float]
    failed: list[str | None]  # None, or the failure reason of that item
    messages: list[str] = field(default_factory=list)  # one line per failure (first few)
    raw: list[str | None] = field(default_factory=list)  # a service's raw answer of each item (judge), else None

    def counts(self) -> dict[str, int]:
        """Failures by reason: FAILURE_REASONS always, the others (a service's) when they occurred."""
        out = {r: 0 for r in FAILURE_REASONS}
        for f in self.failed:
            if f is not None:
                out[f] = out.get(f, 0) + 1
        return out


def _finite(value: Any) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _outcome(value: Any) -> Result:
    """The result of one value a batch reward returned."""
    if isinstance(value, Failed):
        return Result(None, value.reason, value.message, value.raw)
    raw = None
    if isinstance(value, Answer):
        value, raw = value.value, value.raw
    x = _finite(value)
    if x is None:
        return Result(None, "nan", f"reward returned {value!r}, not a finite number", raw)
    return Result(x, None, "", raw)


def score_batch(fn: BatchReward, samples: Sequence[RewardSample]) -> list[Result]:
    """The result of `fn` on each of `samples`: a raise, or another number of rewards than samples, fails the whole
    batch."""
    try:
        values = list(fn(samples))
    except Exception as exc:  # noqa: BLE001 - a reward's failure is recorded, never raised
        return [Result(None, "error", f"{type(exc).__name__}: {exc}")] * len(samples)
    if len(values) != len(samples):
        why = f"reward returned {len(values)} rewards for {len(samples)} samples"
        return [Result(None, "error", why)] * len(samples)
    return [_outcome(v) for v in values]


class RewardScorer:
    """Scores batches of `RewardSample`s with the configured reward type (see the module docstring)."""

    def __init__(self, config: RewardConfig, *, timeout: float, failed_reward: float, workers: int = 1):
        self.config = config
        self.timeout = timeout
        self.failed_reward = failed_reward
        isolated = config.kind.isolated
        self.pool = RewardPool(config, workers=workers, timeout=timeout) if isolated else None
        self.fn = config.scorer() if self.pool is None else None

    def score(self, samples: Sequence[RewardSample]) -> Scored:
        out = Scored(rewards=[], failed=[])
        results = self.pool.run(samples) if self.pool is not None else score_batch(self.fn, samples)
        for value, reason, message, raw in results:
            x = _finite(value) if reason is None else None
            if reason is None and x is None:
                reason, message = "nan", f"reward returned {value!r}, not a finite number"
            out.rewards.append(self.failed_reward if reason else x)
            out.failed.append(reason)
            out.raw.append(raw)
            if reason and len(out.messages) < 5:
                out.messages.append(f"{reason}: {message}")
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        close = getattr(self.fn, "close", None)
        if close is not None:
            close()


class RewardPool:
    """`workers` spawned processes running the scorer, one sample at a time each, with a deadline per sample."""

    def __init__(self, config: RewardConfig, *, workers: int, timeout: float):
        self.config = config
        self.timeout = timeout
        self.ctx = multiprocessing.get_context("spawn")
        self.workers: list[_Worker | None] = [None] * workers

    def _worker(self, i: int) -> _Worker:
        w = self.workers[i]
        if w is None or not w.proc.is_alive():
            if w is not None:
                w.stop()
            w = self.workers[i] = _Worker.start(self.ctx, self.config)
        return w

    def run(self, items: Sequence[RewardSample]) -> list[Result]:
        results: list[Result | None] = [None] * len(items)
        todo = list(range(len(items)))[::-1]
        busy: dict[int, tuple[int, float]] = {}  # worker -> (item, deadline)
        while todo or busy:
            for wi in range(len(self.workers)):
                if wi not in busy and todo:
                    item = todo.pop()
                    try:
                        w = self._worker(wi)
                    except RuntimeError as exc:
                        results[item] = Result(None, "error", str(exc))
                        continue
                    w.send(items[item])
                    busy[wi] = (item, time.monotonic() + self.timeout)
            for wi, (item, deadline) in list(busy.items()):
                w = self.workers[wi]
                assert w is not None
                if w.conn.poll(0):
                    try:
                        results[item] = w.receive()
                    except (EOFError, OSError, ValueError) as exc:
                        results[item] = Result(None, "error", f"reward worker died: {exc!r}")
                        w.stop()
                        self.workers[wi] = None
                    del busy[wi]
                elif not w.proc.is_alive():
                    results[item] = Result(None, "error", f"reward worker died (exit {w.proc.exitcode})")
                    w.stop()
                    self.workers[wi] = None
                    del busy[wi]
                elif time.monotonic() > deadline:
                    results[item] = Result(None, "timeout", f"no result within {self.timeout:g}s (worker killed)")
                    w.stop()
                    self.workers[wi] = None
                    del busy[wi]
            if busy:
                multiprocessing.connection.wait([self.workers[wi].conn for wi in busy], timeout=0.05)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        for w in self.workers:
            if w is not None:
                w.stop()
        self.workers = [None] * len(self.workers)


STARTUP_GRACE_SECONDS = 60.0


class _Worker(PipeWorker):
    @classmethod
    def start(cls, ctx, config: RewardConfig) -> _Worker:
        """Start a worker and wait until its scorer is built (imports are not counted against a reward's time)."""
        w = cls.spawn(ctx, _serve, json.dumps(config.__dict__))
        proc, parent = w.proc, w.conn
        if not parent.poll(STARTUP_GRACE_SECONDS):
            w.stop()
            raise RuntimeError(f"reward worker not ready after {STARTUP_GRACE_SECONDS:g}s")
        try:
            parent.recv_bytes()  # b"ready"
        except (EOFError, OSError):
            w.stop()
            raise RuntimeError(f"reward worker died while starting (exit {proc.exitcode})") from None
        return w

    def send(self, item: RewardSample) -> None:
        self.conn.send_bytes(json.dumps(item.to_json(), default=str).encode())

    def receive(self) -> Result:
        return Result(*json.loads(self.conn.recv_bytes()))


def _serve(conn, config_json: str) -> None:  # pragma: no cover - runs in the spawned worker
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        scorer = RewardConfig(**json.loads(config_json)).scorer()
    except Exception as exc:  # noqa: BLE001 - every call then reports it
        scorer, startup_error = None, f"{type(exc).__name__}: {exc}"
    conn.send_bytes(b"ready")
    while True:
        try:
            sample = RewardSample.from_json(json.loads(conn.recv_bytes()))
        except (EOFError, OSError):
            return
        out = [None, "error", startup_error] if scorer is None else list(score_batch(scorer, [sample])[0])
        conn.send_bytes(json.dumps(out).encode())


# ------------------------------------------------------------------------------------------------------ answers kept
class AnswerLog:
    """The raw answers of a service (the judge) of the first `keep` samples of each rollout or evaluation, for
    inspection: one JSON line per sample in `directory`/<name>.jsonl (name `rollout-<k>` or `eval-v<version>`) with
    the sample's prompt, response, reference, the answer, the reward and the failure reason. A name is rewritten the
    first time this process writes it (a restarted rollout that scores rollout k again replaces the file), appended
    after. Writing never stops the rollout: a failure is reported once and the log turns itself off."""

    def __init__(self, directory: Path | None, keep: int, say: Callable[[str], None]):
        self.directory, self.keep, self.say = directory, keep, say
        self.written: dict[str, int] = {}

    def add(self, name: str, samples: Sequence[RewardSample], scored: Scored) -> None:
        if self.directory is None or self.keep <= 0:
            return
        done = self.written.get(name, 0)
        rows = [(s, r, f, a) for s, r, f, a in zip(samples, scored.rewards, scored.failed, scored.raw)
                if a is not None or f is not None][: max(self.keep - done, 0)]
        if not rows:
            return
        path = self.directory / f"{name}.jsonl"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(path, "a" if name in self.written else "w") as fh:
                for s, reward, failed, answer in rows:
                    fh.write(json.dumps({"prompt": s.prompt, "response": s.response, "reference": s.reference,
                                         "answer": answer, "reward": reward, "failed": failed}, default=str) + "\n")
        except OSError as exc:
            self.say(f"rollout: warning: cannot keep the judge's answers in {path}: {exc}; not kept from now on")
            self.directory = None
            return
        self.written[name] = done + len(rows)
