"""The TrainingRun spec by section, one module each; `trainingrun.api.models` joins them into `TrainingRunSpec`.

Module map:
  base.py      `ApiModel` (the base of every model), `Rule` (one CEL rule), the bounds of every number, shared types
  model.py     `spec.model` (`ModelSpec`, `MoESpec`)
  trainer.py   `spec.trainer` (parallelism, micro-batching, loss, advantages, optimizer, checkpoints, performance)
  rollout.py   `spec.rollout` (sources, generated rollouts: prompts, sampling, reward, environments; filters, steps)
  engine.py    `spec.rollout.engine` and `spec.weightSync` (the inference engine and how weights reach it)
  services.py  `spec.store`, `spec.metrics` (the shared store, Prometheus, experiment tracking)
  cluster.py   `spec.failurePolicy`, `spec.podTemplate`, `spec.gangScheduling`, `spec.placement`

Each model's cross-field rules are its `CEL_RULES`, beside its fields, with their Python twin in its validator.
"""
