"""`rollout.source.type: generate`: the policy generates its own rollouts.

The three first stages of the rollout loop for generated rollouts:

    draw(i)               source rollout i's prompts (`rollout/prompts.py`): P = samplesPerRollout / groupSize
    generate(prompts, k)  the engine, holding exactly weight version max(0, k − maxPolicyLag) (waits until the
                          trainers published it), samples groupSize completions per prompt; a sample = prompt +
                          completion, loss mask on the completion, the generator's per-token log-probabilities,
                          its weight version
    score(groups)         the reward of every completion (`rollout/rewards.py`: the reward type scores the batch's
                          samples, each with its prompt, response, reference and meta); failed rewards are counted
                          by reason; with `reward.overlong`, DAPO's length penalty is added (`overlong_penalty`); a
                          judge's raw answers of the first `keepAnswers` samples of rollout k are kept in
                          judge/rollout-<k>.jsonl of the output directory (`rewards.AnswerLog`)

With `environment` the generate stage runs groupSize multi-turn episodes per prompt instead (`rollout/episodes.py`:
one engine call per turn, the environment's observations between turns, its rewards), and score has nothing left
to do; with `agent` it runs groupSize episodes of the agent per prompt, which call the policy through the rollout's
OpenAI-compatible gateway and report their rewards (`rollout/agents.py`), their samples built as an environment's.

Pinning the version to exactly k − maxPolicyLag (not "the newest available") makes a run a function of its spec:
the same seed gives the same rollouts whatever the timing, so DP invariance and restarts are exact, and the lag the
trainers record is exactly maxPolicyLag once k ≥ maxPolicyLag. Sampling is seeded by (seed, source index).

Over-sampling and partial rollouts (`rollout.overSampling`, `rollout.partialRollout`; the prompt stream:
`rollout/stream.py`). A source rollout asks for P + ceil(overSampling · P) groups — cut groups carried from the last
one first, then prompts an abort gave back, then fresh ones — through the engine's grouped generation
(`contract.engine.GroupedEngine`). Each group is scored and filtered as soon as its samples finished; once P groups
passed the filters the engine aborts what is still running. Every finished group is kept (a few more than P may
finish during the abort); an aborted group's prompt goes back to the front of the stream (its tokens dropped), or,
with partial rollouts, the group is carried with its cut completions and continued in the next source rollout under
the weights of then. With partial rollouts the source generates with the newest published version (at least
k − maxPolicyLag, the bound), every token records its weight version (`SampleGroup.token_versions`), and a carried
group whose oldest token is older than the bound is dropped (its prompt generated afresh; `rollout.staleTokens:
drop`, counted) or continued with its old tokens masked out of the loss at publish (`mask`). Which requests finish
first depends on timing, so a run with over-sampling is not a function of its spec alone; a restarted rollout still
continues exactly, from its saved state (the stream and the staged groups). Request seeds are a function of the
run's seed and the prompt's position (`request_seed`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainingrun.contract.engine import Completion, Engine, EngineCounts, GroupedEngine, GroupRequest, Sampling
from trainingrun.contract.errors import ConfigError
from trainingrun.contract.published import EpisodeCounts
from trainingrun.engines.table import make_engine
from trainingrun.modeling.architecture import Architecture
from trainingrun.rollout.agents import AgentRunner, model_name
from trainingrun.rollout.episodes import EpisodeRules, EpisodeRunner, build_group, counts, cut_at_stop, turn_text
from trainingrun.rollout.groups import SampleGroup
from trainingrun.rollout.prompts import Prompt, load_tokenizer, make_prompts
from trainingrun.rollout.rewards import AnswerLog, RewardConfig, RewardSample, RewardScorer
from trainingrun.rollout.stream import PartialGroup, PromptStream, extra_prompts, is_cut
from trainingrun.rollout.synthetic import EOS

WAIT_REPORT_SECONDS = 30.0


@dataclass
class GenerateStats:
    """What the last generate + score did (read by the loop for metrics and the published stats)."""

    weight_version: int = -1
    prompts: int = 0
    samples: int = 0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    wait_seconds: float = 0.0
    load_seconds: float = 0.0
    score_seconds: float = 0.0
    reward_failed: dict[str, int] = field(default_factory=dict)
    failure_messages: list[str] = field(default_factory=list)
    # over-sampling / partial rollouts
    requests: int = 0  # groups asked for
    groups_aborted: int = 0  # asked for, not finished (their prompts went back, or cut and carried)
    partials_carried: int = 0  # cut groups carried into the next source rollout
    partials_continued: int = 0  # carried cut groups continued in this one
    partials_dropped: int = 0  # carried cut groups dropped: older than the staleness bound (staleTokens drop)
    sync_seconds: dict[str, float] = field(default_factory=dict)  # each engine's last weight load
    engines: dict[str, EngineCounts] = field(default_factory=dict)  # each engine's share of this generation
    episodes: EpisodeCounts | None = None  # with an environment or an agent
    gateway_latencies: list[float] = field(default_factory=list)  # with an agent: each request's seconds


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's overlong reward shaping: 0 for a completion of at most max_new_tokens − buffer tokens, then falling
    linearly to −penalty at max_new_tokens: penalty · (max_new_tokens − buffer − length) / buffer."""
    free = max_new_tokens - buffer
    return 0.0 if length <= free else penalty * (free - min(length, max_new_tokens)) / buffer


