"""An agent's episode as the gateway sees it (`rollout/gateway.py`): its chat requests turned into token ids, the
engine's answers recorded as they were generated (docs/rl.md, "Agents").

    Session.complete(request) -> Turn      one chat request of the episode's key: its context, one generation, the
                                           answer's text; the turn enters the episode's segments as the engine's
                                           token ids and log-probabilities (loss mask 1 later), never re-encoded
    EngineGate.generate(prompt, ...)       the engine behind every session of a rollout: the requests that wait
                                           batched into one grouped call, made from the rollout's thread

Token in, token out. A request whose messages are the previous request's messages, then the answer the gateway gave
(as the agent got it: role assistant, that text), then new non-assistant messages (tool results, user turns)
continues the episode's token sequence: the new messages are rendered as the chat template renders them after an
assistant turn (`episodes.TurnCodec.messages`: the end of that turn, less the end-of-text token when the model
emitted it, the messages, the next generation prompt) and tokenised once — observations, loss mask 0 — after the
exact tokens of the conversation so far. Any other request — the agent rewrote, dropped or reordered earlier
messages, edited an answer, changed its tools, or the template renders the earlier conversation differently once the
new messages follow — starts a new token sequence (a segment) from the template's rendering of its whole
conversation. How segments train: `episodes.build_group` (one sample per segment, or per turn).

The caps: a request beyond `maxTurns` turns, with `max_tokens` above `sampling.maxNewTokens`, or whose context
reaches the token cap (`maxTokens`, at most model seqLength) fails the episode (`limit`); a turn is given at most the
room left under the cap. The sampling is the spec's (temperature, top-p: the trainer's loss is computed at the spec's
temperature, so the recorded log-probabilities must be that policy's): a request's own `temperature` and `top_p`
are not used. An engine that refuses a request (the contract's `EngineError`) fails the episode (`engine`); one with
no live server left (`EngineUnavailable`) or that fails otherwise (any other exception) is the rollout's failure,
raised by the agent runner. A session's requests are served one at a time, in arrival order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from trainingrun.contract.engine import Completion, EngineError, EngineUnavailable, GroupedEngine, GroupRequest, \
    Sampling
from trainingrun.rollout.episodes import Episode, TurnCodec, cut_at_stop, turn_text

MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")  # what a message carries to the template


class AgentFailure(Exception):
    """A request that ends its episode as failed: `reason` (contract.published.AGENT_FAILURE_REASONS), a message for
    the agent and the log, the HTTP status it is answered with."""

    def __init__(self, reason: str, message: str, status: int = 400):
        super().__init__(message)
        self.reason, self.message, self.status = reason, message, status


class Revoked(Exception):
    """The episode is over: its key no longer opens anything (answered 401)."""


@dataclass(frozen=True)
class ChatRequest:
    """A chat request, checked (`rollout/gateway.py` parses it): messages with text content."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[Any, ...] | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False


@dataclass(frozen=True)
class Limits:
    """The caps and the decoding of one run's sessions."""

    max_turns: int
    cap: int  # tokens of a sequence (maxTokens, at most model seqLength)
    max_new_tokens: int  # sampling.maxNewTokens
    stop_ids: tuple[int, ...]
    stops: tuple[str, ...]


@dataclass
class Turn:
    """One answered request."""

    text: str
    finish_reason: str  # stop | length
    prompt_tokens: int
    completion_tokens: int


