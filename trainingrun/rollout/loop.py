"""The rollout loop: one small stage per step of the data flow, for rollout k = 0, 1, ...

    draw prompts → generate → score        (the source, `rollout/source.py`: `synthetic.py`, `jsonl.py` or
                                            `generate.py`)
    [generated: the scored groups are staged in the resume state]
    → filter → advantages                  (`rollout/pipeline.py`; carried generated groups older than the
                                            staleness bound are dropped: filter "stale"; with partial rollouts and
                                            staleTokens mask, tokens older than the bound are masked out of the loss)
    → split into steps (carried groups first; a source rollout that fills no step is carried whole)
    → schedule + per-rank payloads         (`contract/published.py`)
    → wait for room (maxPendingRollouts) → publish → save the resume state

With `rollout.eval` (`rollout/evaluate.py`), weight versions 0, N, 2N, ... are evaluated on held-out prompts before the
rollout generated with them, and the final version after the last rollout, before `finish` ends the stream; the last
version evaluated is part of the resume state.

A source rollout whose groups do not fill a step publishes nothing: its groups are carried and the next source
rollout is drawn, so every published rollout has at least one step and k counts published rollouts (numRollouts of
them; a jsonl source may end earlier). At the end, `finish(k)`; groups still carried are reported, never silently
dropped. A restarted rollout reads its state (store key "rollout_state", the contract's `RolloutStateRecord`: next
k, next source index, carried groups, offsets, totals, and with over-sampling the prompt stream: `rollout/stream.py`)
and continues; the rollout it was publishing when it died is rebuilt from the same state, bit for bit (the replay
sources depend only on seed and source index; generated groups were staged in the state, with the stream after them,
before anything of them was published), and re-publishing a committed rollout is a no-op.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainingrun.api.models import TrainingRun, TrainingRunSpec
from trainingrun.contract.errors import ConfigError, CorruptPayload, StoreError
from trainingrun.contract.published import PublishedRollout, SourceStats, build_published, publish
from trainingrun.contract.resume import ResumePoint
from trainingrun.contract.rollout_state import ROLLOUT_STATE_KEY, RolloutStateRecord
from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.tokenizer import TokenizerError, run_tokenizer
from trainingrun.rollout.evaluate import Evaluator
from trainingrun.rollout.generate import GenerateSource, required_version
from trainingrun.rollout.groups import SampleGroup
from trainingrun.rollout.jsonl import JsonlSource, load_jsonl
from trainingrun.rollout.pipeline import (
    ESTIMATORS, FilterStats, apply_filters, as_samples, compute_advantages, mask_stale_tokens, normalize_over_steps,
    split_into_steps,
)
from trainingrun.rollout.recovery import TrainersAhead, discard_below
from trainingrun.rollout.source import Source
from trainingrun.rollout.stream import PromptStream
from trainingrun.rollout.synthetic import SyntheticConfig, SyntheticSource
from trainingrun.store.base import Store
from trainingrun.tracking import output_dir

MAX_EMPTY_SOURCE_ROLLOUTS = 100


# ------------------------------------------------------------------------------------------------------ state
@dataclass
class RolloutState:
    """What a restarted rollout needs to continue exactly where it was (stored under ROLLOUT_STATE_KEY as the
    contract's `RolloutStateRecord`, its groups in their JSON form)."""

    fingerprint: str
    next_rollout: int = 0  # index of the next rollout to publish
    source_index: int = 0  # next source rollout to draw
    step_offset: int = 0  # optimizer steps published so far
    samples_offset: int = 0  # samples published so far
    carried: list[SampleGroup] = field(default_factory=list)  # filtered groups waiting for a step
    empty_streak: int = 0  # consecutive source rollouts that published nothing
    totals: dict[str, int] = field(default_factory=lambda: {"produced": 0, "max_length": 0, "zero_variance": 0})
    finished: bool = False
    staged: list[SampleGroup] | None = None  # generated + scored groups of source rollout `source_index`, not yet used
    stream: dict[str, Any] | None = None  # over-sampling: the prompt stream before source rollout `source_index`
    staged_stream: dict[str, Any] | None = None  # ... and after it (with `staged`)
    eval_last: int = -1  # rollout.eval: the last weight version evaluated (-1: none)
    step_offsets: list[int] = field(default_factory=lambda: [0])  # step_offset at the start of the last rollouts

    def step_at(self, version: int) -> int:
        """Optimizer steps trained into weight version `version` (the step offset at the start of rollout
        `version`, one of the last few: `step_offsets`)."""
        i = len(self.step_offsets) - 1 - (self.next_rollout - version)
        return self.step_offsets[min(max(i, 0), len(self.step_offsets) - 1)]

    @property
    def carried_samples(self) -> int:
        return sum(len(g) for g in self.carried)

    def to_record(self) -> RolloutStateRecord:
        return RolloutStateRecord(
            fingerprint=self.fingerprint, next_rollout=self.next_rollout, source_index=self.source_index,
            step_offset=self.step_offset, samples_offset=self.samples_offset,
            carried=tuple(g.to_json() for g in self.carried), empty_streak=self.empty_streak,
            totals=dict(self.totals), finished=self.finished,
            staged=None if self.staged is None else tuple(g.to_json() for g in self.staged),
            stream=self.stream, staged_stream=self.staged_stream,
            eval_last=None if self.eval_last < 0 else self.eval_last, step_offsets=tuple(self.step_offsets),
        )

    @classmethod
    def from_record(cls, r: RolloutStateRecord) -> RolloutState:
        return cls(
            fingerprint=r.fingerprint, next_rollout=r.next_rollout, source_index=r.source_index,
            step_offset=r.step_offset, samples_offset=r.samples_offset,
            carried=[SampleGroup.from_json(g) for g in r.carried], empty_streak=r.empty_streak,
            totals=dict(r.totals), finished=r.finished,
            staged=None if r.staged is None else [SampleGroup.from_json(g) for g in r.staged],
            stream=r.stream, staged_stream=r.staged_stream,
            eval_last=-1 if r.eval_last is None else r.eval_last,
            step_offsets=list(r.step_offsets) or [r.step_offset],
        )

    def save(self, store: Store) -> None:
        self.to_record().write(store)


def config_fingerprint(spec: TrainingRunSpec, arch: Architecture) -> str:
    """Hash of everything that decides the published data (not numRollouts/maxPendingRollouts, which may change, nor
    the evaluation, which trains nothing).

    Not the data-parallel size either: a run may be resized (elastic data parallelism). The rollouts published
    after a resize are scheduled for the new size; those published before it are re-scheduled by the trainers
    (`trainer/reshard.py`), with the same steps and samples."""
    rollout = spec.rollout.to_dict()
    for volatile in ("numRollouts", "maxPendingRollouts", "resources", "eval"):
        rollout.pop(volatile, None)
    t = spec.trainer
    relevant = {
        "seed": spec.seed, "rollout": rollout, "model": arch.to_dict(),
        "trainer": [t.max_tokens_per_gpu, t.micro_batch_size, t.microbatch_multiple, t.loss_type],
        "advantage": t.advantage.to_dict(),
    }
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class RolloutResult:
    rollouts: int  # published
    samples: int  # published
    steps: int
    leftover_groups: int  # carried at the end, not published
    leftover_samples: int
    totals: dict[str, int]
    resumed: bool


# ------------------------------------------------------------------------------------------------------ set-up
def check_config(spec: TrainingRunSpec, arch: Architecture) -> None:
    """Settings that can never work with the run's model `arch`; ConfigError naming the field."""
    r = spec.rollout
    if r.source.type == "synthetic":
        vocab = r.source.synthetic.vocab_size
        model_vocab = arch.vocab_size
        if vocab is not None and vocab > model_vocab:
            raise ConfigError(
                f"rollout.source.synthetic.vocabSize: {vocab} exceeds model vocabSize {model_vocab}"
            )


def _run_tokenizer(arch: Architecture):
    """The run's tokenizer (model.hf's tokenizer.json) for text jsonl lines; ConfigError without one."""
    if not arch.hf:
        raise ConfigError("text lines need the run's tokenizer: set model.hf to a Hugging Face directory with "
                          "tokenizer.json")
    try:
        return run_tokenizer(arch.hf)
    except (TokenizerError, OSError) as exc:
        raise ConfigError(str(exc)) from None


def make_source(spec: TrainingRunSpec, arch: Architecture, say: Callable[[str], None], store: Store | None = None,
                max_wait: float | None = None) -> Source:
    """The source `spec.rollout.source` names, for the run's model `arch`."""
    r = spec.rollout
    if r.source.type == "generate":
        return GenerateSource(spec, store, arch=arch, say=say, max_wait=max_wait)
    groups_per_rollout = r.samples_per_rollout // r.group_size
    if r.source.type == "jsonl":
        assert r.source.jsonl is not None
        data = load_jsonl(r.source.jsonl.path, vocab_size=arch.vocab_size, tokenizer=lambda: _run_tokenizer(arch))
        say(f"rollout: {data.path}: {data.num_samples} samples in {len(data.groups)} groups")
        estimator = spec.trainer.advantage.estimator
        if ESTIMATORS[estimator].over_steps and any(g.advantages is not None for g in data.groups):
            raise ConfigError(
                f"trainer.advantage.estimator: {estimator} normalises advantages over each step, but "
                f"{r.source.jsonl.path} gives advantages, which are used as they are; use estimator grpo (or give "
                "rewards only)")
        return JsonlSource(data, groups_per_rollout)
    s = r.source.synthetic
    return SyntheticSource(SyntheticConfig(
        task=s.task, min_length=s.min_length, max_length=s.max_length,
        vocab_size=s.vocab_size or arch.vocab_size, group_size=r.group_size,
        groups_per_rollout=groups_per_rollout, seed=spec.seed,
    ))


# ------------------------------------------------------------------------------------------------------ the loop
class RolloutLoop:
    """Produces, filters, schedules and publishes every rollout of a run into a store (see the module docstring).

    `run()` raises ConfigError for configuration/input errors, StoreError for store errors, TimeoutError when trainers
    consumed nothing for `max_wait` seconds.
    """

    def __init__(self, spec: TrainingRunSpec, store: Store, *, dp_size: int | None = None, metrics=None,
                 progress: Callable[[str], None] | None = None, max_wait: float | None = None,
                 poll_interval: float = 0.1, out_dir: Path | None = None):
        self.spec = spec
        self.store = store
        self.dp = spec.trainer.data_parallel_size if dp_size is None else dp_size
        self.metrics = metrics
        self.say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.max_wait = max_wait
        self.poll_interval = poll_interval
        try:
            self.arch = spec.model.resolved()  # once per process; passed down
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        check_config(spec, self.arch)
        seq_length = self.arch.seq_length
        self.max_length = min(spec.rollout.filters.max_length or seq_length, seq_length)
        self.source = make_source(spec, self.arch, self.say, store, max_wait)
        if isinstance(self.source, GenerateSource):  # over-sampling stops once enough groups pass the filters
            self.source.keeps = self.keeps
        self.evaluator = None
        if spec.rollout.eval is not None and isinstance(self.source, GenerateSource):
            self.evaluator = Evaluator(spec, self.source, self.arch, store=store, metrics=metrics, say=self.say,
                                       out_dir=output_dir(spec) if out_dir is None else out_dir)
        self.fingerprint = config_fingerprint(spec, self.arch)

    def keeps(self, group: SampleGroup) -> bool:
        """Whether `group` passes the filters (`filter` below)."""
        return bool(apply_filters([group], max_length=self.max_length,
                                  zero_variance=self.spec.rollout.filters.zero_variance)[0])

    def run(self) -> RolloutResult:
        try:
            state, resumed = self.resume()
            if self.evaluator is not None:
                self.evaluator.start()
            while not state.finished and state.next_rollout < self.spec.rollout.num_rollouts:
                self.evaluate(state)
                step = self.advance(state)
                if step is None:
                    self.exhausted(state)
                    break
                after, published, payloads = step
                if published is None:
                    state = after
                    continue
                try:
                    state = self.publish(after, published, payloads)
                except TrainersAhead as ahead:  # the store lost data: the trainers' checkpoint is past our stream
                    state = self.catch_up(state, ahead.point)
            return self.finish(state, resumed)
        finally:
            if self.evaluator is not None:
                self.evaluator.close()
            self.source.close()

    def evaluate(self, state: RolloutState, *, final: bool = False) -> None:
        """rollout.eval: the weight version due before rollout `state.next_rollout` (or, `final`, the one trained on
        every rollout published), evaluated and marked done in the state (`rollout/evaluate.py`)."""
        ev = self.evaluator
        if ev is None or state.finished:
            return
        k = state.next_rollout
        version = k if final else required_version(k, self.spec.rollout.max_policy_lag)
        if not ev.due(version, state.eval_last, final=final):
            return
        ev.run(version, step=state.step_at(version), rollout=k)
        state.eval_last = version
        state.save(self.store)

    def advance(self, state: RolloutState, *, replay: bool = False):
        """One source rollout from `state`: (state after it, the rollout to publish and its payloads — both None
        when no step formed and everything was carried), or None when the source is exhausted. With `replay`
        (fast-forward) nothing is counted, reported or stored."""
        groups = self.produce(state, replay=replay)
        if groups is None:
            return None
        carried, stale = self.drop_stale(state.carried, state.next_rollout)
        kept, fstats = self.filter(groups, count=not replay)
        fstats.stale = stale
        step_groups, carry = self.split(carried + kept)
        after = self.account(state, groups, fstats, carry)
        if not step_groups:
            return self.carry_over(state, after, groups, fstats, quiet=replay), None, None
        masked = self.mask_stale(step_groups, state.next_rollout)
        stats = self.source_stats(state, after, groups, kept, fstats, masked, carried_in=sum(len(g) for g in carried))
        published, payloads = self.schedule(state, step_groups, stats)
        return after, published, payloads

    # ---- stages
    def produce(self, state: RolloutState, *, replay: bool = False) -> list[SampleGroup] | None:
        """Draw prompts → generate → score source rollout `state.source_index` (None: the source is exhausted).
        Generated groups are staged in the resume state first, so a restart reuses them instead of generating
        different samples for prompts that may already be published (`replay`: a fast-forward of a replay source,
        nothing is stored)."""
        if state.staged is not None:
            self.say(f"rollout: source rollout {state.source_index}: reusing its {len(state.staged)} staged groups")
            return state.staged
        streaming = getattr(self.source, "streaming", False)
        if streaming:  # the requests come from the stream of the state (rollout/stream.py)
            self.source.stream = PromptStream.from_json(state.stream)
        prompts = self.source.draw(state.source_index)
        if prompts is None:
            return None
        groups = self.source.generate(prompts, state.next_rollout)
        self.source.score(groups)
        if streaming:
            state.staged_stream = self.source.stream.to_json()
        if (streaming or (groups and groups[0].versions is not None)) and not replay:
            state.staged = groups
            state.save(self.store)
            gen = getattr(self.source, "stats", None)
            if gen is not None:
                self.observe_generation(gen, groups)
        return groups

    def observe_generation(self, gen, groups: list[SampleGroup]) -> None:
        rewards = np.concatenate([g.rewards for g in groups]).astype(np.float64)
        self.say(f"rollout: source rollout generated with weight version {gen.weight_version}: {gen.samples} "
                 f"samples, {gen.generated_tokens} tokens in {gen.generate_seconds:.2f}s "
                 f"({gen.generated_tokens / max(gen.generate_seconds, 1e-9):.0f} tok/s), waited "
                 f"{gen.wait_seconds:.2f}s for weights, reward mean {rewards.mean():.3f}"
                 + (f"; {gen.episodes.summary()}" if gen.episodes is not None else ""))
        if self.metrics is not None:
            self.metrics.observe_generation(gen, rewards)

    def drop_stale(self, carried: list[SampleGroup], rollout: int) -> tuple[list[SampleGroup], int]:
        """Carried generated groups older than rollout `rollout`'s weight version may not be trained with it."""
        if self.spec.rollout.source.type != "generate":
            return carried, 0
        bound = required_version(rollout, self.spec.rollout.max_policy_lag)
        fresh = [g for g in carried if g.versions is None or int(g.versions.min()) >= bound]
        stale = sum(len(g) for g in carried) - sum(len(g) for g in fresh)
        if stale:
            self.say(f"rollout {rollout}: dropped {stale} carried samples generated before weight version {bound}")
        return fresh, stale

    def mask_stale(self, step_groups: list[SampleGroup], rollout: int) -> int:
        """Partial rollouts with staleTokens mask: tokens older than rollout `rollout`'s bound train nothing."""
        r = self.spec.rollout
        if not (r.partial_rollout and r.stale_tokens == "mask"):
            return 0
        masked = mask_stale_tokens(step_groups, required_version(rollout, r.max_policy_lag))
        if masked:
            self.say(f"rollout {rollout}: {masked} tokens older than weight version "
                     f"{required_version(rollout, r.max_policy_lag)} masked out of the loss")
        return masked

    def source_stats(self, state: RolloutState, after: RolloutState, groups: list[SampleGroup], kept: list[SampleGroup],
                     fstats: FilterStats, masked: int = 0, *, carried_in: int) -> SourceStats:
        """`carried_in`: the carried samples this rollout trains or carries on (those dropped as stale are not);
        `masked`: the tokens masked as stale (partial rollouts)."""
        rewards = np.concatenate([g.rewards for g in groups]).astype(np.float64) if groups else np.zeros(0)
        gen = getattr(self.source, "stats", None)
        return SourceStats(
            source_index=state.source_index, produced=sum(len(g) for g in groups), filtered=fstats.as_dict(),
            carried_in=carried_in, carried_out=after.carried_samples, seed=self.spec.seed,
            reward_sum=float(rewards.sum()), reward_sq_sum=float((rewards ** 2).sum()), reward_count=len(rewards),
            reward_failed=sum(gen.reward_failed.values()) if gen is not None else 0,
            reward_failures={r: n for r, n in gen.reward_failed.items() if n} if gen is not None else {},
            weight_version=min((int(g.versions.min()) for g in groups if g.versions is not None), default=-1),
            groups_produced=len(groups), groups_kept=len(kept),
            groups_aborted=getattr(gen, "groups_aborted", 0), partials_carried=getattr(gen, "partials_carried", 0),
            partials_dropped=getattr(gen, "partials_dropped", 0), tokens_masked=masked,
            sync_pause_seconds=float(getattr(gen, "load_seconds", 0.0)),
            episodes=gen.episodes if gen is not None else None,
            engines=dict(getattr(gen, "engines", {}) or {}),
        )

    def resume(self) -> tuple[RolloutState, bool]:
        stored = RolloutStateRecord.read(self.store)
        if stored is None:
            state = RolloutState(fingerprint=self.fingerprint)
            point = ResumePoint.read(self.store)
            if point is not None and point.rollout > state.next_rollout:  # a store that lost the stream
                return self.catch_up(state, point), True
            return state, False
        try:
            state = RolloutState.from_record(stored)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a group that does not decode
            raise CorruptPayload(f"store {self.store.url}: key {ROLLOUT_STATE_KEY}: the rollout's resume state is "
                                 f"malformed ({exc.__class__.__name__}: {exc})") from None
        if state.fingerprint != self.fingerprint:
            raise ConfigError(
                f"store {self.store.url} holds rollout state of a different configuration (fingerprint "
                f"{state.fingerprint}, this spec {self.fingerprint}): seed, rollout, model or trainer batching "
                "changed; use a fresh store for a changed run"
            )
        self.say(f"rollout: resuming at rollout {state.next_rollout} (source rollout {state.source_index}, "
                 f"{state.carried_samples} carried samples)")
        self.note_resize(state)
        return state, True

    def note_resize(self, state: RolloutState) -> None:
        """Say so when the run was resized since the last published rollout."""
        try:
            last = self.store.read_schedule(state.next_rollout - 1) if state.next_rollout else None
        except StoreError:  # released already
            return
        old = int(last.get("dp_size", self.dp)) if last else self.dp
        if old != self.dp:
            self.say(f"rollout: data-parallel size changed from {old} to {self.dp}: rollouts from {state.next_rollout} "
                     f"on are scheduled for {self.dp} ranks; the trainers re-schedule those published for {old}")

    def filter(self, groups: list[SampleGroup], *, count: bool = True) -> tuple[list[SampleGroup], FilterStats]:
        kept, fstats = apply_filters(groups, max_length=self.max_length,
                                     zero_variance=self.spec.rollout.filters.zero_variance)
        adv = self.spec.trainer.advantage
        compute_advantages(kept, self.spec.trainer.loss_type, adv.estimator, adv.std_normalization)
        if self.metrics is not None and count:
            self.metrics.produced.inc(sum(len(g) for g in groups))
            for name, n in fstats.as_dict().items():
                self.metrics.filtered[name].inc(n)
            self.metrics.groups.labels(self.metrics.run, "produced").inc(len(groups))
            self.metrics.groups.labels(self.metrics.run, "kept").inc(len(kept))
        return kept, fstats

    def split(self, candidates: list[SampleGroup]) -> tuple[list[SampleGroup], list[SampleGroup]]:
        r, t = self.spec.rollout, self.spec.trainer
        return split_into_steps(
            candidates, policy=r.steps.policy, groups_per_step=r.steps.global_batch_size, dp_size=self.dp,
            micro_batch_size=t.micro_batch_size, microbatch_multiple=t.microbatch_multiple,
        )

    def account(self, state: RolloutState, groups: list[SampleGroup], fstats: FilterStats,
                carry: list[SampleGroup]) -> RolloutState:
        """The state after this source rollout, before anything of it is published."""
        totals = dict(state.totals)
        totals["produced"] = totals.get("produced", 0) + sum(len(g) for g in groups)
        for name, n in fstats.as_dict().items():
            if n or name in totals:
                totals[name] = totals.get(name, 0) + n
        return RolloutState(
            fingerprint=self.fingerprint, next_rollout=state.next_rollout, source_index=state.source_index + 1,
            step_offset=state.step_offset, samples_offset=state.samples_offset, carried=carry, totals=totals,
            stream=state.staged_stream if state.staged_stream is not None else state.stream,
            eval_last=state.eval_last, step_offsets=list(state.step_offsets),
        )

    def carry_over(self, state: RolloutState, after: RolloutState, groups: list[SampleGroup],
                   fstats: FilterStats, *, quiet: bool = False) -> RolloutState:
        """No step formed: everything kept is carried and the next source rollout is drawn."""
        after.empty_streak = state.empty_streak + 1
        if not quiet:
            self.say(f"rollout: source rollout {state.source_index}: {sum(len(g) for g in groups)} produced, "
                     f"filtered {fstats.as_dict()}, {after.carried_samples} samples carried: not enough for a step, "
                     "drawing the next one")
        if after.empty_streak >= MAX_EMPTY_SOURCE_ROLLOUTS:
            raise ConfigError(
                f"rollout.filters: {MAX_EMPTY_SOURCE_ROLLOUTS} source rollouts in a row did not fill one step "
                f"(filtered so far: {after.totals}); the filters drop (nearly) everything"
            )
        if not quiet:
            after.save(self.store)
        return after

    def schedule(self, state: RolloutState, step_groups: list[SampleGroup],
                 stats: SourceStats) -> tuple[PublishedRollout, dict]:
        r, t = self.spec.rollout, self.spec.trainer
        groups_per_step = r.steps.global_batch_size if r.steps.policy == "fixed" else None
        samples = as_samples(step_groups)
        if ESTIMATORS[t.advantage.estimator].over_steps and t.loss_type != "sft":
            samples.advantages = normalize_over_steps(samples.advantages, step_groups, groups_per_step,
                                                      t.advantage.std_normalization)
        published, payloads, _ = build_published(
            state.next_rollout, samples, dp_size=self.dp,
            groups_per_step=groups_per_step,
            max_tokens_per_gpu=t.max_tokens_per_gpu, micro_batch_size=t.micro_batch_size,
            microbatch_multiple=t.microbatch_multiple, step_offset=state.step_offset,
            samples_offset=state.samples_offset, stats=stats,
        )
        return published, payloads

    def publish(self, after: RolloutState, published: PublishedRollout, payloads: dict) -> RolloutState:
        k = published.rollout
        self.wait_for_room(k)
        t0 = time.perf_counter()
        fresh = publish(self.store, published, payloads)
        seconds = time.perf_counter() - t0
        self.passed(after, published)
        after.save(self.store)
        if self.metrics is not None:
            self.metrics.published.inc(published.num_samples)
            self.metrics.rollouts.inc()
            self.metrics.imbalance.set(published.imbalance[-1])
            self.metrics.publish_seconds.observe(seconds)
        st = published.stats
        assert st is not None
        self.say(
            f"rollout {k}{'' if fresh else ' (already committed: re-publish skipped)'}: {st.produced} produced, "
            f"filtered {st.filtered}, {st.carried_in} carried in"
            + (f" ({st.filtered['stale']} carried dropped as stale)" if st.filtered.get("stale") else "")
            + f", {published.num_samples} samples in "
            f"{published.num_steps} step(s) (global batch sizes {published.global_batch_sizes}), "
            f"{st.carried_out} carried out, imbalance {max(published.imbalance):.3f}, published in {seconds:.3f}s"
            + (f", reward mean {st.reward_mean:.3f}" if st.reward_count else "")
        )
        return after

    def passed(self, after: RolloutState, published: PublishedRollout) -> None:
        """`after` moves past `published` (its counters; the caller stores or replays)."""
        after.next_rollout = published.rollout + 1
        after.step_offset = published.step_offset + published.num_steps
        after.samples_offset = published.samples_offset + published.num_samples
        after.step_offsets = [*after.step_offsets, after.step_offset][-(self.spec.rollout.max_policy_lag + 1):]

    def catch_up(self, state: RolloutState, point: ResumePoint) -> RolloutState:
        """The trainers resume at `point`, past this rollout's stream (the store lost data): release what we
        published below it, fast-forward to it without publishing, store the state (see `rollout/recovery.py`)."""
        k = point.rollout
        gone = discard_below(self.store, k, range(state.next_rollout))
        self.say(f"rollout: the trainers resume at rollout {k} (step {point.global_step}, attempt {point.attempt}) "
                 f"but this stream is at rollout {state.next_rollout}: the store lost data; "
                 + (f"released rollouts {gone[0]}..{gone[-1]} nobody will read; " if gone else "")
                 + f"re-creating the state up to rollout {k}")
        if not getattr(self.source, "replayable", True):
            raise ConfigError(f"rollout: the store lost the rollouts up to {k} and this source cannot re-create "
                              "them (its rollouts are generated, not replayed); start the run again with a fresh "
                              "store and fresh checkpoints, and give the store persistence")
        t0 = time.perf_counter()
        while state.next_rollout < k:
            step = self.advance(state, replay=True)
            if step is None:
                raise ConfigError(f"rollout: cannot re-create rollout {k} where the trainers resume: the source "
                                  f"ends after rollout {state.next_rollout}")
            after, published, _ = step
            if published is not None:
                self.passed(after, published)
            state = after
        if state.step_offset + point.step_in_rollout != point.global_step:
            raise ConfigError(
                f"rollout: re-created rollout {k} starts at step {state.step_offset}, but the trainers' checkpoint "
                f"is at step {point.global_step} ({point.step_in_rollout} into rollout {k}): their checkpoint was "
                "not trained on this spec's data; use the spec that trained it, or fresh checkpoints")
        state.save(self.store)
        self.say(f"rollout: re-created the state at rollout {k} (source rollout {state.source_index}) in "
                 f"{time.perf_counter() - t0:.1f}s; publishing from there")
        return state

    def wait_for_room(self, k: int) -> None:
        """Backpressure: block while `maxPendingRollouts` or more published rollouts are unconsumed. Raises
        TrainersAhead when the trainers' resume point is past rollout `k` (see `rollout/recovery.py`)."""
        is_committed = getattr(self.store, "is_committed", None)
        if is_committed is not None and is_committed(k):
            return  # restarted after publishing k: nothing new goes into the store
        max_pending = self.spec.rollout.max_pending_rollouts
        waited = False
        t0 = time.monotonic()
        while True:
            point = ResumePoint.read(self.store)
            if point is not None and point.rollout > k:
                raise TrainersAhead(point)
            pending = self.store.pending_rollouts()
            if self.metrics is not None:
                self.metrics.pending.set(pending)
            if pending < max_pending:
                if waited:
                    self.say(f"rollout {k}: trainers caught up after {time.monotonic() - t0:.1f}s")
                return
            if not waited:
                self.say(f"rollout {k}: waiting for trainers ({pending} rollouts pending >= "
                         f"maxPendingRollouts={max_pending})")
                waited = True
            if self.max_wait is not None and time.monotonic() - t0 > self.max_wait:
                raise TimeoutError(f"rollout {k}: trainers consumed nothing for {self.max_wait:g}s ({pending} "
                                   "rollouts pending)")
            time.sleep(self.poll_interval)

    def exhausted(self, state: RolloutState) -> None:
        self.say(f"rollout: source exhausted after {state.source_index} source rollouts")
        if state.next_rollout == 0:  # a run that trains nothing must not look like a success
            raise ConfigError(
                f"rollout.source.jsonl: the source's {state.totals['produced']} samples gave no training step "
                f"(filtered: max_length {state.totals['max_length']}, zero_variance "
                f"{state.totals['zero_variance']}; {state.carried_samples} kept but too few for a step); check "
                "rollout.filters (zeroVariance drops groups whose rewards all equal, e.g. groups of one sample) and "
                "rollout.steps"
            )

    def finish(self, state: RolloutState, resumed: bool) -> RolloutResult:
        self.evaluate(state, final=True)  # before the end of the stream: the trainers still serve the last weights
        if not state.finished:
            state.finished = True
            state.save(self.store)
        self.store.finish(state.next_rollout)
        leftover = state.carried_samples
        if leftover:
            self.say(f"rollout: {len(state.carried)} group(s) / {leftover} sample(s) left over at the end: they did "
                     "not fill a step and were not published")
        self.say(f"rollout: finished: {state.next_rollout} rollouts, {state.step_offset} steps, "
                 f"{state.samples_offset} samples published; produced {state.totals['produced']}, filtered "
                 f"max_length {state.totals['max_length']}, zero_variance {state.totals['zero_variance']}")
        return RolloutResult(
            rollouts=state.next_rollout, samples=state.samples_offset, steps=state.step_offset,
            leftover_groups=len(state.carried), leftover_samples=leftover, totals=dict(state.totals),
            resumed=resumed,
        )


def run_rollout(run: TrainingRun | TrainingRunSpec, store: Store, **kwargs) -> RolloutResult:
    """In-process use: `RolloutLoop(spec, store, **kwargs).run()`."""
    spec = run.spec if isinstance(run, TrainingRun) else run
    return RolloutLoop(spec, store, **kwargs).run()
