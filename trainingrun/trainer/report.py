"""What a trainer rank reports after each step: the per-step record and where it goes.

The record (rank 0's dict, docs/trainer.md "JSONL record") is the one source for `metrics.jsonl`, the trainers'
progress record in the store (`trainingrun.contract.progress.ProgressRecord`), the log line and the exported gauges;
every rank exports its own (sum, count) pairs and counters.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from trainingrun.contract.progress import ProgressRecord
from trainingrun.trainer.loss import STAT_NAMES


RL_MEANS = ("logprob_abs_diff", "importance_ratio", "clip_fraction", "dual_clip_fraction", "approx_kl", "entropy",
            "kl_ref", "response_length", "mismatch_kl", "correction_weight", "masked_fraction", "seq_clip_fraction",
            "entropy_bonus", "correction_weight_max")
# exported per rank as (sum, count) counters; kl_ref and the maximum are not (the maximum is rank 0's gauge)
RL_WEIGHTED = tuple(name for name in RL_MEANS if name not in ("kl_ref", "correction_weight_max"))


def sync_record(seconds: float, nbytes: int) -> dict[str, Any]:
    """The weight sync's fields of the step after it (issue 28 item 7; 0 where nothing was synced): its seconds on
    this rank (the gather, the writing or packing, the commit), the bytes published in the engine's dtype (rank 0)
    and their rate in GB/s (10⁹ bytes per second)."""
    return {"weight_sync_seconds": seconds, "weight_sync_bytes": nbytes,
            "weight_sync_gbps": nbytes / seconds / 1e9 if seconds > 0 and nbytes > 0 else 0.0}


def step_record(*, res, step, rollout: int, global_step: int, samples_consumed: int, scheduler_consumed: int,
                attempt: int, dp_size: int, published=None) -> dict[str, Any]:
    """The record of one trained step (`res`: step.StepResult, `step`: published.StepPlan). Generated rollouts add
    reward_mean/reward_std (all samples generated for the rollout, before filtering), weight_version, policy_lag
    (rollouts between the trainer's weights and the generator's: this rollout's index − the version of the step's
    oldest trained token) and policy_lag_mean (the same over every trained token: partial rollouts mix versions), the
    per-token policy statistics (RL_MEANS, token-weighted over the step's trained tokens, before the update; the
    correction's maximum weight over the step; GSPO's clipped-sequence fraction per sample), the
    trained samples' reward_std, and the rollout's produced/kept/filtered/aborted groups and failed rewards (in all and
    by reason: `rewards_failed_by_reason`, the reasons that occurred); with an environment also the rollout's episode
    statistics (`contract.published.EpisodeCounts.record`); with an engine pool the rollout's prefix-cache hit rate
    and, by engine, its hit rate, requests in flight and in-flight limit (`contract.published.SourceStats.engine_record`)."""
    gbs = step.global_batch_size
    record = {
        "step": global_step, "rollout": rollout, "step_in_rollout": step.index,
        "global_batch_size": gbs, "num_microbatches": step.num_microbatches,
        "loss": res.loss, "lr": res.lr, "grad_norm": res.grad_norm,
        "samples_consumed": samples_consumed, "tokens": res.tokens,
        "loss_tokens": step.loss_tokens,
        "sample_loss": res.mean("sample_loss"), "token_loss": res.mean("token_loss"),
        "reward": res.mean("sample_reward"),
        "attempt": attempt, "step_seconds": res.seconds,
        "samples_per_second": gbs / res.seconds if res.seconds > 0 else 0.0,
        "tokens_per_second": res.tokens / res.seconds if res.seconds > 0 else 0.0,
        "scheduler_consumed_samples": scheduler_consumed,
        "samples_trained": res.samples, "sample_id_sum": res.sample_id_sum,
        "dp_size": dp_size, "time": time.time(),
        "loss_scale": res.loss_scale, "skipped_step": int(res.skipped),
    }
    if res.moe is not None:  # mixtures of experts: the step's router statistics
        record.update({k: v for k, v in res.moe.items() if k != "weighted"})
    if step.weight_version >= 0:
        st = published.stats if published is not None else None
        mean, sq = res.mean("sample_reward"), res.mean("sample_reward_sq")
        record.update({
            "reward_mean": st.reward_mean if st is not None else 0.0,
            "reward_std": st.reward_std if st is not None else 0.0,
            "weight_version": step.weight_version,
            "policy_lag": rollout - step.weight_version,  # the step's oldest trained token
            "policy_lag_mean": (step.policy_lag_mean if step.policy_lag_mean is not None
                                else float(rollout - step.weight_version)),
            **{name: res.mean(name) for name in RL_MEANS},
            "trained_reward_std": max(sq - mean * mean, 0.0) ** 0.5,
            "groups_produced": st.groups_produced if st is not None else 0,
            "groups_kept": st.groups_kept if st is not None else 0,
            "groups_filtered": st.groups_produced - st.groups_kept if st is not None else 0,
            "groups_aborted": st.groups_aborted if st is not None else 0,
            "rewards_failed": st.reward_failed if st is not None else 0,
            "rewards_failed_by_reason": dict(st.reward_failures) if st is not None else {},
            # the rollout's load of its weight version into the engine(s): nothing was generated meanwhile
            "weight_sync_pause_seconds": st.sync_pause_seconds if st is not None else 0.0,
            # multi-turn episodes: turns_per_episode, tool calls, environment failures, ... (EpisodeCounts.record)
            **(st.episodes.record() if st is not None and st.episodes is not None else {}),
            # the engine pool: prefix_hit_rate, and by engine its hit rate, requests in flight and limit
            **(st.engine_record() if st is not None else {}),
        })
    return record


# logprob_abs_diff expected of an engine that holds the trainer's weights (docs/vllm.md, "Logprobs and tolerance"):
# fp32 engines ~1e-6; bf16 ~0.04 nats on the tiny test model. A same-size-corrupted version gave 2.71.
LOGPROB_TOLERANCE = {"float32": 0.01, "bfloat16": 0.3, "float16": 0.3}


def engine_logprob_mismatch(record: dict[str, Any], tolerance: float) -> str | None:
    """The message when an on-policy step (policy_lag 0, its first step in the rollout: the trainer has not updated
    yet) shows that the engine did not generate with the trainer's weights: logprob_abs_diff above `tolerance`."""
    if "logprob_abs_diff" not in record or record.get("policy_lag") != 0 or record.get("step_in_rollout") != 0:
        return None
    diff = float(record["logprob_abs_diff"])
    if diff <= tolerance:
        return None
    return (f"rollout {record['rollout']}: logprob_abs_diff {diff:.3g} (engine vs trainer on weight version "
            f"{record['weight_version']}) is above weightSync.logprobTolerance {tolerance:g}: the engine does not hold "
            "the trainer's weights (a damaged or changed weight version, or a sync that did not apply)")