class EngineGate:
    """The engine for the sessions of one rollout (see the module docstring). The engine is called from the thread
    that runs `serve` only (the rollout's: the in-process engine's CPU shim and device state belong to it; the pool
    of servers runs one call at a time), with the requests that wait as one grouped call (per max new tokens), once
    every live session has one waiting (`live()`), or `window` seconds after the first arrived; each request is
    answered as soon as its completion finished (`on_group`). `sampling` is the spec's; each call gets its seed from
    `seeds` (the in-process engine draws per call), each request its own (`GroupRequest.seed`). An engine that
    raises something else than the contract's `EngineError` has failed, not the request: `serve` raises it (after
    the waiting requests got it)."""

    def __init__(self, engine, sampling: Sampling, *, live: Callable[[], int], seeds: Callable[[], int],
                 window: float = 0.1):
        self.engine, self.sampling = engine, sampling
        self.live, self.seeds, self.window = live, seeds, window
        self.grouped = isinstance(engine, GroupedEngine)
        self.calls = 0
        self._pending: list[_Pending] = []
        self._cv = threading.Condition()
        self._closed = False

    def generate(self, prompt: list[int], max_new: int, seed: int, affinity: str) -> Completion:
        """One completion of `prompt` with at most `max_new` new tokens (raises what the engine raised)."""
        p = _Pending(prompt, max_new, seed, affinity)
        with self._cv:
            if self._closed:
                raise EngineUnavailable("the rollout's gateway is closing")
            self._pending.append(p)
            self._cv.notify_all()
        p.done.wait()
        if p.error is not None:
            raise p.error
        assert p.result is not None
        return p.result

    def notify(self) -> None:
        """A session went away: the dispatcher may not need to wait for it."""
        with self._cv:
            self._cv.notify_all()

    def serve(self, done: threading.Event) -> None:
        """Send the waiting requests to the engine, in this thread, until `done` is set (module docstring)."""
        while not done.is_set():
            with self._cv:
                if not self._pending:
                    self._cv.wait(0.1)
                    continue
                first = time.monotonic()
                while len(self._pending) < self.live() and time.monotonic() - first < self.window:
                    self._cv.wait(max(0.0, self.window - (time.monotonic() - first)))
                batch, self._pending = self._pending, []
            by_budget: dict[int, list[_Pending]] = {}
            for p in batch:
                by_budget.setdefault(p.max_new, []).append(p)
            for _max_new, group in sorted(by_budget.items(), reverse=True):
                try:
                    self._call(group)
                except EngineError as exc:
                    refused = not isinstance(exc, EngineUnavailable)
                    for p in group if refused else batch:
                        p.fail(exc)
                    if not refused:
                        raise
                except BaseException as exc:
                    for p in batch:
                        p.fail(exc)
                    raise

    def close(self) -> None:
        with self._cv:
            self._closed = True
            waiting, self._pending = self._pending, []
            self._cv.notify_all()
        for p in waiting:
            p.fail(EngineUnavailable("the rollout's gateway closed"))

    def _call(self, group: Sequence[_Pending]) -> list[Completion]:
        """One engine call for `group` (one max new tokens); each pending is resolved as its completion finishes."""
        self.calls += 1
        sampling = replace(self.sampling, max_new_tokens=group[0].max_new,
                           seed=group[0].seed if len(group) == 1 else self.seeds())
        if self.grouped:
            requests = [GroupRequest(prompt=p.prompt, n=1, seed=p.seed, affinity=p.affinity) for p in group]

            def on_group(i: int, comps: list[Completion]) -> bool:
                group[i].resolve(comps[0])
                return False

            out = self.engine.generate_groups(requests, sampling, on_group=on_group)
        else:
            out = self.engine.generate([p.prompt for p in group], 1, sampling)
        comps = [c[0] for c in out]
        for p, c in zip(group, comps):
            p.resolve(c)
        return comps


@dataclass
class _Pending:
    prompt: list[int]
    max_new: int
    seed: int
    affinity: str
    done: threading.Event = field(default_factory=threading.Event)
    result: Completion | None = None
    error: BaseException | None = None

    def resolve(self, c: Completion) -> None:
        if not self.done.is_set():
            self.result = c
            self.done.set()

    def fail(self, exc: BaseException) -> None:
        if not self.done.is_set():
            self.error = exc
            self.done.set()


