"""trainingrun.metrics: metric names and the Prometheus exporters of the run's processes.

Module map:
  names.py     every metric name and its help text (contract: all start with `trainingrun_`)
  reduce.py    (sum, count) reduction of weighted metrics (a torch-free core, one all-reduce on the trainers)
  exporter.py  a trainer rank's exporter (`TrainerExporter`)
  rollout.py   the rollout process's metrics (`RolloutMetrics`)
"""
