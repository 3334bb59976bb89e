"""`rollout.engine.type: vllm`: a pool of vLLM servers — the server, its HTTP client, the pool's replica adapter,
weight sync (disk / broadcast), the trainers' publishers and the engine pods. Its entry in the engine table:
`trainingrun.engines.table`.

Module map:
  server.py      how a vLLM OpenAI server is started (command, environment, worker extension files), a small
                 process wrapper for local runs, tests and benchmarks, and the launcher's local server
                 (`local_server`)
  multinode.py   a multi-node replica on this machine (engine.vllm.nodes > 1 in a local run: a leader and headless
                 workers, one process each) and `local_replica`, the launcher's local server of the engine table
  client.py      the HTTP client (stdlib only; its errors the contract's): /v1/completions with token ids and
                 logprobs, /health, and the development endpoints used for weight updates (pause, collective_rpc,
                 reset_prefix_cache, resume)
  engine.py      `VLLMReplica`, the engine pool's adapter for one server (`trainingrun.engines.pool`), `VLLMEngine`
                 the pool over vLLM servers, and `build`, the table's builder
  sync.py        loading a weight version into a running server: from an HF directory (`disk`) or trainer rank 0
                 (`broadcast`), never half-applied
  worker_ext.py  runs INSIDE the vLLM server (its own virtual environment / image): receives broadcast weights.
                 Imports only the standard library and torch; keep it that way.
  broadcast.py   the trainer side of the broadcast weight sync (torch.distributed, gloo on CPU / NCCL on GPU):
                 rank 0's `BroadcastSender`, the other owner ranks' `ShardServer` (snapshots sharded in host
                 memory), one transfer per pool sync
  tp_slice.py    which slice of each HF tensor a worker of a tensor-parallel engine needs (the broadcast sends it
                 only that), the table and its fallback (whole)
  publish.py     the trainer-side publishers (`disk`: an HF directory written atomically; `broadcast`), committed
                 through the store's fencing
  k8s.py         the engine pod's container, its worker-extension ConfigMap and the URL the rollout is given

This package imports nothing heavy at import time: `trainingrun/__init__.py`, `trainingrun/engines/__init__.py` and
this file are also loaded by the vLLM server process (for the worker extension), whose environment does not have
trainingrun's dependencies.
"""
