"""trainingrun.contract: every contract between the run's processes, typed, in one room at the bottom.

Both sides of each contract import it from here; neither owns it. Imports only the standard library, numpy and
`trainingrun.schedule` (no store, no API, no program), so every process can use it.

Module map:
  published.py      the rollout → trainer contract: `PublishedRollout` (schedule, GBS_s, T_s, offsets, source stats) and
                    `StepPlan`, built (`build_published`, `rank_payload`), published and read through a `RolloutChannel`
  fields.py         the one table of a sample's fields (`FIELDS`: dtype, per token / per sample, padding, stage) and
                    `SampleArrays`, from which groups, samples, payloads, wire fields and micro-batches derive
  payload.py        `RankPayload`: the arrays of one rank's part of a published rollout (derived from fields.py)
  engine.py         the inference engine protocol the rollout generates with: `Engine`, `Sampling`, `Completion`
  resume.py         the trainers' resume point (`ResumePoint`, key `trainer_resume`): trainer rank 0 writes, the rollout
                    reads it to re-create a stream the store lost
  progress.py       the trainers' progress record (`ProgressRecord`, key `progress`): trainer rank 0 writes, the operator
                    reads it into the TrainingRun's status
  rollout_state.py  the rollout's state record (`RolloutStateRecord`, key `rollout_state`): the rollout writes it and
                    reads it back on restart; the local launcher reads its `DataAccount` into summary.json
  evaluation.py     the evaluations of `rollout.eval` (`EvalRecord`, key `eval`, eval.jsonl): the rollout writes them and
                    reads them back on restart; `trainingrun status` and `plot` read eval.jsonl
  env.py            the process environment (`ProcessEnv`): the `TRAININGRUN_*` variables the plan writes and every
                    process reads
  errors.py         `ConfigError` and its exit status `EXIT_CONFIG_ERROR` (78); `StoreError`, `CorruptPayload`
  records.py        the key/value view of a store the small records need, and their field readers
"""
