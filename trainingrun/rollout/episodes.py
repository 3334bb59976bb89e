"""Multi-turn episodes, token in and token out (`rollout.source.generate.environment`; docs/rl.md, "Multi-turn").

Each prompt starts groupSize episodes; an episode alternates the model's turns with the environment's observations
(`trainingrun.rollout.environments`: the protocol, the built-ins and the worker pool):

    reset(prompt) → first observation ─┐
    ┌──────────────────────────────────┘
    └→ engine.generate (one call per turn for all running episodes) → the turn's token ids and log-probabilities
       → step(turn text) → (observation, reward, done) → the observation's tokens → next turn, until done

Token in, token out: the engine is given each episode's exact token ids so far, and a turn enters the sample as the
token ids the engine returned (loss mask 1, the engine's log-probabilities, the weight version) — never decoded and
encoded again. The environment's text is tokenised once, when it arrives (loss mask 0, log-probability 0), with the
run's tokenizer; with `prompts.chat` it is rendered as the chat template renders a message of its role after an
assistant turn (`TurnCodec`): the template's end of the assistant turn (minus the end-of-text token when the model
emitted it), the message, and the generation prompt of the next assistant turn. A turn ends at a stop token (kept),
after the token that completes a stop string (later tokens dropped) or at maxNewTokens; the environment sees its text
decoded once, without a trailing stop token and cut at the first stop string.

An episode ends
  done        the environment says so (its last observation is not shown);
  truncated   after maxTurns turns, or when the next turn or observation would pass the token cap (`maxTokens`, at
              most model seqLength; a turn is given at most the room left): masked (loss mask 0: it trains nothing)
              or penalised (reward truncationReward), as `truncation` says;
  failed      its environment failed (reasons: `environments.base.FAILURE_REASONS`; an observation over
              maxObservationTokens is `oversized`): reward failedReward, its tokens so far train as they are.
The episode's reward is the sum of its per-turn rewards (`episodeReward: sum`) or the last one (`final`).

Sticky routing: with an engine of several replicas (`contract.engine.AffinityEngine`, the engine pool) every request
of an episode carries its group's affinity (`env<runner>-<call>-g<group>`), so an episode's turns go to the replica
that served its previous turn, whose prefix cache holds the conversation; the episodes of one prompt share the key:
they share the prompt (their first turn is one request) and their turns then hit the same cache. The keys are
released when the call's episodes ended.

Samples (`samples`): one per episode (default: the whole token sequence, loss mask on the model's turns), or one per
turn (the turn's context, unmasked, then the turn): all with the episode's reward, so a group holds a variable number
of samples; the scheduler counts them and never splits a group. Sample ids: episode i of group g is g·n + i; turn t of
it, per turn, g·n·maxTurns + i·maxTurns + t.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from trainingrun.contract.engine import AffinityEngine, Engine, Sampling
from trainingrun.contract.errors import ConfigError
from trainingrun.contract.published import EpisodeCounts
from trainingrun.rollout.environments.base import StepResult, environment_path
from trainingrun.rollout.environments.pool import EnvironmentPool
from trainingrun.rollout.groups import SampleGroup
from trainingrun.rollout.prompts import Prompt, encode_prompt

FIELD = "rollout.source.generate.environment"
CHARS_PER_TOKEN = 16  # text beyond maxObservationTokens × this is refused unread (before tokenising)


# ------------------------------------------------------------------------------------------------------ turn text
def cut_at_stop(tokens: np.ndarray, logprobs: np.ndarray, tokenizer, stops: Sequence[str]) -> tuple[np.ndarray,
                                                                                                   np.ndarray]:
    """A completion ends after the token that completes a stop string (text tasks): later tokens are dropped."""
    if not stops or tokenizer is None:
        return tokens, logprobs
    for t in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:t])
        if any(s in text for s in stops):
            return tokens[:t], logprobs[:t]
    return tokens, logprobs


def turn_text(tokens: np.ndarray, tokenizer, stop_ids: Sequence[int], stops: Sequence[str]) -> str:
    """A completion as text: decoded once, without a trailing stop token, cut at the first stop string."""
    body = tokens[:-1] if len(tokens) and int(tokens[-1]) in stop_ids else tokens
    text = tokenizer.decode(body)
    for stop in stops:
        cut = text.find(stop)
        if cut >= 0:
            text = text[:cut]
    return text


# ------------------------------------------------------------------------------------------------------ tokens
class Reordered(ValueError):
    """The chat template renders a conversation's earlier messages differently once later ones follow."""


