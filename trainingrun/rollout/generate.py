"""`rollout.source.type: generate`: the policy generates its own rollouts.

The three first stages of the rollout loop for generated rollouts:

    draw(i)               source rollout i's prompts (`rollout/prompts.py`): P = samplesPerRollout / groupSize
    generate(prompts, k)  the engine, holding exactly weight version max(0, k − maxPolicyLag) (waits until the
                          trainers published it), samples groupSize completions per prompt; a sample = prompt +
                          completion, loss mask on the completion, the generator's per-token log-probabilities,
                          its weight version
    score(groups)         the reward of every completion (`rollout/rewards.py`); failed rewards are counted;
                          with `reward.overlong`, DAPO's length penalty is added (`overlong_penalty`)

With `environment` the generate stage runs groupSize multi-turn episodes per prompt instead (`rollout/episodes.py`:
one engine call per turn, the environment's observations between turns, its rewards), and score has nothing left
to do.

Pinning the version to exactly k − maxPolicyLag (not "the newest available") makes a run a function of its spec:
the same seed gives the same rollouts whatever the timing, so DP invariance and restarts are exact, and the lag the
trainers record is exactly maxPolicyLag once k ≥ maxPolicyLag. Sampling is seeded by (seed, source index).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainingrun.contract.engine import Engine, Sampling
from trainingrun.contract.env import ENGINE_URL_ENV, ProcessEnv
from trainingrun.contract.errors import ConfigError
from trainingrun.contract.published import EpisodeCounts
from trainingrun.modeling.architecture import Architecture
from trainingrun.rollout.episodes import EpisodeRunner, build_group, counts, cut_at_stop, turn_text
from trainingrun.rollout.groups import SampleGroup
from trainingrun.rollout.prompts import Prompt, load_tokenizer, make_prompts
from trainingrun.rollout.rewards import RewardConfig, RewardScorer
from trainingrun.rollout.synthetic import EOS
from trainingrun.vllm.client import VLLMClient
from trainingrun.vllm.engine import VLLMEngine

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
    episodes: EpisodeCounts | None = None  # with an environment


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's overlong reward shaping: 0 for a completion of at most max_new_tokens − buffer tokens, then falling
    linearly to −penalty at max_new_tokens: penalty · (max_new_tokens − buffer − length) / buffer."""
    free = max_new_tokens - buffer
    return 0.0 if length <= free else penalty * (free - min(length, max_new_tokens)) / buffer


def make_engine(spec, store, arch: Architecture) -> Engine:
    """The engine `spec.rollout.engine` names (the in-process one builds `arch`), fetching weights through the run's
    weight sync."""
    e = spec.rollout.engine
    if e.type == "megatron":
        from trainingrun.rollout.megatron_engine import MegatronEngine  # deferred: torch, megatron

        return MegatronEngine(arch, fetch=store.read_weights, max_batch=e.max_batch, seed=spec.seed,
                              record_routing=spec.trainer.moe.routing_replay and arch.moe is not None)
    if e.type == "vllm":
        return make_vllm_engine(spec, store)
    raise ConfigError(f"rollout.engine.type: {e.type!r} is not available in this build; allowed: megatron, vllm")


def make_vllm_engine(spec, store, *, say: Callable[[str], None] | None = None) -> Engine:
    """`rollout.engine.type: vllm`: the server at `engine.url`, else the run's own (its URL in $TRAININGRUN_ENGINE_URL,
    set by the launcher or the operator). Weight versions are found through the store's weight meta (disk path or
    broadcast address, written by the trainers' publisher)."""
    e = spec.rollout.engine
    url = e.url or ProcessEnv.from_environ().engine_url
    if not url:
        raise ConfigError(f"rollout.engine.type: vllm without rollout.engine.url needs the run's own server (the "
                          f"launcher or operator sets ${ENGINE_URL_ENV}); set rollout.engine.url")
    return VLLMEngine(VLLMClient(url), fetch=lambda version: store.read_weights(version)[1],
                      concurrency=e.vllm.concurrency, say=say)


