"""Periodic evaluation on held-out prompts (`spec.rollout.eval`; docs/rl.md, "Evaluation").

Schedule (the rollout loop asks `due` before every rollout and at the end; its state keeps `eval_last`): weight
version v = 0, N, 2N, ... (N = intervalRollouts) is evaluated before the rollout that is generated with it (rollout
v + maxPolicyLag: the engine loads v then anyway), and the final version (the number of rollouts published: the
weights trained on all of them) after the last rollout, before the rollout ends the stream, so the trainers, which
wait for its end, still serve it (a `broadcast` sync too). One evaluation:

    the engine, holding weight version v, samples k = samplesPerPrompt completions of each of the first numPrompts
    held-out prompts (the same prompts every time) with eval.sampling (default the run's), seeded by (seed, v)
    → each completion cut at its stop like a training one (`generate.reward_response`) → eval.reward (default the
      run's, without overlong shaping) scores them; failed rewards count and get failedReward
    → reward_mean, pass@1 and pass@k (a completion passes at reward >= passThreshold; the unbiased estimator
      1 − C(n − c, k) / C(n, k) per prompt of n completions with c passing, averaged over the prompts)
    → the record (`contract.evaluation.EvalRecord`) is stored in the store's eval list, then eval.jsonl is rewritten
      from that list into the output directory, TensorBoard gets eval/<field> at its step, Prometheus trainingrun_eval_*

Training is unchanged by it: the evaluation has its own prompt source (synthetic prompts and a reasoning-gym dataset
without its own seed are drawn from a seed of their own), its own sampling seeds (never the training's request or
call seeds), its own reward scorer (workers, thread pool) and statistics; it draws nothing from the prompt stream of
over-sampling; it loads the version the next training call needs anyway (so no extra load, and no version the
training would not hold), and afterwards drops an engine's continuation cache (`drop_cache`, the in-process engine) so
that no training call continues from an evaluation's keys and values. A restarted rollout neither repeats nor skips an
evaluation: a version already in the store's list is not evaluated again, and `eval_last` in the rollout's state
says which are done.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from trainingrun.contract.engine import Sampling
from trainingrun.contract.errors import ConfigError
from trainingrun.contract.evaluation import EVAL_FILE, EvalRecord, read_evals, write_evals
from trainingrun.modeling.architecture import Architecture
from trainingrun.rollout.episodes import cut_at_stop
from trainingrun.rollout.generate import GenerateSource, GenerateStats, reward_response
from trainingrun.rollout.prompts import load_tokenizer, make_prompts
from trainingrun.rollout.rewards import AnswerLog, RewardConfig, RewardSample, RewardScorer
from trainingrun.rollout.synthetic import EOS
from trainingrun.tracking import eval_tracker


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n completions of which c pass: 1 − C(n − c, k) / C(n, k) (the chance
    that k of the n drawn without replacement hold at least one that passes), in the stable product form."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k: needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def eval_seed(seed: int, what: int) -> int:
    """A seed of the evaluation's own: prompts (what = -1) or the sampling of weight version `what`."""
    return int(np.random.SeedSequence([seed, 0xE7A1, what + 1]).generate_state(1)[0])