class TurnCodec:
    """Text → token ids, once: the first observation as a prompt (chat: one user message with the generation
    prompt), later observations as the template renders a message after an assistant turn. For agents
    (`rollout/gateway.py`) also a whole conversation (`conversation`) and several messages after an assistant turn
    (`messages`); those raise ValueError for messages the template refuses (the agent's error, not the run's).
    `field` names the spec field in configuration errors; `probe_roles`: refuse at once a template that cannot
    render user and tool messages after an assistant turn without changing the earlier text (environments)."""

    _USER, _ASSISTANT = "\x00u\x00", "\x00a\x00"

    def __init__(self, tokenizer, *, chat: bool, eos_id: int | None, field: str = FIELD, probe_roles: bool = True):
        self.tokenizer, self.chat, self.eos_id, self.field = tokenizer, chat, eos_id, field
        self._parts: dict[str, tuple[str, str] | None] = {}
        if chat:
            probe = [{"role": "user", "content": self._USER}, {"role": "assistant", "content": self._ASSISTANT}]
            self._probe = probe
            try:
                self._closed = tokenizer.render(probe)
            except ValueError as exc:
                raise ConfigError(f"{field}: the chat template cannot render a conversation: {exc}") from None
            at = self._closed.rfind(self._ASSISTANT)
            if at < 0:
                raise ConfigError(f"{field}: the chat template drops the assistant's message; cannot place turns")
            self.closing = self._closed[at + len(self._ASSISTANT):]  # after an assistant message's content
            eos_text = tokenizer.decode([eos_id]) if eos_id is not None else ""
            rest = self.closing.lstrip()
            self.closing_after_eos = rest[len(eos_text):] if eos_text and rest.startswith(eos_text) else self.closing
            for role in ("user", "tool") if probe_roles else ():
                self._delta(" probe \n", role)  # the template renders these roles after an assistant turn

    def first(self, text: str) -> np.ndarray:
        return encode_prompt(self.tokenizer, text, self.chat)

    def observation(self, text: str, role: str, *, after_eos: bool) -> np.ndarray:
        if not self.chat:
            return np.asarray(self.tokenizer.encode(text), np.int32)
        return self._after_turn_ids(self._delta(text, role), after_eos)

    def messages(self, messages: Sequence[dict[str, Any]], *, after_eos: bool) -> np.ndarray:
        """`messages` (chat) as the template renders them after an assistant turn: the end of the assistant's turn
        (less the end-of-text token when the model emitted it), the messages, the next generation prompt.
        ValueError when the template refuses them or renders the earlier conversation differently after them."""
        if len(messages) == 1 and set(messages[0]) == {"role", "content"} and isinstance(messages[0]["content"], str):
            return self._after_turn_ids(self._single(messages[0]["content"], messages[0]["role"]), after_eos)
        return self._after_turn_ids(self._render_after(messages), after_eos)

    def conversation(self, messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None = None) -> np.ndarray:
        """A whole conversation as a prompt: the template's rendering with the generation prompt (and `tools`, for
        templates that render them), tokenised. ValueError when the template refuses it."""
        text = self.tokenizer.render(list(messages), add_generation_prompt=True, tools=tools)
        ids = np.asarray(self.tokenizer.encode(text), np.int32)
        if not len(ids):
            raise ValueError("messages: the conversation renders to no tokens")
        return ids

    def _after_turn_ids(self, delta: str, after_eos: bool) -> np.ndarray:
        closing = self.closing_after_eos if after_eos else self.closing
        return np.asarray(self.tokenizer.encode(closing + delta), np.int32)

    def _render_after(self, messages: Sequence[dict[str, Any]]) -> str:
        """What the template renders for `messages` after the probe's assistant turn, with the generation prompt
        (ValueError: the template refused them; `Reordered`: it renders the probe differently before them)."""
        full = self.tokenizer.render(self._probe + list(messages), add_generation_prompt=True)
        if not full.startswith(self._closed):
            raise Reordered("the chat template renders a conversation's earlier messages differently when "
                            f"{[m.get('role') for m in messages]} messages follow")
        return full[len(self._closed):]

    def _delta(self, text: str, role: str) -> str:
        """`_single`, for environments: a template that cannot do it is a configuration error."""
        try:
            return self._single(text, role)
        except Reordered:
            raise ConfigError(f"{self.field}: the chat template renders a conversation's earlier messages "
                              f"differently when a {role!r} message follows; cannot tokenise observations "
                              "once") from None
        except ValueError as exc:
            raise ConfigError(f"{self.field}: the chat template cannot render a {role!r} message after an assistant "
                              f"turn: {exc}") from None

    def _single(self, text: str, role: str) -> str:
        """What the template renders for a `role` message after the probe's assistant turn, with the generation
        prompt (cached as the text around the content when the template inserts content as it is); ValueError as
        `_render_after`."""
        parts = self._parts.get(role, False)
        if parts:
            return parts[0] + text + parts[1]
        delta = self._render_after([{"role": role, "content": text}])
        if parts is False:  # first use of the role: is the content inserted verbatim?
            at = delta.find(text)
            verbatim = at >= 0 and delta.count(text) == 1
            self._parts[role] = (delta[:at], delta[at + len(text):]) if verbatim else None
        return delta