class Session:
    """One episode's requests (see the module docstring). `wake` is set when the episode's runner has to look: the
    episode failed here (its agent is then stopped), or — set by the runner — its agent exited."""

    def __init__(self, episode: Episode, key: str, *, codec: TurnCodec, gate: EngineGate, limits: Limits,
                 seed: int):
        self.episode, self.key = episode, key
        self.codec, self.gate, self.limits, self.seed = codec, gate, limits, seed
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.conversation: list[dict[str, Any]] | None = None  # what the next request extends
        self.tools: tuple[Any, ...] | None = None
        self.after_eos = False
        self.requests = 0
        self.seconds = 0.0
        self.latencies: list[float] = []
        self.fatal: BaseException | None = None  # the engine failed (the rollout fails with it)

    @property
    def rewrites(self) -> int:
        return len(self.episode.sequences()) - 1 if self.episode.segments else 0

    def complete(self, request: ChatRequest) -> Turn:
        """Answer one request (Revoked: the episode is over; AgentFailure: the episode failed with it; anything else
        — EngineUnavailable, the engine's own failure — fails the rollout: `fatal`)."""
        t0 = time.monotonic()
        with self.lock:
            if self.episode.end is not None:
                raise Revoked()
            try:
                return self._complete(request)
            except AgentFailure as exc:
                self._fail(exc.reason, exc.message)
                raise
            finally:
                self.requests += 1
                self.latencies.append(time.monotonic() - t0)

    def finish(self, reward: float | None, reason: str | None = None, message: str = "") -> None:
        """The agent is done: its reward, or why it failed (unless the episode failed here first)."""
        with self.lock:
            e = self.episode
            if e.end is None:
                if reason is None:
                    assert reward is not None
                    e.rewards.append(float(reward))
                    e.finish("done")
                else:
                    e.finish("failed", reason, message)
            self.wake.set()

    def refuse(self, failure: AgentFailure) -> None:
        """A request refused before it could be read (no length, too large, not JSON): the episode fails with it."""
        with self.lock:
            self.requests += 1
            self._fail(failure.reason, failure.message)

    def _fail(self, reason: str, message: str) -> None:
        if self.episode.end is None:
            self.episode.finish("failed", reason, message)
        self.wake.set()

    def _complete(self, request: ChatRequest) -> Turn:
        e, lim = self.episode, self.limits
        if len(e.turns) >= lim.max_turns:
            raise AgentFailure("limit", f"request {len(e.turns) + 1}: an episode has at most maxTurns "
                                        f"{lim.max_turns} model turns")
        if request.max_tokens is not None and request.max_tokens > lim.max_new_tokens:
            raise AgentFailure("limit", f"max_tokens {request.max_tokens} is above the run's sampling.maxNewTokens "
                                        f"{lim.max_new_tokens}")
        added, fresh = self._context(request)
        context = ([] if fresh else e.context()) + [int(t) for t in added]
        if len(context) >= lim.cap:
            raise AgentFailure("limit", f"the conversation has {len(context)} tokens; an episode's sequence has at "
                                        f"most maxTokens {lim.cap} (no room for an answer)")
        max_new = min(request.max_tokens or lim.max_new_tokens, lim.cap - len(context))
        seed = int(np.random.SeedSequence([self.seed, len(e.turns), 0xA6]).generate_state(1)[0])
        try:
            comp = self.gate.generate(context, max_new, seed, self.key)
        except EngineError as exc:
            if not isinstance(exc, EngineUnavailable):
                raise AgentFailure("engine", f"the engine refused the request: {exc}", status=500) from None
            self.fatal = exc
            self.wake.set()
            raise
        except Exception as exc:  # the engine failed, not the request: the rollout's failure
            self.fatal = exc
            self.wake.set()
            raise
        stops = lim.stops + tuple(s for s in request.stop if s not in lim.stops)
        tokens, logps = cut_at_stop(comp.tokens, comp.logprobs, self.codec.tokenizer, stops)
        tokens, logps = np.asarray(tokens, np.int32), np.asarray(logps, np.float32)
        if fresh and e.segments:
            e.starts.append(len(e.segments))
        e.segments.append((np.asarray(added, np.int32), None))
        e.segments.append((tokens, logps))
        text = turn_text(tokens, self.codec.tokenizer, lim.stop_ids, stops)
        self.conversation = [*request.messages, {"role": "assistant", "content": text}]
        self.tools = request.tools
        self.after_eos = bool(len(tokens)) and int(tokens[-1]) == self.codec.eos_id
        finish = "length" if comp.finish_reason == "length" and len(tokens) == len(comp.tokens) else "stop"
        return Turn(text=text, finish_reason=finish, prompt_tokens=len(context), completion_tokens=len(tokens))

    def _context(self, request: ChatRequest) -> tuple[np.ndarray, bool]:
        """(the tokens the request adds, whether they start a new sequence): see the module docstring."""
        conv, msgs = self.conversation, list(request.messages)
        if (conv is not None and request.tools == self.tools and len(msgs) > len(conv)
                and msgs[:len(conv)] == conv and all(m["role"] != "assistant" for m in msgs[len(conv):])):
            try:
                return self.codec.messages(msgs[len(conv):], after_eos=self.after_eos), False
            except ValueError:
                pass  # the template renders them only as a whole conversation: a new sequence
        try:
            return self.codec.conversation(msgs, request.tools), True
        except ValueError as exc:
            raise AgentFailure("invalid", f"messages: the chat template cannot render them: {exc}") from None