class Evaluator:
    """Evaluates weight versions on the held-out prompts (see the module docstring)."""

    def __init__(self, spec, source: GenerateSource, arch: Architecture, *, store, out_dir: Path, metrics=None,
                 say: Callable[[str], None]):
        e = spec.rollout.eval
        g = spec.rollout.source.generate
        assert e is not None and g is not None
        self.spec, self.e, self.source, self.store, self.out_dir = spec, e, source, store, out_dir
        self.metrics, self.say = metrics, say
        self.interval = e.interval_rollouts
        text = e.prompts.type != "synthetic"
        self.tokenizer = source.tokenizer if source.tokenizer is not None or not text else load_tokenizer(arch)
        try:
            self.prompts = make_prompts(spec, arch, tokenizer=self.tokenizer, prompts=e.prompts,
                                        seed=eval_seed(spec.seed, -1))
        except ConfigError as exc:  # the prompt sources name the training's field
            raise ConfigError(str(exc).replace("rollout.source.generate.prompts", "rollout.eval.prompts")) from None
        if e.prompts == g.prompts:
            say("rollout: note: rollout.eval.prompts are the training prompts (not held out; synthetic ones are "
                "drawn from the evaluation's own seed)")
        self.sampling = e.sampling if e.sampling is not None else g.sampling
        if self.sampling.max_new_tokens >= arch.seq_length:
            raise ConfigError(f"rollout.eval.sampling.maxNewTokens: {self.sampling.max_new_tokens} leaves no room for "
                              f"a prompt within model seqLength {arch.seq_length}")
        eos = self.tokenizer.eos_id if self.tokenizer is not None else EOS
        self.stop_ids = tuple(sorted({eos, *self.sampling.stop_token_ids}))
        reward, place = (e.reward, "eval") if e.reward is not None else (g.reward, "reward")
        field = "rollout.eval.reward" if e.reward is not None else "rollout.source.generate.reward"
        dataset = getattr(self.prompts, "params", None)
        if reward.type == "reasoning_gym" and dataset is None:
            raise ConfigError(f"{field}.type: reasoning_gym scores reasoning-gym prompts only (rollout.eval.prompts "
                              "type reasoningGym)")
        self.reward = reward
        self.scorer = RewardScorer(RewardConfig.of(reward, dataset=dataset, place=place),
                                   timeout=reward.timeout_seconds, failed_reward=reward.failed_reward,
                                   workers=reward.workers)
        self.answers = (AnswerLog(out_dir / "judge", reward.judge.keep_answers, say) if reward.judge is not None
                        else None)
        self.tracker = None  # TensorBoard, opened with the first evaluation (it imports torch)

    # ---- the schedule
    def due(self, version: int, last: int, *, final: bool) -> bool:
        """Whether weight version `version` is to be evaluated now (`last`: the last one evaluated, −1 none)."""
        return version > last and (final or version % self.interval == 0)

    # ---- one evaluation
    def run(self, version: int, *, step: int, rollout: int) -> EvalRecord:
        """Evaluate weight version `version` (unless the store holds its record: a restarted rollout), store the
        record and write the outputs; the record."""
        records = read_evals(self.store)
        done = next((r for r in records if r.weight_version == version), None)
        if done is not None:
            self.say(f"rollout: evaluation of weight version {version} found in the store (done before a restart)")
            self.write_file(records)
            return done
        rec = self.evaluate(version, step=step, rollout=rollout)
        write_evals(self.store, [*records, rec])
        self.write_file([*records, rec])
        self.report(rec)
        return rec

    def evaluate(self, version: int, *, step: int, rollout: int) -> EvalRecord:
        self.source.ensure_weights(version, stats=GenerateStats())
        t0 = time.perf_counter()  # the evaluation's own time: generation and scoring (not the wait for the weights)
        prompts = self.prompts.draw(0, self.e.num_prompts) or []
        if not prompts:
            raise ConfigError("rollout.eval.prompts: no prompts to evaluate")
        k = self.e.samples_per_prompt
        s = self.sampling
        sampling = Sampling(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                            stop_token_ids=self.stop_ids, seed=eval_seed(self.spec.seed, version))
        engine = self.source.engine
        completions = engine.generate([p.tokens.tolist() for p in prompts], k, sampling)
        drop = getattr(engine, "drop_cache", None)
        if drop is not None:  # no training call may continue from the evaluation's keys and values
            drop()
        samples, lengths = [], []
        for prompt, comps in zip(prompts, completions):
            for c in comps:
                ctoks, _ = cut_at_stop(c.tokens, c.logprobs, self.tokenizer, s.stop)
                lengths.append(len(ctoks))
                samples.append(RewardSample.of(prompt, reward_response(ctoks, prompt, self.tokenizer, self.stop_ids,
                                                                       s.stop), ctoks))
        scored = self.scorer.score(samples)
        if self.answers is not None:
            self.answers.add(f"eval-v{version}", samples, scored)
        rewards = np.asarray(scored.rewards, np.float64).reshape(len(prompts), k)
        ok = np.asarray([f is None for f in scored.failed]).reshape(len(prompts), k)  # a failed reward never passes
        passed = ((rewards >= self.e.pass_threshold) & ok).sum(axis=1)
        failed = sum(f is not None for f in scored.failed)
        if failed:
            self.say(f"rollout: evaluation of weight version {version}: {failed} of {len(samples)} rewards failed "
                     f"({ {r: n for r, n in scored.counts().items() if n} }); e.g. " + "; ".join(scored.messages[:2]))
        if self.metrics is not None:
            self.metrics.observe_eval_failures(scored.counts())
        return EvalRecord(
            step=step, weight_version=version, rollout=rollout, reward_mean=float(rewards.mean()),
            pass_at_1=float(np.mean([pass_at_k(k, int(c), 1) for c in passed])),
            pass_at_k=float(np.mean([pass_at_k(k, int(c), k) for c in passed])), k=k, prompts=len(prompts),
            samples=len(samples), response_length_mean=float(np.mean(lengths)), rewards_failed=failed,
            seconds=time.perf_counter() - t0, time=time.time())

    # ---- outputs
    def write_file(self, records: list[EvalRecord]) -> None:
        """eval.jsonl in the output directory, rewritten whole from the stored records (atomically); a failure to
        write is reported and the run goes on (the records stay in the store)."""
        path = self.out_dir / EVAL_FILE
        tmp = path.with_name(f".{EVAL_FILE}.tmp")
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w") as fh:
                for r in sorted(records, key=lambda r: r.weight_version):
                    fh.write(json.dumps(r.to_json(), sort_keys=True) + "\n")
            tmp.replace(path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self.say(f"rollout: warning: cannot write {path}: {exc} (the evaluations are kept in the store, key eval)")

    def report(self, rec: EvalRecord) -> None:
        self.say(f"rollout: evaluation of weight version {rec.weight_version} (step {rec.step}): reward mean "
                 f"{rec.reward_mean:.3f}, pass@1 {rec.pass_at_1:.3f}, pass@{rec.k} {rec.pass_at_k:.3f} over "
                 f"{rec.prompts} prompts x {rec.k}, {rec.response_length_mean:.1f} tokens per completion, "
                 f"{rec.seconds:.2f}s")
        if self.metrics is not None:
            self.metrics.observe_eval(rec)
        if self.tracker is None:
            self.tracker = eval_tracker(self.spec.metrics, self.out_dir, warn=self.say)
        self.tracker.log({"step": rec.step, **{f"eval/{k}": v for k, v in rec.to_json().items()
                                               if k not in ("step", "time")}})

    def start(self) -> None:
        """A (re)started rollout: eval.jsonl as the store holds it (a write a crash cut short is made good)."""
        records = read_evals(self.store)
        if records or not (self.out_dir / EVAL_FILE).exists():
            self.write_file(records)

    def close(self) -> None:
        self.scorer.close()
        if self.tracker is not None:
            self.tracker.close()
