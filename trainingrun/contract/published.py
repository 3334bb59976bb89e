"""The rollout → trainer contract: `PublishedRollout`, built, written and read only through this module.

A published rollout k is, in the store: one `RankPayload` per data-parallel rank (`trainingrun.contract.payload`: the
rank's samples in `partitions[r]` order, flat over the rollout's steps) and one JSON document, the schedule, that
`PublishedRollout.to_json` writes and `PublishedRollout.from_json` reads back (validated: a document that does not
describe a well-formed rollout is a `ValueError` naming the field). Everything the trainer needs per step is
computed here once, on the rollout side, and travels in that document; the trainer never re-derives it:

  StepPlan        index in the rollout, global step, GBS_s (samples), T_s (loss tokens), micro-batches per rank, the
                  range of the step's micro-batches in the rank's flat list, samples consumed before the step.

Writers: the rollout program (`rollout.loop`) and hand-built rollouts of the tests (`tests/synthetic.py`), both
through `build_published` + `publish`. Reader: the trainer, through `read`. Both take the store as a `RolloutChannel`
(what `trainingrun.store` implements). The JSON keys are documented in docs/store.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from trainingrun.contract.engine import EngineCounts
from trainingrun.contract.fields import SampleArrays
from trainingrun.contract.payload import RankPayload
from trainingrun.schedule import DPSchedule, build_dp_schedule


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step of a published rollout, as the trainer runs it."""

    index: int  # step within the rollout
    global_step: int  # optimizer steps of the run before this one
    global_batch_size: int  # GBS_s: samples in the step, all ranks
    loss_tokens: int  # T_s: loss tokens in the step, all ranks (denominator of token normalisation)
    num_microbatches: int  # per rank, the same on every rank
    microbatches: range  # positions of the step's micro-batches in a rank's flat micro-batch list
    samples_before: int  # samples consumed by the run before this step
    weight_version: int = -1  # oldest weight version its trained tokens were generated with (-1: replayed samples)
    policy_lag_mean: float | None = None  # mean over its trained tokens of (rollout − the token's weight version)


# why an agent's episode failed (rollout/agents.py; docs/rl.md "Agents"): its process exited non-zero (exit), ran past
# timeoutSeconds (timeout), reported no reward (no_reward), sent a malformed request (invalid) or one past the caps
# (limit), the engine refused its request (engine), or its service could not be reached or answered an error (error)
AGENT_FAILURE_REASONS = ("exit", "timeout", "no_reward", "invalid", "limit", "engine", "error")