# ------------------------------------------------------------------------------------------------------ episodes
@dataclass(frozen=True)
class EpisodeRules:
    """How an episode's reward and samples are made: the environment's settings (`of(EnvironmentSpec)`) or an
    agent's (`rollout/agents.py`). `sequence_ids`: sample ids per token sequence (an agent's episode may hold
    several: module docstring)."""

    samples: str  # episode | turn
    max_turns: int
    failed_reward: float
    episode_reward: str = "sum"  # sum | final
    truncation: str = "mask"  # mask | penalize
    truncation_reward: float = 0.0
    sequence_ids: bool = False

    @classmethod
    def of(cls, spec) -> EpisodeRules:
        """The rules of an EnvironmentSpec (or the rules themselves)."""
        if isinstance(spec, EpisodeRules):
            return spec
        return cls(samples=spec.samples, max_turns=spec.max_turns, failed_reward=spec.failed_reward,
                   episode_reward=spec.episode_reward, truncation=spec.truncation,
                   truncation_reward=spec.truncation_reward)


@dataclass
class Episode:
    """One episode: its token segments in order (the environment's: logprobs None; the model's turns: the engine's
    log-probabilities), where each token sequence starts (one for environments; an agent that rewrote its history
    starts another), and how it went."""

    key: int  # unique within one `run` call (the pool's episode id)
    group: int  # position of its prompt in the call
    member: int  # 0 .. groupSize − 1
    segments: list[tuple[np.ndarray, np.ndarray | None]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    end: str | None = None  # None while running; "done", "truncated" or "failed"
    failure: str | None = None  # reason, when failed
    message: str = ""
    tool_calls: int = 0
    tool_errors: int = 0
    starts: list[int] = field(default_factory=lambda: [0])  # the segment each token sequence starts at

    @property
    def length(self) -> int:
        """Tokens of the current sequence."""
        return sum(len(t) for t, _ in self.segments[self.starts[-1]:])

    @property
    def turns(self) -> list[np.ndarray]:
        return [t for t, lp in self.segments if lp is not None]

    def context(self) -> list[int]:
        """The token ids of the current sequence."""
        return [int(x) for t, _ in self.segments[self.starts[-1]:] for x in t]

    def sequences(self) -> list[range]:
        """The segments of each token sequence (none empty)."""
        bounds = [*self.starts, len(self.segments)]
        return [range(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]

    def finish(self, end: str, failure: str | None = None, message: str = "") -> None:
        self.end, self.failure, self.message = end, failure, message

    def reward(self, env) -> float:
        rules = EpisodeRules.of(env)
        if self.end == "failed":
            return rules.failed_reward
        if self.end == "truncated" and rules.truncation == "penalize":
            return rules.truncation_reward
        if rules.episode_reward == "final":
            return self.rewards[-1] if self.rewards else 0.0
        return float(sum(self.rewards))

    def masked(self, env) -> bool:
        return self.end == "truncated" and EpisodeRules.of(env).truncation == "mask"

    def arrays(self, upto: int | None = None, *, start: int = 0,
               only_last: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, loss mask, logprobs) of segments[start:upto]; `only_last`: the mask (and the logprobs: 0 where
        the mask is) on the last segment only."""
        segs = self.segments[start:upto]
        trained = [lp is not None and (not only_last or k == len(segs) - 1) for k, (_, lp) in enumerate(segs)]
        tokens = np.concatenate([t for t, _ in segs]).astype(np.int32)
        mask = np.concatenate([np.full(len(t), int(on), np.uint8) for (t, _), on in zip(segs, trained)])
        logps = np.concatenate([lp.astype(np.float32) if on else np.zeros(len(t), np.float32)
                                for (t, lp), on in zip(segs, trained)])
        return tokens, mask, logps


def counts(episodes: Sequence[Episode], env, **extra: Any) -> EpisodeCounts:
    """The episodes' counts (`extra`: further fields of EpisodeCounts, e.g. an agent gateway's)."""
    failures: dict[str, int] = {}
    for e in episodes:
        if e.failure:
            failures[e.failure] = failures.get(e.failure, 0) + 1
    return EpisodeCounts(
        episodes=len(episodes), turns=sum(len(e.turns) for e in episodes),
        tool_calls=sum(e.tool_calls for e in episodes), tool_errors=sum(e.tool_errors for e in episodes),
        truncated=sum(e.end == "truncated" for e in episodes),
        response_tokens=sum(len(t) for e in episodes for t in e.turns), failures=failures,
        reward=float(sum(e.reward(env) for e in episodes)), **extra)


def build_group(group_id: int, episodes: Sequence[Episode], env, *, version: int, group_size: int) -> SampleGroup | None:
    """The samples of one prompt's episodes (see the module docstring; `env`: the EnvironmentSpec or the
    `EpisodeRules`); None when there are none (per-turn samples of episodes that all failed before their first
    turn, agents' episodes without a turn)."""
    rules = EpisodeRules.of(env)
    toks, masks, logps, rewards, ids = [], [], [], [], []
    for e in episodes:
        reward, masked = e.reward(rules), e.masked(rules)
        key = group_id * group_size + e.member
        pieces = []
        if rules.samples == "episode":
            for s, seq in enumerate(e.sequences()):
                pieces.append((e.arrays(seq.stop, start=seq.start), key * rules.max_turns + s if rules.sequence_ids
                               else key))
        else:
            turn_ends = [(seq.start, k + 1) for seq in e.sequences() for k in seq if e.segments[k][1] is not None]
            base = key * rules.max_turns
            pieces = [(e.arrays(end, start=start, only_last=True), base + t)
                      for t, (start, end) in enumerate(turn_ends)]
        for (t, m, lp), sid in pieces:
            toks.append(t)
            masks.append(np.zeros_like(m) if masked else m)
            logps.append(lp)
            rewards.append(reward)
            ids.append(sid)
    if not toks:
        return None
    return SampleGroup(group_id=group_id, tokens=toks, loss_masks=masks, rewards=np.asarray(rewards, np.float32),
                       sample_ids=np.asarray(ids, np.int64), logprobs=logps,
                       versions=np.full(len(toks), version, np.int64))


class EpisodeRunner:
    """Runs the episodes of a rollout's prompts (see the module docstring). `env` is the spec's EnvironmentSpec."""

    def __init__(self, env, *, tokenizer, chat: bool, stop_ids: Sequence[int], stops: Sequence[str],
                 max_new_tokens: int, seq_length: int, prompt_type: str,
                 say: Callable[[str], None] | None = None):
        self.env = env
        self.tokenizer, self.stop_ids, self.stops = tokenizer, tuple(stop_ids), tuple(stops)
        self.max_new_tokens = max_new_tokens
        if env.max_tokens is not None and env.max_tokens > seq_length:
            raise ConfigError(f"{FIELD}.maxTokens: {env.max_tokens} exceeds model seqLength {seq_length}")
        self.cap = env.max_tokens or seq_length
        if env.type == "calculator" and prompt_type == "synthetic":
            raise ConfigError(f"{FIELD}.type: calculator needs text prompts with answers (prompts.type reasoningGym "
                              "or jsonl)")
        if env.type == "reasoningGym" and prompt_type != "reasoningGym":
            raise ConfigError(f"{FIELD}.type: reasoningGym needs reasoning-gym prompts (prompts.type reasoningGym)")
        self.eos_id = getattr(tokenizer, "eos_id", None)
        self.codec = TurnCodec(tokenizer, chat=chat, eos_id=self.eos_id)
        self.say = say or (lambda _msg: None)
        self.pool = EnvironmentPool(environment_path(env.type, env.class_name), env.config, workers=env.workers,
                                    timeout=env.timeout_seconds, memory_mib=env.memory_mib,
                                    max_chars=env.max_observation_tokens * CHARS_PER_TOKEN, say=self.say)
        self.pool.start()
        self.stats: dict[str, float] = {"engine_calls": 0, "env_seconds": 0.0, "generate_seconds": 0.0}
        self.messages: list[str] = []  # the first few failures of the last run
        self._runs = 0  # calls of `run` so far: part of the episodes' affinity keys

    def close(self) -> None:
        self.pool.close()

    # ---- one rollout's episodes
    def run(self, engine: Engine, prompts: Sequence[Prompt], n: int, sampling: Sampling, *, seed: int,
            dataset: dict[str, Any] | None = None) -> list[list[Episode]]:
        """groupSize (`n`) episodes of every prompt, in prompt order; `sampling` is each turn's (its max_new_tokens
        lowered to the room left), its seed varied per turn and call from `seed`."""
        self.messages = []
        self._runs += 1
        episodes = [Episode(key=j * n + i, group=j, member=i) for j in range(len(prompts)) for i in range(n)]
        self._reset(episodes, prompts, seed, dataset)
        turn = 0
        try:
            while True:
                running = [e for e in episodes if e.end is None]
                if not running:
                    break
                stepped = self._turn(engine, running, sampling, seed, turn)
                self._step(stepped)
                turn += 1
        finally:
            if isinstance(engine, AffinityEngine):
                engine.release(self._affinity(j) for j in range(len(prompts)))
        self.pool.release([e.key for e in episodes])
        return [episodes[j * n:(j + 1) * n] for j in range(len(prompts))]

    def _affinity(self, group: int) -> str:
        """The affinity key of a prompt's episodes in this call (module docstring)."""
        return f"env{id(self):x}-{self._runs}-g{group}"

    def _reset(self, episodes: list[Episode], prompts: Sequence[Prompt], seed: int,
               dataset: dict[str, Any] | None) -> None:
        items = []
        for e in episodes:
            p = prompts[e.group]
            ep_seed = int(np.random.SeedSequence([seed, e.key, 0xE7]).generate_state(1)[0])
            items.append((e.key, {"text": p.text, "reference": p.reference, "index": p.index, "meta": p.meta,
                                  "tokens": p.tokens.tolist(), "dataset": dataset, "seed": ep_seed}))
        t0 = time.perf_counter()
        outcomes = self.pool.reset(items)
        self.stats["env_seconds"] += time.perf_counter() - t0
        for e in episodes:
            o = outcomes[e.key]
            first = None
            if o.ok:
                first = self.codec.first(o.value) if o.value else np.zeros(0, np.int32)
                if not len(first):
                    o = replace(o, reason="invalid", message="the first observation is empty")
            if not o.ok:
                e.segments.append((prompts[e.group].tokens.astype(np.int32), None))
                self._fail(e, o.reason, o.message)
                continue
            e.segments.append((first, None))
            if len(first) >= self.cap:
                e.finish("truncated")

    def _turn(self, engine: Engine, running: list[Episode], sampling: Sampling, seed: int,
              turn: int) -> list[tuple[Episode, np.ndarray]]:
        """One generate call per (context multiplicity, room) — normally one per turn — for every running episode;
        returns the episodes that go on to the environment with their turn text."""
        calls: dict[tuple[int, int], list[tuple[list[int], list[Episode]]]] = {}
        by_context: dict[bytes, tuple[list[int], list[Episode]]] = {}
        for e in running:
            ctx = e.context()
            key = np.asarray(ctx, np.int32).tobytes()
            by_context.setdefault(key, (ctx, []))[1].append(e)
        for ctx, eps in by_context.values():
            room = self.cap - len(ctx)
            calls.setdefault((len(eps), min(self.max_new_tokens, room)), []).append((ctx, eps))
        out = []
        for c, ((count, max_new), items) in enumerate(sorted(calls.items(), key=lambda kv: (-kv[0][1], kv[0][0]))):
            s = replace(sampling, max_new_tokens=max_new,
                        seed=int(np.random.SeedSequence([seed, turn, c, 0x7A]).generate_state(1)[0]))
            t0 = time.perf_counter()
            if isinstance(engine, AffinityEngine):  # each episode's turns to the replica of its previous turn
                completions = engine.generate([ctx for ctx, _ in items], count, s,
                                              affinities=[self._affinity(eps[0].group) for _, eps in items])
            else:
                completions = engine.generate([ctx for ctx, _ in items], count, s)
            self.stats["generate_seconds"] += time.perf_counter() - t0
            self.stats["engine_calls"] += 1
            for (_ctx, eps), comps in zip(items, completions):
                for e, comp in zip(eps, comps):
                    tokens, logps = cut_at_stop(comp.tokens, comp.logprobs, self.tokenizer, self.stops)
                    e.segments.append((np.asarray(tokens, np.int32), np.asarray(logps, np.float32)))
                    if comp.finish_reason == "length" and max_new < self.max_new_tokens and len(tokens) == max_new:
                        e.finish("truncated")  # the token cap cut the turn: the environment never sees it
                        continue
                    out.append((e, tokens))
        return out

    def _step(self, stepped: list[tuple[Episode, np.ndarray]]) -> None:
        if not stepped:
            return
        texts = {e.key: turn_text(t, self.tokenizer, self.stop_ids, self.stops) for e, t in stepped}
        t0 = time.perf_counter()
        outcomes = self.pool.step(list(texts.items()))
        self.stats["env_seconds"] += time.perf_counter() - t0
        for e, tokens in stepped:
            o = outcomes[e.key]
            if not o.ok:
                self._fail(e, o.reason, o.message)
                continue
            r: StepResult = o.value
            e.rewards.append(r.reward)
            e.tool_calls += r.tool_calls
            e.tool_errors += r.tool_errors
            if r.done:
                e.finish("done")
                continue
            if len(e.turns) >= self.env.max_turns:
                e.finish("truncated")  # not done after maxTurns turns
                continue
            obs = self.codec.observation(r.observation or "", r.role,
                                         after_eos=bool(len(tokens)) and int(tokens[-1]) == self.eos_id)
            if len(obs) > self.env.max_observation_tokens:
                self._fail(e, "oversized", f"observation of {len(obs)} tokens (limit "
                                           f"{self.env.max_observation_tokens})")
            elif e.length + len(obs) >= self.cap:
                e.finish("truncated")  # no room for the observation and a token after it
            else:
                e.segments.append((obs, None))

    def _fail(self, e: Episode, reason: str | None, message: str) -> None:
        e.finish("failed", reason or "error", message)
        if len(self.messages) < 5:
            self.messages.append(f"{reason}: {message}")
