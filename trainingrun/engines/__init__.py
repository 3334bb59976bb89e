"""trainingrun.engines: the inference engines a `generate` rollout samples from, chosen by one table.

Layer 3, beside rollout, trainer and operator: they import engines, never the reverse. The rollout gets its
`contract.engine.Engine` here, the trainers their weight publisher, the operator its engine pods, the local launcher
its engine processes — each through the table.

Module map:
  table.py        the engine table: `rollout.engine.type` → `EngineType` (builder, weight-sync publishers, the
                  servers' pods and local processes, logprob dtype); the rules over it: `make_engine`,
                  `make_publisher`, `own_servers` ("the run owns its engines"), `register`
  pool.py         the engine pool, engine-agnostic: recovery, the version barrier, the weight-load fan-out, over a
                  `ReplicaAdapter` per server (imports no engine's code)
  dispatch.py     one generate call of the pool: dispatch within each replica's limit, sticky routing by affinity,
                  the per-request ledger, stalls, deaths, abort
  concurrency.py  `AdaptiveLimit`: a replica's in-flight limit from the engine's own signals (`concurrency: auto`)
  replica.py      one server as the pool sees it: the `ReplicaAdapter` protocol, `EngineSignals`, the `Replica` record
  megatron.py     `engine.type: megatron`: generation in the rollout process with the run's Megatron model
  store_sync.py   `weightSync.type: store` (the megatron entry's publisher): the weights through the run's store, in
                  parts each tensor/expert-parallel owner writes (streamed), read back whole by the engine
  simulated.py    a stand-in vLLM server (the same HTTP API and metrics, no model: a KV cache, a prefix cache,
                  injectable engine errors) for tests and benchmarks
  vllm/           `engine.type: vllm`: server, client, the replica adapter, weight sync, worker extension, publishers,
                  engine pods (its own map: `trainingrun/engines/vllm/__init__.py`)

A new engine type: docs/architecture.md, "A new engine type".

This file and `vllm/__init__.py` import nothing: the vLLM server process loads the worker extension
(`trainingrun.engines.vllm.worker_ext`) through them, in an environment without trainingrun's dependencies.
"""