@dataclass(frozen=True)
class EpisodeCounts:
    """Multi-turn episodes of a source rollout (`rollout.source.generate.environment`, or `agent`: then `agent` is
    True and the gateway's counts are filled): counts that add up across rollouts and ranks, so each mean below is a
    weighted (sum, count) pair (`record` names them)."""

    episodes: int = 0
    turns: int = 0  # model turns
    tool_calls: int = 0
    tool_errors: int = 0
    truncated: int = 0  # episodes
    response_tokens: int = 0  # tokens of the model's turns
    failures: dict[str, int] = field(default_factory=dict)  # failed episodes by reason (environments.base, or
    # AGENT_FAILURE_REASONS)
    reward: float = 0.0  # sum of the episodes' rewards (with per-turn samples reward_mean is over samples)
    # agents: the gateway's chat requests of the episodes' keys and their latency (seconds, summed), requests with a
    # key of no running episode (answered 401), token sequences started by a request that rewrote its history
    agent: bool = False
    requests: int = 0
    request_seconds: float = 0.0
    unauthorized: int = 0
    rewrites: int = 0

    # record field -> (sum, count)
    def pairs(self) -> dict[str, tuple[int, int]]:
        failed = sum(self.failures.values())
        if self.agent:
            return {
                "turns_per_episode": (self.turns, self.episodes),
                "agent_failure_rate": (failed, self.episodes),
                "rewrites_per_episode": (self.rewrites, self.episodes),
                "response_tokens_per_turn": (self.response_tokens, self.turns),
                "episode_reward_mean": (self.reward, self.episodes),
                "gateway_request_seconds": (self.request_seconds, self.requests),
            }
        return {
            "turns_per_episode": (self.turns, self.episodes),
            "tool_calls_per_episode": (self.tool_calls, self.episodes),
            "tool_error_rate": (self.tool_errors, self.tool_calls),
            "env_failure_rate": (failed, self.episodes),
            "env_timeout_rate": (self.failures.get("timeout", 0), self.episodes),
            "truncated_rate": (self.truncated, self.episodes),
            "response_tokens_per_turn": (self.response_tokens, self.turns),
            "episode_reward_mean": (self.reward, self.episodes),
        }

    def record(self) -> dict[str, float | int]:
        """The per-step record's episode fields: the means (0 with nothing counted) and the counts."""
        out: dict[str, float | int] = {name: s / c if c else 0.0 for name, (s, c) in self.pairs().items()}
        if self.agent:
            out.update({"episodes": self.episodes, "agent_failures": sum(self.failures.values()),
                        **{f"agent_failures_{r}": self.failures.get(r, 0) for r in AGENT_FAILURE_REASONS},
                        "gateway_requests": self.requests, "gateway_unauthorized": self.unauthorized})
            return out
        out.update({"episodes": self.episodes, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                    "env_failures": sum(self.failures.values()), "env_timeouts": self.failures.get("timeout", 0),
                    "truncated_episodes": self.truncated})
        return out

    def summary(self) -> str:
        """One line for the rollout's log."""
        r = self.record()
        if self.agent:
            return (f"{self.episodes} episodes, {r['turns_per_episode']:.2f} turns each, {self.rewrites} rewritten "
                    f"histories, {self.requests} requests ({r['gateway_request_seconds']:.3f}s each, "
                    f"{self.unauthorized} unauthorized), {r['agent_failures']} failed {self.failures or ''}".rstrip())
        return (f"{self.episodes} episodes, {r['turns_per_episode']:.2f} turns and {r['tool_calls_per_episode']:.2f} "
                f"tool calls each ({self.tool_errors} tool errors), {self.truncated} truncated, "
                f"{r['env_failures']} failed {self.failures or ''}".rstrip())

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"episodes": self.episodes, "turns": self.turns, "tool_calls": self.tool_calls,
                               "tool_errors": self.tool_errors, "truncated": self.truncated,
                               "response_tokens": self.response_tokens, "failures": dict(self.failures),
                               "reward": self.reward}
        if self.agent:
            out.update({"agent": True, "requests": self.requests, "request_seconds": self.request_seconds,
                        "unauthorized": self.unauthorized, "rewrites": self.rewrites})
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EpisodeCounts:
        """ValueError naming the field when `d` is not a well-formed record."""
        if not isinstance(d, dict):
            raise ValueError(f"episodes: must be an object, got {type(d).__name__}")
        try:
            agent = d.get("agent", False)
            if not isinstance(agent, bool):
                raise TypeError(f"agent: {agent!r} is not a bool")
            return cls(**{k: int(d[k]) for k in ("episodes", "turns", "tool_calls", "tool_errors", "truncated",
                                                  "response_tokens")},
                       failures={str(k): int(v) for k, v in d["failures"].items()}, reward=float(d["reward"]),
                       agent=agent, **({k: int(d[k]) for k in ("requests", "unauthorized", "rewrites")}
                                       | {"request_seconds": float(d["request_seconds"])} if agent else {}))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"episodes: malformed ({type(exc).__name__}: {exc})") from None


def engine_counts_from_json(d: Any) -> dict[str, EngineCounts]:
    """`engines` of a published rollout's stats: ValueError naming the field when malformed."""
    if not isinstance(d, dict):
        raise ValueError(f"engines: must be an object, got {type(d).__name__}")
    return {str(k): EngineCounts.from_json(v) for k, v in d.items()}