class StepReporter:
    """Exports every rank's metrics; on rank 0 also writes the JSONL line, the progress record and a log line."""

    def __init__(self, exporter, store, *, rank: int, jsonl_path: str | None, tracker=None):
        self.exporter = exporter
        self.store = store
        self.rank = rank
        self.jsonl_path = jsonl_path
        self.tracker = tracker  # rank 0: trainingrun.tracking.Tracker (TensorBoard / W&B), set after resume

    def report(self, res, record: dict[str, Any]) -> None:
        self.export(res, record)
        if self.rank == 0:
            self.write(record)

    def export(self, res, record: dict[str, Any]) -> None:
        exporter = self.exporter
        local = {name: tuple(res.local_stats[i].tolist()) for i, name in enumerate(STAT_NAMES)}
        exporter.add_weighted({
            "trainingrun_trainer_sample_loss": local["sample_loss"],
            "trainingrun_trainer_token_loss": local["token_loss"],
            "trainingrun_trainer_sample_reward": local["sample_reward"],
            "trainingrun_trainer_sample_tokens": local["sample_tokens"],
            **{f"trainingrun_trainer_{name}": local[name] for name in RL_WEIGHTED},
            **({f"trainingrun_trainer_{name}": pair for name, pair in res.moe["weighted"].items()}
               if res.moe is not None else {}),
        })
        exporter.inc("trainingrun_trainer_rank_tokens", res.local_tokens)
        exporter.inc("trainingrun_trainer_rank_samples", res.local_samples)
        exporter.inc("trainingrun_trainer_steps", 1)
        exporter.set_gauges({
            "trainingrun_trainer_loss": record["loss"],
            "trainingrun_trainer_global_batch_size": record["global_batch_size"],
            "trainingrun_trainer_lr": record["lr"],
            "trainingrun_trainer_grad_norm": record["grad_norm"],
            "trainingrun_trainer_step_seconds": record["step_seconds"],
            "trainingrun_trainer_samples_per_second": record["samples_per_second"],
            "trainingrun_trainer_tokens_per_second": record["tokens_per_second"],
            "trainingrun_trainer_step": record["step"],
            "trainingrun_trainer_samples_consumed": record["samples_consumed"],
            "trainingrun_trainer_rollout": record["rollout"],
            "trainingrun_trainer_num_microbatches": record["num_microbatches"],
            **({"trainingrun_trainer_reward_mean": record["reward_mean"],
                "trainingrun_trainer_weight_version": record["weight_version"],
                "trainingrun_trainer_policy_lag": record["policy_lag"],
                "trainingrun_trainer_correction_weight_max": record["correction_weight_max"]}
               if "weight_version" in record else {}),
            **({"trainingrun_trainer_old_logprob_seconds": record["old_logprob_seconds"]}
               if record.get("old_logprob_seconds", 0) > 0 else {}),  # a rollout's first step
            **({"trainingrun_trainer_weight_sync_seconds": record["weight_sync_seconds"],
                "trainingrun_trainer_weight_sync_bytes": record["weight_sync_bytes"],
                "trainingrun_trainer_weight_sync_gbps": record["weight_sync_gbps"]}
               if record.get("weight_sync_bytes", 0) > 0 else {}),  # the step after a sync
            **({"trainingrun_trainer_weight_sync_pause_seconds": record["weight_sync_pause_seconds"]}
               if record.get("step_in_rollout") == 0 and "weight_sync_pause_seconds" in record else {}),
        })

    def write(self, record: dict[str, Any]) -> None:
        """Rank 0: one JSON line per step (local runs, merged by the launcher) and the progress record (read by the
        operator)."""
        if self.jsonl_path:
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.tracker is not None:
            self.tracker.log(record)
        ProgressRecord(step=record["step"], time=record["time"], rollout=record["rollout"],
                       samples_consumed=record["samples_consumed"], last_global_batch_size=record["global_batch_size"],
                       attempt=record["attempt"], loss=record["loss"], lr=record["lr"], tokens=record["tokens"],
                       samples_per_second=record["samples_per_second"]).write(self.store)
        rl = (f" reward {record['reward_mean']:.3f} v{record['weight_version']} lag {record['policy_lag']} "
              f"|dlogp| {record['logprob_abs_diff']:.1e}" if "weight_version" in record else "")
        print(
            f"[trainer 0] step {record['step']} rollout {record['rollout']} gbs {record['global_batch_size']} "
            f"mb {record['num_microbatches']} loss {record['loss']:.4f} lr {record['lr']:.2e} "
            f"gnorm {record['grad_norm']:.3f} {record['samples_per_second']:.1f} samples/s{rl}",
            file=sys.stderr, flush=True,
        )
