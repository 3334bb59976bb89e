"""Metric names (contract: all start with `trainingrun_`). One place, so exporters, dashboards, alerts and docs agree.

Weighted metrics (per-sample values) travel as (sum, count) and are exported per rank as counters `X_sum` / `X_count`
so `sum(rate(X_sum[5m])) / sum(rate(X_count[5m]))` is the correct mean over any set of ranks. Rank 0 also exports
the reduced per-step values as gauges (TRAINER_GAUGES). Labels: `run` on every metric, `rank` on per-rank ones.
"""

from __future__ import annotations

PREFIX = "trainingrun_"

# --- trainer: weighted (sum, count) pairs, per rank, exported as the two counters f"{base}_sum" and f"{base}_count".
TRAINER_WEIGHTED = {
    "trainingrun_trainer_sample_loss": "Per-sample loss (mean over the sample's loss tokens); sum and count per rank.",
    "trainingrun_trainer_token_loss": "Per-token loss; sum over loss tokens and their count, per rank.",
    "trainingrun_trainer_sample_reward": "Per-sample reward (policy_gradient) or 0; sum and count per rank.",
    "trainingrun_trainer_sample_tokens": "Tokens per sample; sum and count per rank.",
    # generated rollouts: per trained token (ratio, clip, KL, entropy, |logprob diff|) or per sample (length)
    "trainingrun_trainer_logprob_abs_diff": "|generator logprob - trainer logprob| per trained token, before the "
                                            "update; sum and count per rank.",
    "trainingrun_trainer_importance_ratio": "Importance ratio pi/pi_old per trained token; sum and count per rank.",
    "trainingrun_trainer_clip_fraction": "Trained tokens whose ratio was clipped (1) or not (0); sum and count.",
    "trainingrun_trainer_dual_clip_fraction": "Trained tokens of a negative advantage whose term the dual clip capped "
                                              "at -A * clipRatioC (1) or not (0); sum and count.",
    "trainingrun_trainer_approx_kl": "KL(pi_old || pi) estimate (k3) per trained token; sum and count per rank.",
    "trainingrun_trainer_entropy": "Entropy of the policy at each trained token; sum and count per rank.",
    "trainingrun_trainer_response_length": "Trained (response) tokens per sample; sum and count per rank.",
    "trainingrun_trainer_mismatch_kl": "Train-inference mismatch KL(pi_engine || pi_trainer) estimate (k3) per "
                                       "trained token, before the update; sum and count per rank.",
    "trainingrun_trainer_correction_weight": "Rollout-correction weight (tis: min(rho, threshold); mask: 0 or 1) per "
                                             "trained token; sum and count per rank.",
    "trainingrun_trainer_masked_fraction": "Trained tokens the rollout correction masked (1) or kept (0); sum and "
                                           "count per rank.",
    "trainingrun_trainer_seq_clip_fraction": "ratioLevel sequence (GSPO): samples whose sequence ratio was clipped "
                                             "(1) or not (0); sum and count per rank.",
    "trainingrun_trainer_entropy_bonus": "Entropy bonus entropyCoef * entropy per trained token (subtracted from the "
                                         "loss); sum and count per rank.",
    # mixtures of experts: router statistics (trainer/moe.py)
    "trainingrun_trainer_moe_aux_loss": "Per-sample load-balancing loss of the routers (mean over MoE layers; 1 = "
                                        "balanced); sum and count per rank.",
    "trainingrun_trainer_moe_load_imbalance": "Per MoE layer: tokens of the busiest expert / mean tokens per expert "
                                              "over the step's tokens (1 = balanced); the step-wide pair on every rank.",
    "trainingrun_trainer_moe_tokens_per_expert": "Tokens routed to each expert of each MoE layer in the step; the "
                                                 "step-wide pair on every rank.",
}

