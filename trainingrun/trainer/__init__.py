"""trainingrun.trainer: the trainer program (`trainingrun trainer`): train exactly the published schedule.

Module map:
  main.py                 the command line: one rank, or the supervisor of a pod's G workers; exit codes
  workers.py              the torchrun-style supervisor of `gpusPerReplica` > 1 workers
  config.py               `TrainerEnv`: what a rank is told by its environment
  trainer.py              `Trainer`: build → resume → fit (train_rollout, sync_weights) → close
  optim.py                Megatron DDP, the optimizer and the LR schedule counted in samples; the performance
                          options checked for the device (the model itself: `trainingrun.modeling.model`)
  batch.py                packed micro-batches from a rank's payload and the schedule
  moe.py                  mixture-of-experts training per step: EP padding, balance-loss weights, routing replay,
                          router statistics (the hooks themselves: `trainingrun.modeling.moe`)
  step.py                 one optimizer step over exactly the scheduled micro-batches
  loss.py                 the variable-global-batch loss and its normalisation (a table of loss types)
  report.py               the per-step record: metrics.jsonl, the progress record, Prometheus, the log line
  checkpoint.py           checkpoints on disk: commit, verification, fallback, keep-N, attempt fencing
  checkpoint_megatron.py  model and optimizer state through Megatron's distributed checkpointing
  rng.py                  each rank's RNG streams in a checkpoint (exact resume with dropout)
  full_state.py           a checkpoint → the full (tensor-parallel-gathered) state dict
  reshard.py              a rollout published for another data-parallel size, re-scheduled for this one
  weights.py              the weight-publisher seam towards the rollout's engine (`spec.weightSync`; the
                          publishers are the engine table's, `trainingrun.engines`)
  export_hf.py            `trainingrun export-hf`: a checkpoint as a Hugging Face model directory
  score_cli.py            `trainingrun score`: per-token log-probabilities of token lines under a model or checkpoint

The model layer it builds on (architectures, Megatron model building, attention, the CPU shim, HF conversion):
`trainingrun.modeling`.

What it reads and writes across processes (published rollouts, resume point, progress record, environment):
`trainingrun.contract`. Its metrics: `trainingrun.metrics.exporter`.
"""