def reward_response(ctoks: np.ndarray, prompt: Prompt, tokenizer, stop_ids, stops) -> Any:
    """What the reward sees of a completion: its token ids (stop token included) for token references (built-in
    tasks: reference = answer + end token), else the decoded text without the stop token, cut at a stop string."""
    if tokenizer is None or isinstance(prompt.reference, list):
        return [int(t) for t in ctoks]
    return turn_text(ctoks, tokenizer, stop_ids, stops)


def request_seed(seed: int, position: int) -> int:
    """The sampling seed of the prompt at stream position `position` (never of the engine that serves it)."""
    return int(np.random.SeedSequence([seed, position, 0x5B]).generate_state(1)[0])


def required_version(rollout: int, max_policy_lag: int) -> int:
    """The weight version rollout `rollout` is generated with (bounded staleness, pinned)."""
    return max(0, rollout - max_policy_lag)


class GenerateSource:
    """Draw prompts → generate with the engine → score (see the module docstring)."""

    # the rollouts of the past cannot be re-created after the store lost them: the weight versions that generated
    # them are released (rollout/recovery.py then names what to do)
    replayable = False

    def __init__(self, spec, store, *, arch: Architecture, say: Callable[[str], None] | None = None,
                 engine: Engine | None = None, max_wait: float | None = None, poll_interval: float = 0.05,
                 out_dir: Path | None = None):
        g = spec.rollout.source.generate
        assert g is not None
        self.spec, self.store, self.g = spec, store, g
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.max_wait, self.poll_interval = max_wait, poll_interval
        self.group_size = spec.rollout.group_size
        self.prompts_per_rollout = spec.rollout.samples_per_rollout // spec.rollout.group_size
        self.environment, self.agent = g.environment, g.agent
        text = g.prompts.type != "synthetic" or self.environment is not None or self.agent is not None
        self.tokenizer = load_tokenizer(arch) if text else None
        self.prompts = make_prompts(spec, arch, tokenizer=self.tokenizer)
        eos = self.tokenizer.eos_id if self.tokenizer is not None else EOS
        self.stop_ids = tuple(sorted({eos, *g.sampling.stop_token_ids}))
        self.sampling = g.sampling
        seq_length = arch.seq_length
        if g.sampling.max_new_tokens >= seq_length:
            raise ConfigError(f"rollout.source.generate.sampling.maxNewTokens: {g.sampling.max_new_tokens} leaves no "
                              f"room for a prompt within model seqLength {seq_length}")
        self.dataset = dataset = getattr(self.prompts, "params", None)
        if (g.reward is not None and g.reward.type == "reasoning_gym" and dataset is None
                and self.environment is None):
            raise ConfigError("rollout.source.generate.reward.type: reasoning_gym scores reasoning-gym prompts only "
                              "(prompts.type reasoningGym)")
        self.scorer = self.episodes = self.answers = None
        self.rules: EpisodeRules | None = None  # how episodes become samples (environment or agent)
        if self.environment is not None:
            self.episodes = EpisodeRunner(self.environment, tokenizer=self.tokenizer, chat=g.prompts.chat,
                                          stop_ids=self.stop_ids, stops=g.sampling.stop,
                                          max_new_tokens=g.sampling.max_new_tokens, seq_length=seq_length,
                                          prompt_type=g.prompts.type, say=self.say)
            self.rules = EpisodeRules.of(self.environment)
        elif self.agent is not None:
            lines = getattr(self.prompts, "lines", None) or []
            tokens_only = next((k for k, line in enumerate(lines, 1) if "prompt_tokens" in line), None)
            if tokens_only is not None:
                raise ConfigError(f"rollout.source.generate.prompts.jsonl: line {tokens_only} gives prompt_tokens; an "
                                  "agent is given its task as text (prompt)")
            self.episodes = AgentRunner(self.agent, tokenizer=self.tokenizer, stop_ids=self.stop_ids,
                                        stops=g.sampling.stop, max_new_tokens=g.sampling.max_new_tokens,
                                        seq_length=seq_length, model=model_name(arch.hf), say=self.say)
            self.rules = self.episodes.rules
        else:
            assert g.reward is not None
            self.scorer = RewardScorer(RewardConfig.of(g.reward, dataset=dataset), timeout=g.reward.timeout_seconds,
                                       failed_reward=g.reward.failed_reward, workers=g.reward.workers)
            if g.reward.judge is not None:  # its raw answers, kept for inspection (out_dir: the run's output)
                self.answers = AnswerLog(out_dir / "judge" if out_dir is not None else None,
                                         g.reward.judge.keep_answers, self.say)
        self.engine = engine if engine is not None else make_engine(spec, store, arch)
        self.lag = spec.rollout.max_policy_lag
        self.stats = GenerateStats()
        self._pending: dict[int, list[RewardSample]] = {}  # group id -> its samples (as the reward sees them)
        self._index = -1
        self._rollout = -1  # the rollout being generated (its judge answers' file)
        # over-sampling / partial rollouts (module docstring)
        r = spec.rollout
        self.streaming = r.over_sampling > 0 or r.partial_rollout
        self.extra = extra_prompts(self.prompts_per_rollout, r.over_sampling)
        self.partial = r.partial_rollout
        self.stale_tokens = r.stale_tokens
        self.stream = PromptStream()  # the loop sets it from its resume state
        self.keeps: Callable[[SampleGroup], bool] = lambda g: True  # the loop's filters (set by the loop)
        self._blocks: dict[int, list[Prompt]] = {}
        self._length = None if not isinstance(getattr(self.prompts, "lines", None), list) else len(self.prompts.lines)
        if self.streaming and not isinstance(self.engine, GroupedEngine):
            raise ConfigError(f"rollout.overSampling / partialRollout: the {self.engine.name} engine cannot abort "
                              "requests")

    # ---- stages
    def draw(self, index: int) -> list[Prompt] | StreamDraw | None:
        self._index = index
        if not self.streaming:
            return self.prompts.draw(index, self.prompts_per_rollout)
        partials, positions = self.stream.take(self.prompts_per_rollout + self.extra, end=self._length)
        if not partials and not positions:
            return None
        return StreamDraw(partials=[(p, self.prompt_at(p.position)) for p in partials],
                          prompts=[(pos, self.prompt_at(pos)) for pos in positions])

    def prompt_at(self, position: int) -> Prompt:
        """The prompt at stream position `position` (block position // P of the prompt source)."""
        block, offset = divmod(position, self.prompts_per_rollout)
        if block not in self._blocks:
            if len(self._blocks) > 64:
                self._blocks.clear()
            self._blocks[block] = self.prompts.draw(block, self.prompts_per_rollout) or []
        return self._blocks[block][offset]

    def generate(self, prompts: list[Prompt] | StreamDraw, rollout: int) -> list[SampleGroup]:
        self._rollout = rollout
        before = self._engine_counts()
        groups = self._generate(prompts, rollout)
        self.stats.engines = {name: c.minus(before[name]) if name in before else c
                              for name, c in self._engine_counts().items()}
        return groups

    def _engine_counts(self) -> dict[str, EngineCounts]:
        """Each engine replica's counters (the engine pool's `engine_counts`; none for an in-process engine)."""
        read = getattr(self.engine, "engine_counts", None)
        return read() if read is not None else {}

    def _generate(self, prompts: list[Prompt] | StreamDraw, rollout: int) -> list[SampleGroup]:
        if isinstance(prompts, StreamDraw):
            return self.generate_stream(prompts, rollout)
        version = required_version(rollout, self.lag)
        self.stats = GenerateStats(weight_version=version, prompts=len(prompts))
        self.ensure_weights(version)
        seed = int(np.random.SeedSequence([self.spec.seed, self._index, 0x5A]).generate_state(1)[0])
        sampling = self._sampling(seed)
        if self.episodes is not None:
            return self._run_episodes(prompts, version, sampling)
        t0 = time.perf_counter()
        completions = self.engine.generate([p.tokens.tolist() for p in prompts], self.group_size, sampling)
        self.stats.generate_seconds = time.perf_counter() - t0
        groups = [self.build_group(self._index * self.prompts_per_rollout + j, prompt, comps, version)
                  for j, (prompt, comps) in enumerate(zip(prompts, completions))]
        self.stats.samples = self.group_size * len(prompts)
        return groups

    def generate_stream(self, draw: StreamDraw, rollout: int) -> list[SampleGroup]:
        """Over-sampling with abort, partial rollouts (module docstring)."""
        bound = required_version(rollout, self.lag)
        self.stats = GenerateStats(weight_version=bound, prompts=len(draw.prompts) + len(draw.partials))
        version = self.ensure_weights(bound, newest=self.partial)
        self.stats.weight_version = version
        back: list[int] = []
        entries: list[tuple[int, Prompt, PartialGroup | None]] = []
        for pg, prompt in draw.partials:
            if pg.oldest_version < bound and self.stale_tokens == "drop":
                self.stats.partials_dropped += 1
                back.append(pg.position)  # generated afresh (next source rollout)
                continue
            entries.append((pg.position, prompt, pg))
        entries += [(pos, prompt, None) for pos, prompt in draw.prompts]
        self.stats.partials_continued = sum(1 for _, _, pg in entries if pg is not None)
        requests = [GroupRequest(prompt=p.tokens.tolist(), n=self.group_size, seed=request_seed(self.spec.seed, pos),
                                 prefixes=tuple(pg.completions) if pg is not None else ())
                    for pos, p, pg in entries]
        self.stats.requests = len(requests)
        built: dict[int, SampleGroup] = {}
        accepted = 0

        def on_group(i: int, comps: list[Completion]) -> bool:
            nonlocal accepted
            pos, prompt, _ = entries[i]
            g = built[i] = self.build_group(pos, prompt, comps, version)
            self.score([g])
            accepted += bool(self.keeps(g))
            return self.extra > 0 and accepted >= self.prompts_per_rollout

        # the call's seed (the in-process engine seeds one generator per call); requests carry their own
        sampling = self._sampling(int(np.random.SeedSequence([self.spec.seed, self._index, 0x5C]).generate_state(1)[0]))
        t0 = time.perf_counter()
        results = self.engine.generate_groups(requests, sampling, on_group=on_group)
        self.stats.generate_seconds = time.perf_counter() - t0
        groups, cut = [], []
        for i, ((pos, prompt, pg), comps) in enumerate(zip(entries, results)):
            if not is_cut(comps):
                groups.append(built[i] if i in built else self.build_group(pos, prompt, comps, version))
            elif self.partial and any(len(c.tokens) for c in comps):
                cut.append(PartialGroup(position=pos, completions=comps))
            else:
                back.append(pos)
        self.stream.give_back(back, cut)
        self.stats.groups_aborted = len(entries) - len(groups)
        self.stats.partials_carried = len(cut)
        self.stats.samples = self.group_size * len(groups)
        if self.stats.groups_aborted:
            self.say(f"rollout: {len(groups)} of {len(entries)} groups finished ({accepted} passed the filters); "
                     f"{self.stats.groups_aborted} aborted: {len(cut)} carried as cut completions, "
                     f"{len(back) - self.stats.partials_dropped} prompts back to the front of the stream"
                     + (f"; {self.stats.partials_dropped} stale cut groups dropped" if self.stats.partials_dropped
                        else ""))
        return groups

    def _sampling(self, seed: int) -> Sampling:
        return Sampling(temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                        max_new_tokens=self.sampling.max_new_tokens, stop_token_ids=self.stop_ids, seed=seed)

    def build_group(self, gid: int, prompt: Prompt, comps: list[Completion], version: int) -> SampleGroup:
        """The samples of one prompt (prompt + completion, loss mask on the completion, the generator's
        log-probabilities; with partial rollouts each token's weight version; with routing replay each token's
        experts), registered for scoring."""
        n = self.group_size
        toks, masks, logps, to_score, tvers, routed = [], [], [], [], [], []
        for c in comps:
            ctoks, clogp = self._cut_at_stop(c.tokens, c.logprobs)
            plen = len(prompt.tokens)
            toks.append(np.concatenate([prompt.tokens, ctoks]).astype(np.int32))
            if c.routed_experts is not None:  # the sample's tokens' experts (prompt + kept completion)
                routed.append(np.ascontiguousarray(c.routed_experts[:plen + len(ctoks)], dtype=np.int16))
            mask = np.zeros(plen + len(ctoks), np.uint8)
            mask[plen:] = 1
            masks.append(mask)
            logps.append(np.concatenate([np.zeros(plen, np.float32), clogp]).astype(np.float32))
            cvers = (c.versions[: len(ctoks)] if c.versions is not None else np.full(len(ctoks), version, np.int64))
            tvers.append(np.concatenate([np.full(plen, -1, np.int64), cvers]).astype(np.int64))
            to_score.append(RewardSample.of(prompt, self._response(ctoks, prompt), ctoks))
            self.stats.generated_tokens += len(ctoks)
        versions = np.array([int(v[v >= 0].min()) if (v >= 0).any() else version for v in tvers], np.int64)
        group = SampleGroup(group_id=gid, tokens=toks, loss_masks=masks, rewards=np.zeros(n, np.float32),
                            sample_ids=np.arange(gid * n, (gid + 1) * n, dtype=np.int64), logprobs=logps,
                            versions=versions, token_versions=tvers if self.partial else None,
                            routed_experts=routed if len(routed) == n else None)
        self._pending[gid] = to_score
        return group

    def _run_episodes(self, prompts: list[Prompt], version: int, sampling: Sampling) -> list[SampleGroup]:
        """groupSize multi-turn episodes per prompt (`rollout/episodes.py`, or an agent's: `rollout/agents.py`);
        their rewards are the environment's or the agent's."""
        t0 = time.perf_counter()
        by_prompt = self.episodes.run(self.engine, prompts, self.group_size, sampling, seed=sampling.seed,
                                      dataset=self.dataset)
        self.stats.generate_seconds = time.perf_counter() - t0
        groups = []
        for j, episodes in enumerate(by_prompt):
            group = build_group(self._index * self.prompts_per_rollout + j, episodes, self.rules,
                                version=version, group_size=self.group_size)
            if group is not None:
                groups.append(group)
        flat = [e for episodes in by_prompt for e in episodes]
        agent = isinstance(self.episodes, AgentRunner)
        self.stats.episodes = counts(flat, self.rules, **(self.episodes.counts_extra() if agent else {}))
        if agent:
            self.stats.gateway_latencies = self.episodes.latencies()
        self.stats.generated_tokens = self.stats.episodes.response_tokens
        self.stats.samples = sum(len(g) for g in groups)
        self.stats.failure_messages = list(self.episodes.messages)
        failures = self.stats.episodes.failures
        if failures:
            where = "(the agent's)" if agent else "in their environment"
            self.say(f"rollout: {sum(failures.values())} of {len(flat)} episodes failed {where} "
                     f"({failures}); e.g. " + "; ".join(self.episodes.messages[:2]))
        return groups

    def score(self, groups: list[SampleGroup]) -> None:
        """Rewards of the groups not scored yet (grouped generation scores each group as it finishes)."""
        if self.episodes is not None:  # the environment rewarded every episode
            return
        t0 = time.perf_counter()
        items, where = [], []
        for g in groups:
            if g.group_id not in self._pending:
                continue
            for i, sample in enumerate(self._pending.pop(g.group_id)):
                items.append(sample)
                where.append((g, i))
        if not items:
            return
        scored = self.scorer.score(items)
        if self.answers is not None:
            self.answers.add(f"rollout-{self._rollout}", items, scored)
        overlong = self.g.reward.overlong if self.g.reward is not None else None
        for (g, i), reward in zip(where, scored.rewards):
            if overlong is not None:  # the completion's tokens are the loss-masked ones
                reward += overlong_penalty(int(g.loss_masks[i].sum()), self.sampling.max_new_tokens,
                                           overlong.buffer, overlong.penalty)
            g.rewards[i] = reward
        counts = scored.counts()
        for reason, k in counts.items():
            self.stats.reward_failed[reason] = self.stats.reward_failed.get(reason, 0) + k
        self.stats.failure_messages = (self.stats.failure_messages + scored.messages)[:5]
        self.stats.score_seconds += time.perf_counter() - t0
        failed = sum(counts.values())
        if failed:
            occurred = {r: n for r, n in counts.items() if n}
            self.say(f"rollout: {failed} of {len(items)} rewards failed ({occurred}); e.g. "
                     + "; ".join(scored.messages[:2]))

    def close(self) -> None:
        for part in (self.scorer, self.episodes):
            if part is not None:
                part.close()
        self.engine.close()

    # ---- helpers
    def ensure_weights(self, version: int, *, newest: bool = False, stats: GenerateStats | None = None) -> int:
        """Load weight version `version` into the engine, waiting until the trainers published it; with `newest`,
        the newest version published by then (at least `version`). Returns the version the engine holds. The waits
        and loads are recorded in `stats` (default: this source rollout's)."""
        stats = self.stats if stats is None else stats
        if self.engine.weight_version == version and not newest:
            return version
        t0 = time.monotonic()
        reported = t0
        while True:
            latest = self.store.latest_weights()
            if latest is not None and latest >= version:
                break
            now = time.monotonic()
            if self.max_wait is not None and now - t0 > self.max_wait:
                raise TimeoutError(f"weight version {version} not published after {self.max_wait:g}s (newest: "
                                   f"{latest})")
            if now - reported >= WAIT_REPORT_SECONDS:
                self.say(f"rollout: waiting for weight version {version} ({now - t0:.0f}s, newest {latest})")
                reported = now
            time.sleep(self.poll_interval)
        stats.wait_seconds = time.monotonic() - t0
        if newest:
            version = max(version, int(latest))
            if self.engine.weight_version == version:
                return version
        t1 = time.perf_counter()
        self.engine.load_weights(version)
        stats.load_seconds = time.perf_counter() - t1
        stats.sync_seconds = dict(getattr(self.engine, "last_sync", {}))
        return version

    def _response(self, ctoks: np.ndarray, prompt: Prompt) -> Any:
        return reward_response(ctoks, prompt, self.tokenizer, self.stop_ids, self.sampling.stop)

    def _cut_at_stop(self, tokens: np.ndarray, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Completions end after the token that completes a stop string (text tasks): later tokens are dropped."""
        return cut_at_stop(tokens, logprobs, self.tokenizer, self.sampling.stop)


@dataclass
class StreamDraw:
    """A source rollout's requests with over-sampling / partial rollouts: cut groups to continue, then prompts by
    stream position."""

    partials: list[tuple[PartialGroup, Prompt]]
    prompts: list[tuple[int, Prompt]]