def required_version(rollout: int, max_policy_lag: int) -> int:
    """The weight version rollout `rollout` is generated with (bounded staleness, pinned)."""
    return max(0, rollout - max_policy_lag)


class GenerateSource:
    """Draw prompts → generate with the engine → score (see the module docstring)."""

    # the rollouts of the past cannot be re-created after the store lost them: the weight versions that generated
    # them are released (rollout/recovery.py then names what to do)
    replayable = False

    def __init__(self, spec, store, *, arch: Architecture, say: Callable[[str], None] | None = None,
                 engine: Engine | None = None, max_wait: float | None = None, poll_interval: float = 0.05):
        g = spec.rollout.source.generate
        assert g is not None
        self.spec, self.store, self.g = spec, store, g
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.max_wait, self.poll_interval = max_wait, poll_interval
        self.group_size = spec.rollout.group_size
        self.prompts_per_rollout = spec.rollout.samples_per_rollout // spec.rollout.group_size
        self.environment = g.environment
        text = g.prompts.type != "synthetic" or self.environment is not None
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
        if g.reward.type == "reasoning_gym" and dataset is None and self.environment is None:
            raise ConfigError("rollout.source.generate.reward.type: reasoning_gym scores reasoning-gym prompts only "
                              "(prompts.type reasoningGym)")
        self.scorer = self.episodes = None
        if self.environment is not None:
            self.episodes = EpisodeRunner(self.environment, tokenizer=self.tokenizer, chat=g.prompts.chat,
                                          stop_ids=self.stop_ids, stops=g.sampling.stop,
                                          max_new_tokens=g.sampling.max_new_tokens, seq_length=seq_length,
                                          prompt_type=g.prompts.type, say=self.say)
        else:
            self.scorer = RewardScorer(RewardConfig(type=g.reward.type, function=g.reward.function, dataset=dataset),
                                       timeout=g.reward.timeout_seconds, failed_reward=g.reward.failed_reward,
                                       workers=g.reward.workers)
        self.engine = engine if engine is not None else make_engine(spec, store, arch)
        self.lag = spec.rollout.max_policy_lag
        self.stats = GenerateStats()
        self._pending: dict[int, tuple[Prompt, list[Any]]] = {}  # group id -> (prompt, responses) until scored
        self._index = -1

    # ---- stages
    def draw(self, index: int) -> list[Prompt] | None:
        self._index = index
        return self.prompts.draw(index, self.prompts_per_rollout)

    def generate(self, prompts: list[Prompt], rollout: int) -> list[SampleGroup]:
        version = required_version(rollout, self.lag)
        self.stats = GenerateStats(weight_version=version, prompts=len(prompts))
        self.ensure_weights(version)
        seed = int(np.random.SeedSequence([self.spec.seed, self._index, 0x5A]).generate_state(1)[0])
        sampling = Sampling(temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                            max_new_tokens=self.sampling.max_new_tokens, stop_token_ids=self.stop_ids, seed=seed)
        if self.episodes is not None:
            return self._run_episodes(prompts, version, sampling)
        t0 = time.perf_counter()
        completions = self.engine.generate([p.tokens.tolist() for p in prompts], self.group_size, sampling)
        self.stats.generate_seconds = time.perf_counter() - t0
        groups = []
        n = self.group_size
        for j, (prompt, comps) in enumerate(zip(prompts, completions)):
            gid = self._index * self.prompts_per_rollout + j
            toks, masks, logps, responses, routed = [], [], [], [], []
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
                responses.append(self._response(ctoks, prompt))
                self.stats.generated_tokens += len(ctoks)
            groups.append(SampleGroup(group_id=gid, tokens=toks, loss_masks=masks, rewards=np.zeros(n, np.float32),
                                      sample_ids=np.arange(gid * n, (gid + 1) * n, dtype=np.int64), logprobs=logps,
                                      versions=np.full(n, version, np.int64),
                                      routed_experts=routed if len(routed) == n else None))
            self._pending[gid] = (prompt, responses)
        self.stats.samples = n * len(prompts)
        return groups

    def _run_episodes(self, prompts: list[Prompt], version: int, sampling: Sampling) -> list[SampleGroup]:
        """groupSize multi-turn episodes per prompt (`rollout/episodes.py`); their rewards are the environment's."""
        t0 = time.perf_counter()
        by_prompt = self.episodes.run(self.engine, prompts, self.group_size, sampling, seed=sampling.seed,
                                      dataset=self.dataset)
        self.stats.generate_seconds = time.perf_counter() - t0
        groups = []
        for j, episodes in enumerate(by_prompt):
            group = build_group(self._index * self.prompts_per_rollout + j, episodes, self.environment,
                                version=version, group_size=self.group_size)
            if group is not None:
                groups.append(group)
        flat = [e for episodes in by_prompt for e in episodes]
        self.stats.episodes = counts(flat, self.environment)
        self.stats.generated_tokens = self.stats.episodes.response_tokens
        self.stats.samples = sum(len(g) for g in groups)
        self.stats.failure_messages = list(self.episodes.messages)
        failures = self.stats.episodes.failures
        if failures:
            self.say(f"rollout: {sum(failures.values())} of {len(flat)} episodes failed in their environment "
                     f"({failures}); e.g. " + "; ".join(self.episodes.messages[:2]))
        return groups

    def score(self, groups: list[SampleGroup]) -> None:
        if self.episodes is not None:  # the environment rewarded every episode
            return
        t0 = time.perf_counter()
        items, where = [], []
        for g in groups:
            prompt, responses = self._pending.pop(g.group_id)
            reference = prompt.index if self.g.reward.type == "reasoning_gym" else prompt.reference
            for i, r in enumerate(responses):
                items.append((r, reference))
                where.append((g, i))
        scored = self.scorer.score(items)
        overlong = self.g.reward.overlong
        for (g, i), reward in zip(where, scored.rewards):
            if overlong is not None:  # the completion's tokens are the loss-masked ones
                reward += overlong_penalty(int(g.loss_masks[i].sum()), self.sampling.max_new_tokens,
                                           overlong.buffer, overlong.penalty)
            g.rewards[i] = reward

        self.stats.reward_failed = scored.counts()
        self.stats.failure_messages = scored.messages
        self.stats.score_seconds = time.perf_counter() - t0
        failed = sum(self.stats.reward_failed.values())
        if failed:
            self.say(f"rollout: {failed} of {len(items)} rewards failed ({self.stats.reward_failed}); e.g. "
                     + "; ".join(scored.messages[:2]))

    def close(self) -> None:
        for part in (self.scorer, self.episodes):
            if part is not None:
                part.close()
        self.engine.close()

    # ---- helpers
    def ensure_weights(self, version: int) -> None:
        """Load weight version `version` into the engine, waiting until the trainers published it."""
        if self.engine.weight_version == version:
            return
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
        self.stats.wait_seconds = time.monotonic() - t0
        t1 = time.perf_counter()
        self.engine.load_weights(version)
        self.stats.load_seconds = time.perf_counter() - t1

    def _response(self, ctoks: np.ndarray, prompt: Prompt) -> Any:
        """What the reward sees: the completion's token ids (stop token included) for token references (built-in
        tasks: reference = answer + end token), else the decoded text without the stop token."""
        if self.tokenizer is None or isinstance(prompt.reference, list):
            return [int(t) for t in ctoks]
        return turn_text(ctoks, self.tokenizer, self.stop_ids, self.sampling.stop)

    def _cut_at_stop(self, tokens: np.ndarray, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Completions end after the token that completes a stop string (text tasks): later tokens are dropped."""
        return cut_at_stop(tokens, logprobs, self.tokenizer, self.sampling.stop)