# --- trainer: rank 0 gauges, reduced over all ranks for the last step.
TRAINER_GAUGES = {
    "trainingrun_trainer_loss": "Reduced loss of the last step (the contract's normalisation).",
    "trainingrun_trainer_global_batch_size": "Samples in the last step (all ranks).",
    "trainingrun_trainer_lr": "Learning rate used by the last step.",
    "trainingrun_trainer_grad_norm": "Gradient norm of the last step (before clipping).",
    "trainingrun_trainer_step_seconds": "Wall time of the last step.",
    "trainingrun_trainer_samples_per_second": "Samples per second of the last step (all ranks).",
    "trainingrun_trainer_tokens_per_second": "Tokens per second of the last step (all ranks).",
    "trainingrun_trainer_step": "Optimizer steps completed.",
    "trainingrun_trainer_samples_consumed": "Samples trained on so far.",
    "trainingrun_trainer_rollout": "Rollout being trained.",
    "trainingrun_trainer_num_microbatches": "Micro-batches per rank in the last step.",
    "trainingrun_trainer_reward_mean": "Mean reward of all samples generated for the last step's rollout.",
    "trainingrun_trainer_weight_version": "Weight version the last step's samples were generated with.",
    "trainingrun_trainer_policy_lag": "Rollouts between the trainer's weights and the generator's (last step).",
    "trainingrun_trainer_correction_weight_max": "Largest rollout-correction weight of the last step (all ranks).",
    "trainingrun_trainer_old_logprob_seconds": "Seconds of the forward-only pi_old pass of the last rollout "
                                               "(policyLoss.oldLogprobs trainer).",
    "trainingrun_trainer_weight_sync_seconds": "Seconds the last weight sync took on trainer rank 0 (gather, write "
                                               "or pack, commit).",
    "trainingrun_trainer_weight_sync_bytes": "Bytes the last weight sync published (the engine's dtype).",
    "trainingrun_trainer_weight_sync_gbps": "The last weight sync's rate, 1e9 bytes per second.",
    "trainingrun_trainer_weight_sync_pause_seconds": "Seconds the last rollout's engines generated nothing while "
                                                     "they loaded its weight version.",
}

# --- trainer: per-rank counters
TRAINER_COUNTERS = {
    "trainingrun_trainer_rank_tokens": "Tokens processed by this rank (counter; rate() is per-rank throughput).",
    "trainingrun_trainer_rank_samples": "Samples processed by this rank (counter).",
    "trainingrun_trainer_steps": "Optimizer steps run by this rank (counter).",
}

# --- rollout
ROLLOUT = {
    "trainingrun_rollout_samples_produced": "Samples produced by the source (counter).",
    "trainingrun_rollout_samples_filtered": "Samples dropped by filters (counter), label filter.",
    "trainingrun_rollout_samples_published": "Samples published to the store (counter).",
    "trainingrun_rollout_rollouts_published": "Rollouts published (counter).",
    "trainingrun_rollout_schedule_imbalance": "Max/mean rank token load of the last published step (gauge).",
    "trainingrun_rollout_publish_seconds": "Seconds to publish one rollout (histogram).",
    "trainingrun_rollout_pending": "Published rollouts not yet consumed (gauge).",
    "trainingrun_rollout_groups": "Groups (prompts) produced, kept by the filters and aborted by over-sampling "
                                   "(counter), label state: produced, kept, aborted.",
    # generated rollouts (rollout.source.type generate)
    "trainingrun_rollout_reward": "Reward of every generated sample before filtering (summary: _sum and _count).",
    "trainingrun_rollout_reward_failures": "Rewards that failed (counter), label reason: error, timeout, nan; rewards "
                                           "served over HTTP also http, unreachable, invalid.",
    "trainingrun_rollout_generated_tokens": "Tokens generated by the engine (counter).",
    "trainingrun_rollout_generate_seconds": "Seconds spent generating (counter).",
    "trainingrun_rollout_weight_wait_seconds": "Seconds spent waiting for the trainers' weights (counter).",
    "trainingrun_rollout_weight_version": "Weight version the last rollout was generated with (gauge).",
    "trainingrun_rollout_engine_weight_sync_seconds": "Seconds the engine's last weight load took (gauge), label "
                                                      "engine (engine-0, engine-1, ...: the vLLM pool's replicas).",
    "trainingrun_rollout_engine_prefix_cache_queries": "Prompt tokens the engine looked up in its prefix cache "
                                                       "(counter, from its own counters), label engine.",
    "trainingrun_rollout_engine_prefix_cache_hits": "Of those, tokens found in the engine's prefix cache (counter), "
                                                    "label engine; hit rate = rate(hits) / rate(queries).",
    "trainingrun_rollout_engine_inflight": "Mean requests the rollout kept in flight at the engine while generating "
                                           "the last rollout (gauge), label engine.",
    "trainingrun_rollout_engine_concurrency": "The engine's in-flight limit (gauge: engine.vllm.concurrency, or with "
                                              "auto the limit it adapted to), label engine.",
    # multi-turn episodes (rollout.source.generate.environment); their means are ROLLOUT_WEIGHTED below
    "trainingrun_rollout_truncated_episodes": "Episodes truncated by maxTurns or the token cap (counter).",
    "trainingrun_rollout_environment_failures": "Episodes whose environment failed (counter), label reason: error, "
                                                "timeout, invalid, oversized, exit, memory.",
    # agents through the gateway (rollout.source.generate.agent)
    "trainingrun_rollout_agent_failures": "Agent episodes that failed (counter), label reason: exit, timeout, "
                                          "no_reward, invalid, limit, engine, error.",
    "trainingrun_rollout_gateway_request_seconds": "Seconds from a chat request's arrival at the gateway to its answer "
                                                   "(histogram).",
    "trainingrun_rollout_gateway_unauthorized": "Gateway requests refused with 401: a key of no running episode "
                                                "(counter).",
}

