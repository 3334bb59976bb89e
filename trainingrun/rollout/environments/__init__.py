"""Environments of multi-turn episodes (`rollout.source.generate.environment`; docs/rl.md, "Multi-turn").

Module map:
  base.py        the protocol (`reset(prompt) -> observation`, `step(turn) -> (observation, reward, done[, info])`),
                 the checks every answer passes (`StepResult`, `InvalidResult`), the built-ins by name, `module:Class`
  calculator.py  `type: calculator`: <calc>EXPR</calc> tool calls, the final answer scored against the reference
  reasoning.py   `type: reasoningGym`: a reasoning-gym task answered again after feedback, up to `attempts` times
  pool.py        `EnvironmentPool`: the environments in worker processes, per-call timeouts, memory and size limits

The episodes themselves (turns, tokens, masks, samples) are `trainingrun.rollout.episodes`.
"""
