"""trainingrun.rollout: the rollout program (`trainingrun rollout`): produce samples, filter, schedule, publish.

Module map:
  main.py             the command line: environment, store, metrics server, the loop, exit codes
  loop.py             `RolloutLoop`: one small stage per step of the data flow, resumable from its stored state
  source.py           the `Source` protocol (draw → generate → score) and the replay sources' common part
  synthetic.py        `source.type: synthetic`, a seeded learnable task (and the built-in tasks' token ids)
  jsonl.py            `source.type: jsonl`, a validated rollout file (and the jsonl line reader)
  generate.py         `source.type: generate`, the policy generates: engine (`trainingrun.engines`), pinned weight
                      version, rewards
  stream.py           the prompt stream of over-sampling and partial rollouts: which prompts a rollout asks for,
                      what an abort leaves behind
  episodes.py         multi-turn episodes, token in and token out, over an environment
  environments/       the environments of multi-turn episodes: the protocol, the built-ins, the worker pool (its own
                      map: `trainingrun/rollout/environments/__init__.py`)
  prompts.py          prompts of generated rollouts and the tokenizers that turn text into ids
  rewards.py          rewards of generated rollouts: a table of reward types scoring batches of samples (with their
                      prompts), isolated ones in workers so a bad one never stops the rollout
  reward_services.py  rewards served over HTTP (`remote`: a reward service; `judge`: an LLM judge): a bounded thread
                      pool, timeouts, retries with backoff, failures by reason, Secret headers from the environment
  evaluate.py         `rollout.eval`: periodic evaluation of the weights on held-out prompts between training
                      rollouts (pass@k), without changing the training; eval.jsonl
  agents.py           `generate.agent`: episodes of an agent program (a process per episode) or service, their
                      rewards and failures; over the gateway
  gateway.py          the OpenAI-compatible HTTP gateway agents call (/v1/chat/completions, /v1/models), by key
  sessions.py         an agent's episode at the gateway: chat requests → token ids, token in/token out (new segments
                      when the history was rewritten), the caps; the engine gate that batches its requests
  groups.py           `SampleGroup`, the samples of one prompt: the unit every stage passes on
  pipeline.py         the pure stages: filters, advantages (a table of estimators), steps, flat samples
  recovery.py         re-creating the stream after the store lost it (the trainers' resume point is ahead)

What it publishes, its stored state, the engine protocol and the resume point it reads are contracts:
`trainingrun.contract`. Its metrics: `trainingrun.metrics.rollout`.
"""