# --- rollout: weighted (sum, count) pairs of multi-turn episodes, as the two counters f"{base}_sum" / f"{base}_count"
ROLLOUT_WEIGHTED = {
    "trainingrun_rollout_turns_per_episode": "Model turns per episode; sum over episodes and their count.",
    "trainingrun_rollout_tool_calls_per_episode": "Tool calls per episode; sum over episodes and their count.",
    "trainingrun_rollout_tool_error_rate": "Tool calls answered with an error (1) or not (0); sum and count of calls.",
    "trainingrun_rollout_truncated_rate": "Episodes truncated (1) or not (0); sum and count of episodes.",
    "trainingrun_rollout_env_failure_rate": "Episodes whose environment failed (1) or not (0); sum and count.",
    "trainingrun_rollout_response_tokens_per_turn": "Tokens per model turn; sum over turns and their count.",
    "trainingrun_rollout_agent_failure_rate": "Agent episodes that failed (1) or not (0); sum and count of episodes.",
    "trainingrun_rollout_rewrites_per_episode": "Token sequences an agent's episode started by rewriting its history "
                                                "(segments beyond the first); sum over episodes and their count.",
}

# --- evaluation on held-out prompts (rollout.eval), exported by the rollout process
EVAL = {
    "trainingrun_eval_reward_mean": "Mean reward of the last evaluation (all its completions; gauge).",
    "trainingrun_eval_pass_at_1": "Unbiased pass@1 of the last evaluation (gauge).",
    "trainingrun_eval_pass_at_k": "Unbiased pass@k of the last evaluation, k = samplesPerPrompt (gauge).",
    "trainingrun_eval_response_length_mean": "Completion tokens per completion in the last evaluation (gauge).",
    "trainingrun_eval_weight_version": "Weight version of the last evaluation (gauge).",
    "trainingrun_eval_step": "Optimizer steps trained into the weights of the last evaluation (gauge).",
    "trainingrun_eval_seconds": "Wall time of the last evaluation (gauge).",
    "trainingrun_eval_evaluations": "Evaluations run (counter).",
    "trainingrun_eval_reward_failures": "Evaluation rewards that failed (counter), label reason.",
}

# --- operator
OPERATOR = {
    "trainingrun_operator_reconcile_seconds": "Handler duration (histogram), label handler.",
    "trainingrun_operator_runs": "TrainingRuns by phase (gauge), label phase.",
    "trainingrun_operator_restarts": "Group restarts performed (counter).",
    "trainingrun_operator_errors": "Handler errors (counter), label handler.",
    # per run (kube-state-metrics style), labels namespace + run; removed when the run is deleted
    "trainingrun_operator_run_phase": "1 for the run's current phase, 0 for the other phases (gauge), labels "
                                      "namespace, run, phase.",
    "trainingrun_operator_run_restarts": "The run's status.restarts: group restarts so far (gauge), labels "
                                         "namespace, run.",
    "trainingrun_operator_run_step": "The run's status.step: optimizer steps as the operator last read them from the "
                                     "store, 0 before the first progress (gauge), labels namespace, run.",
    "trainingrun_operator_run_progress_percent": "The run's status.progress.percentage: rollouts trained in percent "
                                                 "of rollout.numRollouts (gauge), labels namespace, run; absent before "
                                                 "the first progress.",
    "trainingrun_operator_run_eta_seconds": "The run's status.progress.estimatedRemainingSeconds (gauge), labels "
                                            "namespace, run; absent while the pace is not known.",
    "trainingrun_operator_run_engine_replicas": "The run's status.engineReplicas: the engine pool's size as it runs "
                                                "(gauge), labels namespace, run; absent for a run without engines "
                                                "of its own.",
}

# Common labels: run (TrainingRun name), rank (trainers), role.