@dataclass(frozen=True)
class SourceStats:
    """How the rollout's samples came to be (absent in hand-built rollouts): accounting for reports and tests."""

    source_index: int  # source rollout drawn for this rollout
    produced: int  # samples the source produced
    filtered: dict[str, int]  # samples dropped, by filter
    carried_in: int  # samples carried from earlier source rollouts (first in the rollout)
    carried_out: int  # samples carried into the next rollout
    seed: int
    # rewards of every sample the source produced for this rollout, before filtering (reward_mean of the records)
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    reward_count: int = 0
    reward_failed: int = 0  # generated rollouts: samples whose reward failed (raised, timed out, not finite, ...)
    reward_failures: dict[str, int] = field(default_factory=dict)  # ... by reason (those that occurred)
    weight_version: int = -1  # generated rollouts: the weight version the source rollout was generated with
    groups_produced: int = 0
    groups_kept: int = 0
    groups_aborted: int = 0  # over-sampling: groups asked for that did not finish (aborted)
    partials_carried: int = 0  # partial rollouts: cut groups carried into the next source rollout
    partials_dropped: int = 0  # partial rollouts: carried cut groups dropped as older than the staleness bound
    tokens_masked: int = 0  # partial rollouts (staleTokens mask): old tokens masked out of the loss
    sync_pause_seconds: float = 0.0  # generated rollouts: the load of the weight version into the engine(s)
    episodes: EpisodeCounts | None = None  # multi-turn episodes (generated rollouts with an environment)
    engines: dict[str, EngineCounts] = field(default_factory=dict)  # each engine replica's share (the engine pool)

    @property
    def reward_mean(self) -> float:
        return self.reward_sum / self.reward_count if self.reward_count else 0.0

    @property
    def reward_std(self) -> float:
        if not self.reward_count:
            return 0.0
        mean = self.reward_mean
        return max(self.reward_sq_sum / self.reward_count - mean * mean, 0.0) ** 0.5

    def to_json(self) -> dict[str, Any]:
        return {"source_index": self.source_index, "produced": self.produced, "filtered": dict(self.filtered),
                "carried_in": self.carried_in, "carried_out": self.carried_out, "seed": self.seed,
                "reward_sum": self.reward_sum, "reward_sq_sum": self.reward_sq_sum, "reward_count": self.reward_count,
                "reward_failed": self.reward_failed, "reward_failures": dict(self.reward_failures),
                "weight_version": self.weight_version,
                "groups_produced": self.groups_produced, "groups_kept": self.groups_kept,
                "groups_aborted": self.groups_aborted, "partials_carried": self.partials_carried,
                "partials_dropped": self.partials_dropped, "tokens_masked": self.tokens_masked,
                "sync_pause_seconds": self.sync_pause_seconds,
                **({"episodes": self.episodes.to_json()} if self.episodes is not None else {}),
                **({"engines": {k: c.to_json() for k, c in self.engines.items()}} if self.engines else {})}

    def engine_record(self) -> dict[str, Any]:
        """The per-step record's engine fields (empty without an engine pool): the prefix-cache hit rate over every
        engine (tokens found cached / looked up) and, by engine, its hit rate, its mean requests in flight while
        generating and its in-flight limit."""
        if not self.engines:
            return {}
        queries = sum(c.prefix_queries for c in self.engines.values())
        hits = sum(c.prefix_hits for c in self.engines.values())
        return {"prefix_hit_rate": hits / queries if queries > 0 else 0.0,
                "engine_prefix_hit_rate": {k: round(c.prefix_hit_rate, 6) for k, c in self.engines.items()},
                "engine_inflight": {k: round(c.inflight, 3) for k, c in self.engines.items()},
                "engine_concurrency": {k: c.concurrency for k, c in self.engines.items()}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SourceStats | None:
        if "source_index" not in d:
            return None
        return cls(source_index=int(d["source_index"]), produced=int(d["produced"]),
                   filtered={str(k): int(v) for k, v in d["filtered"].items()}, carried_in=int(d["carried_in"]),
                   carried_out=int(d["carried_out"]), seed=int(d["seed"]),
                   reward_sum=float(d.get("reward_sum", 0.0)), reward_sq_sum=float(d.get("reward_sq_sum", 0.0)),
                   reward_count=int(d.get("reward_count", 0)), reward_failed=int(d.get("reward_failed", 0)),
                   reward_failures={str(k): int(v) for k, v in (d.get("reward_failures") or {}).items()},
                   weight_version=int(d.get("weight_version", -1)), groups_produced=int(d.get("groups_produced", 0)),
                   groups_kept=int(d.get("groups_kept", 0)), groups_aborted=int(d.get("groups_aborted", 0)),
                   partials_carried=int(d.get("partials_carried", 0)),
                   partials_dropped=int(d.get("partials_dropped", 0)), tokens_masked=int(d.get("tokens_masked", 0)),
                   sync_pause_seconds=float(d.get("sync_pause_seconds", 0.0)),
                   episodes=EpisodeCounts.from_json(d["episodes"]) if "episodes" in d else None,
                   engines=engine_counts_from_json(d.get("engines", {})))


@dataclass(frozen=True)
class PublishedRollout:
    """What rollout `rollout` hands the trainers besides the per-rank payloads."""

    rollout: int
    schedule: DPSchedule
    loss_tokens: tuple[int, ...]  # per step
    step_offset: int  # optimizer steps published before this rollout
    samples_offset: int  # samples published before this rollout
    num_groups: int = 0
    step_tokens: tuple[int, ...] = ()  # tokens per step, all ranks
    imbalance: tuple[float, ...] = ()  # per step: max / mean rank token load
    mean_reward: float = 0.0  # mean reward of the published samples
    step_weight_versions: tuple[int, ...] = ()  # per step: oldest weight version of its trained tokens (-1: replayed)
    step_lag_means: tuple[float, ...] = ()  # per step: mean (rollout − token version) over its trained tokens
    stats: SourceStats | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # further keys a writer adds (kept, never interpreted)

    # ------------------------------------------------------------------------------------------ derived, once
    @property
    def dp_size(self) -> int:
        return self.schedule.dp_size

    @property
    def num_steps(self) -> int:
        return self.schedule.num_steps

    @property
    def global_batch_sizes(self) -> list[int]:
        return list(self.schedule.global_batch_sizes)

    @property
    def num_samples(self) -> int:
        return sum(self.schedule.global_batch_sizes)

    def steps(self) -> list[StepPlan]:
        out, mb_start, before = [], 0, self.samples_offset
        for s, (gbs, m) in enumerate(zip(self.schedule.global_batch_sizes, self.schedule.num_microbatches)):
            out.append(StepPlan(index=s, global_step=self.step_offset + s, global_batch_size=int(gbs),
                                loss_tokens=int(self.loss_tokens[s]), num_microbatches=int(m),
                                microbatches=range(mb_start, mb_start + m), samples_before=before,
                                weight_version=self.step_weight_versions[s] if self.step_weight_versions else -1,
                                policy_lag_mean=self.step_lag_means[s] if self.step_lag_means else None))
            mb_start += m
            before += int(gbs)
        return out

    def microbatch_positions(self, rank: int, step: StepPlan) -> list[list[int]]:
        """Rank `rank`'s micro-batches of `step`, each a list of positions into the rank's payload (may be empty)."""
        mbs = self.schedule.micro_batch_indices[rank]
        return [list(mbs[k]) for k in step.microbatches]

    # ------------------------------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        return {
            **self.extra,
            "rollout": self.rollout,
            "dp_size": self.dp_size,
            "schedule": self.schedule.to_dict(),
            "global_batch_sizes": self.global_batch_sizes,
            "loss_tokens": list(self.loss_tokens),
            "step_tokens": list(self.step_tokens),
            "imbalance": [round(float(x), 6) for x in self.imbalance],
            "num_steps": self.num_steps,
            "num_samples": self.num_samples,
            "num_groups": self.num_groups,
            "step_offset": self.step_offset,
            "samples_offset": self.samples_offset,
            "mean_reward": self.mean_reward,
            "step_weight_versions": list(self.step_weight_versions),
            "step_lag_means": [round(float(x), 6) for x in self.step_lag_means],
            **(self.stats.to_json() if self.stats is not None else {}),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PublishedRollout:
        """ValueError naming the field when `d` is not a well-formed published rollout."""
        if not isinstance(d, dict):
            raise ValueError(f"schedule: must be a JSON object, got {type(d).__name__}")
        missing = [k for k in ("rollout", "dp_size", "schedule", "loss_tokens", "step_offset", "samples_offset")
                   if k not in d]
        if missing:
            raise ValueError(f"schedule: missing field(s) {missing}")
        sched = DPSchedule.from_dict(d["schedule"])
        if int(d["dp_size"]) != sched.dp_size:
            raise ValueError(f"schedule.dp_size: {d['dp_size']} != the schedule's {sched.dp_size} ranks")
        loss_tokens = tuple(int(x) for x in d["loss_tokens"])
        if len(loss_tokens) != sched.num_steps:
            raise ValueError(f"schedule.loss_tokens: {len(loss_tokens)} entries for {sched.num_steps} steps")
        if "global_batch_sizes" in d and [int(x) for x in d["global_batch_sizes"]] != list(sched.global_batch_sizes):
            raise ValueError("schedule.global_batch_sizes: differs from schedule.schedule.global_batch_sizes")
        known = {"rollout", "dp_size", "schedule", "global_batch_sizes", "loss_tokens", "step_tokens", "imbalance",
                 "num_steps", "num_samples", "num_groups", "step_offset", "samples_offset", "mean_reward",
                 "step_weight_versions", "source_index", "produced", "filtered", "carried_in", "carried_out", "seed",
                 "reward_sum", "reward_sq_sum", "reward_count", "reward_failed", "reward_failures", "weight_version",
                 "groups_produced",
                 "groups_kept", "groups_aborted", "partials_carried", "partials_dropped", "tokens_masked",
                 "step_lag_means", "episodes", "engines"}
        versions = tuple(int(x) for x in d.get("step_weight_versions", ()))
        if versions and len(versions) != sched.num_steps:
            raise ValueError(f"schedule.step_weight_versions: {len(versions)} entries for {sched.num_steps} steps")
        lag_means = tuple(float(x) for x in d.get("step_lag_means", ()))
        if lag_means and len(lag_means) != sched.num_steps:
            raise ValueError(f"schedule.step_lag_means: {len(lag_means)} entries for {sched.num_steps} steps")
        return cls(
            rollout=int(d["rollout"]), schedule=sched, loss_tokens=loss_tokens, step_offset=int(d["step_offset"]),
            samples_offset=int(d["samples_offset"]), num_groups=int(d.get("num_groups", 0)),
            step_tokens=tuple(int(x) for x in d.get("step_tokens", ())),
            imbalance=tuple(float(x) for x in d.get("imbalance", ())), mean_reward=float(d.get("mean_reward", 0.0)),
            step_weight_versions=versions, step_lag_means=lag_means, stats=SourceStats.from_json(d),
            extra={k: v for k, v in d.items() if k not in known},
        )


# ---------------------------------------------------------------------------------------------------- building
class Samples(SampleArrays):
    """A rollout's samples in publish order, before scheduling: the table's fields (`contract.fields`: tokens, loss
    masks, rewards, advantages, sample ids, and optional ones such as the generator's logprobs and versions, all
    or none of the samples having each) as keyword arguments by attribute, and `group_ids` [n] (a group is never
    split across steps)."""

    def __init__(self, *, group_ids: list[int], **fields: Any):
        super().__init__(**fields)
        self.group_ids = group_ids


def build_published(
    rollout: int,
    samples: Samples,
    *,
    dp_size: int,
    groups_per_step: int | None,
    max_tokens_per_gpu: int | None,
    micro_batch_size: int | None,
    microbatch_multiple: int = 1,
    step_offset: int,
    samples_offset: int,
    stats: SourceStats | None = None,
    allow_leftover: bool = False,
) -> tuple[PublishedRollout, dict[int, RankPayload], list[int]]:
    """Schedule `samples` over `dp_size` ranks (`build_dp_schedule`) and cut the per-rank payloads.

    `groups_per_step` None: all complete groups form one step. Returns (published rollout, {rank: payload}, indices of
    leftover samples). Leftover samples are an AssertionError unless `allow_leftover` (the rollout splits whole steps
    before scheduling, so it never has any).
    """
    lengths = np.array([len(t) for t in samples.tokens], dtype=np.int64)
    sched = build_dp_schedule(
        lengths, dp_size=dp_size, global_batch_size=groups_per_step, group_ids=samples.group_ids,
        max_tokens_per_gpu=max_tokens_per_gpu, micro_batch_size=micro_batch_size,
        microbatch_multiple=microbatch_multiple,
    )
    if sched.leftover and not allow_leftover:
        raise AssertionError(f"scheduler left {len(sched.leftover)} samples over from whole steps")
    # a sample's first token is never a target (nothing precedes it), so it never counts as a loss token
    loss_counts = np.array([int(m[1:].sum()) for m in samples.loss_masks], dtype=np.int64)
    imbalance, step_tokens = [], []
    for s in range(sched.num_steps):
        load = [sum(int(lengths[i]) for mb in sched.step_microbatches(r, s) for i in mb) for r in range(dp_size)]
        step_tokens.append(sum(load))
        mean = sum(load) / dp_size
        imbalance.append(max(load) / mean if mean else 1.0)
    payloads = {r: rank_payload(samples, part) for r, part in enumerate(sched.partitions)}
    placed = [i for part in sched.partitions for i in part]
    step_versions: tuple[int, ...] = ()
    lag_means: tuple[float, ...] = ()
    if samples.versions is not None:
        step_versions, lag_means = step_policy_lags(rollout, samples, sched)
    rewards = samples.rewards[placed] if placed else np.zeros(0, np.float32)
    published = PublishedRollout(
        rollout=rollout, schedule=sched, loss_tokens=tuple(sched.step_loss_tokens(loss_counts)),
        step_offset=step_offset, samples_offset=samples_offset, num_groups=len(set(samples.group_ids[i] for i in placed)),
        step_tokens=tuple(step_tokens), imbalance=tuple(imbalance),
        mean_reward=float(rewards.mean()) if len(rewards) else 0.0, step_weight_versions=step_versions,
        step_lag_means=lag_means, stats=stats,
    )
    return published, payloads, list(sched.leftover)


def step_policy_lags(rollout: int, samples: Samples, sched: DPSchedule) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Per step: the oldest weight version among its trained tokens, and the mean over its trained tokens of
    `rollout − token version` (the trainers hold version `rollout` when they train it). Without per-token versions
    every token of a sample has the sample's version."""
    oldest, means = [], []
    for s in range(sched.num_steps):
        members = list(sched.step_samples(s))
        parts = []
        for i in members:
            trained = samples.loss_masks[i][1:] > 0  # a first token is never a target
            if samples.token_versions is not None:
                parts.append(samples.token_versions[i][1:][trained])
            else:
                parts.append(np.full(int(trained.sum()), samples.versions[i], np.int64))
        flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if not len(flat):  # no trained token at all: the samples' own versions
            flat = samples.versions[members].astype(np.int64)
        oldest.append(int(flat.min()))
        means.append(float((rollout - flat).mean()))
    return tuple(oldest), tuple(means)


def rank_payload(samples: Samples, indices: list[int]) -> RankPayload:
    """The RankPayload of the samples at `indices`, in that order (`SampleArrays.payload`)."""
    return samples.payload(indices)


# ---------------------------------------------------------------------------------------------------- store I/O
class RolloutChannel(Protocol):
    """What publishing and reading a rollout needs of a store (`trainingrun.store` implements it)."""

    url: str

    def publish_rollout(self, rollout: int, payloads: dict[int, RankPayload], schedule: dict[str, Any]) -> Any: ...

    def read_schedule(self, rollout: int) -> dict[str, Any]: ...


def publish(store: RolloutChannel, published: PublishedRollout, payloads: dict[int, RankPayload]) -> bool:
    """Publish atomically (payloads, schedule, commit); False when the rollout was already committed."""
    return bool(store.publish_rollout(published.rollout, payloads, published.to_json()))


def read(store: RolloutChannel, rollout: int) -> PublishedRollout:
    """The committed rollout's published form; ValueError naming the field if the stored document is malformed."""
    d = store.read_schedule(rollout)
    try:
        published = PublishedRollout.from_json(d)
    except ValueError as exc:
        raise ValueError(f"store {store.url}: rollout {rollout}: {exc}") from None
    if published.rollout != rollout:
        raise ValueError(f"store {store.url}: rollout {rollout}: schedule.rollout says {published.rollout}")
    return published
