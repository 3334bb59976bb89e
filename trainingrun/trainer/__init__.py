"""trainingrun.trainer: the trainer program (`trainingrun trainer`): train exactly the published schedule.

Module map:
  main.py                 the command line: one rank, or the supervisor of a pod's G workers; exit codes
  workers.py              the torchrun-style supervisor of `gpusPerReplica` > 1 workers
  config.py               `TrainerEnv`: what a rank is told by its environment
  trainer.py              `Trainer`: build → resume → fit (train_rollout, sync_weights) → close
  model.py                Megatron-core set-up: process groups, GPT model, DDP, optimizer, samples-based LR schedule
  cpu_compat.py           the CPU shim that lets megatron-core run on a CPU-only torch
  attention.py            packed (THD) core attention over SDPA
  batch.py                packed micro-batches from a rank's payload and the schedule
  step.py                 one optimizer step over exactly the scheduled micro-batches
  loss.py                 the variable-global-batch loss and its normalisation
  report.py               the per-step record: metrics.jsonl, the progress record, Prometheus, the log line
  checkpoint.py           checkpoints on disk: commit, verification, fallback, keep-N, attempt fencing
  checkpoint_megatron.py  model and optimizer state through Megatron's distributed checkpointing
  full_state.py           a checkpoint → the full (tensor-parallel-gathered) state dict
  reshard.py              a rollout published for another data-parallel size, re-scheduled for this one
  weights.py              the weight-publisher seam towards the rollout's engine (`spec.weightSync`)

What it reads and writes across processes (published rollouts, resume point, progress record, environment):
`trainingrun.contract`. Its metrics: `trainingrun.metrics.exporter`.
"""
