"""The process environment: the `TRAININGRUN_*` variables a process of a run is started with, as one typed value.

The plan (`trainingrun.plan`) writes them for every process, the operator into pods and the local launcher into
child processes, with `ProcessEnv(...).to_env()`; the rollout, the trainer, its worker supervisor, the tracking
writers and the child log read them with `ProcessEnv.from_environ()`. Nobody else spells a variable's name.

  TRAININGRUN_RUN             run           the run's name                                        (contract)
  TRAININGRUN_STORE_URL       store_url     file:///... or redis://...                            (contract)
  TRAININGRUN_CONFIG          config        path of the TrainingRun YAML (a ConfigMap mount in a cluster)
  TRAININGRUN_CONFIG_SHA256   config_sha256 SHA-256 (hex) of that file as the local launcher validated it: a child
                                            whose file has exactly this digest skips the CRD schema, CEL rules and
                                            memory plan the launcher ran, keeping the strict models
                                            (`trainingrun.api.manifest.load_file`)
  TRAININGRUN_ATTEMPT         attempt       restart attempt of the group (0, 1, ...)
  TRAININGRUN_ROLE_ATTEMPT    role_attempt  the rollout's generation within its role: one more each time it was
                                            restarted alone (the store's writer claim orders writers by both)
  TRAININGRUN_RUN_EPOCH       run_epoch     the run's creation time, unix seconds (unset: unknown, e.g. local runs)
  TRAININGRUN_METRICS_PORT    metrics_port  port of this process's /metrics (a trainer's workers: + local rank)
  TRAININGRUN_METRICS_JSONL   metrics_jsonl trainer rank 0 appends one JSON object per step here (local runs)
  TRAININGRUN_OUTPUT_DIR      output_dir    where TensorBoard / W&B files go (local runs: the run directory)
  TRAININGRUN_ENGINE_URL      engine_url    the run's own vLLM server (set by the launcher / operator)
  TRAININGRUN_ENGINE_URL_FILE engine_url_file  a file holding the pool's current URLs, one a line (a cluster: the
                                            run's ConfigMap, updated when spec.rollout.engine.replicas changes)
  TRAININGRUN_ENGINE_URL_APPLIED_FILE engine_url_applied_file  where the rollout writes the list of URLs its pool
                                            took on from engine_url_file (local runs: the launcher stops a server
                                            removed by `trainingrun scale` once it is left out there)
  TRAININGRUN_NODE_RANK       node_rank     a trainer worker: its pod's RANK (the node rank)
  TRAININGRUN_NUM_NODES       num_nodes     a trainer worker: its pod's WORLD_SIZE (the node count)
  TRAININGRUN_LOG_TIMESTAMPS  log_timestamps  "1": every line of stdout/stderr starts with the time

An unset or empty variable is None (`log_timestamps`: False). A number that is not a plain decimal integer >= 0 is a
ConfigError naming the variable (exit 78). `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` are torch.distributed's
and stay plain variables. Knobs of the test and development set-up (`TRAININGRUN_CHILD_COMMAND`,
`TRAININGRUN_VLLM_PYTHON`) are not part of a process's contract and are read where they are used.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from trainingrun.contract.errors import ConfigError

RUN_ENV = "TRAININGRUN_RUN"
STORE_URL_ENV = "TRAININGRUN_STORE_URL"
CONFIG_ENV = "TRAININGRUN_CONFIG"
CONFIG_SHA256_ENV = "TRAININGRUN_CONFIG_SHA256"
ATTEMPT_ENV = "TRAININGRUN_ATTEMPT"
ROLE_ATTEMPT_ENV = "TRAININGRUN_ROLE_ATTEMPT"
RUN_EPOCH_ENV = "TRAININGRUN_RUN_EPOCH"
METRICS_PORT_ENV = "TRAININGRUN_METRICS_PORT"
METRICS_JSONL_ENV = "TRAININGRUN_METRICS_JSONL"
OUTPUT_DIR_ENV = "TRAININGRUN_OUTPUT_DIR"
ENGINE_URL_ENV = "TRAININGRUN_ENGINE_URL"
ENGINE_URL_FILE_ENV = "TRAININGRUN_ENGINE_URL_FILE"
ENGINE_URL_APPLIED_FILE_ENV = "TRAININGRUN_ENGINE_URL_APPLIED_FILE"
NODE_RANK_ENV = "TRAININGRUN_NODE_RANK"
NUM_NODES_ENV = "TRAININGRUN_NUM_NODES"
LOG_TIMESTAMPS_ENV = "TRAININGRUN_LOG_TIMESTAMPS"


def _var(name: str, kind: type = str):
    return dataclasses.field(default=None, metadata={"env": name, "kind": kind})


@dataclass(frozen=True)
class ProcessEnv:
    """The `TRAININGRUN_*` variables of one process (see the module docstring); None: not set."""

    run: str | None = _var(RUN_ENV)
    store_url: str | None = _var(STORE_URL_ENV)
    config: str | None = _var(CONFIG_ENV)
    config_sha256: str | None = _var(CONFIG_SHA256_ENV)
    attempt: int | None = _var(ATTEMPT_ENV, int)
    role_attempt: int | None = _var(ROLE_ATTEMPT_ENV, int)
    run_epoch: int | None = _var(RUN_EPOCH_ENV, int)
    metrics_port: int | None = _var(METRICS_PORT_ENV, int)
    metrics_jsonl: str | None = _var(METRICS_JSONL_ENV)
    output_dir: str | None = _var(OUTPUT_DIR_ENV)
    engine_url: str | None = _var(ENGINE_URL_ENV)
    engine_url_file: str | None = _var(ENGINE_URL_FILE_ENV)
    engine_url_applied_file: str | None = _var(ENGINE_URL_APPLIED_FILE_ENV)
    node_rank: int | None = _var(NODE_RANK_ENV, int)
    num_nodes: int | None = _var(NUM_NODES_ENV, int)
    log_timestamps: bool = dataclasses.field(default=False, metadata={"env": LOG_TIMESTAMPS_ENV, "kind": bool})

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), f.metadata["kind"]
            if kind is bool:
                ok = isinstance(value, bool)
            elif value is None:
                ok = True
            elif kind is int:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            else:
                ok = isinstance(value, str) and value != "" and "\0" not in value
            if not ok:
                allowed = {bool: "True or False", int: "None or an integer >= 0",
                           str: "None or a non-empty string without NUL"}[kind]
                raise ConfigError(f"{f.metadata['env']} ({f.name}): {value!r:.80} is not allowed; allowed: {allowed}")

    def to_env(self) -> dict[str, str]:
        """The variables that are set, as a process environment (`log_timestamps`: "1" when True)."""
        out: dict[str, str] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata["kind"] is bool:
                if value:
                    out[f.metadata["env"]] = "1"
            elif value is not None:
                out[f.metadata["env"]] = str(value)
        return out

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> ProcessEnv:
        """This process's values (`environ`: default os.environ); ConfigError naming the variable when a number is
        not a decimal integer >= 0."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            name, kind = f.metadata["env"], f.metadata["kind"]
            raw = env.get(name)
            if kind is bool:
                values[f.name] = raw == "1"
            elif not raw:
                values[f.name] = None
            elif kind is int:
                if not (raw.isascii() and raw.isdigit()):
                    raise ConfigError(f"environment: {name}={raw!r:.80} is not a decimal integer >= 0")
                values[f.name] = int(raw)
            else:
                values[f.name] = raw
        return cls(**values)  # type: ignore[arg-type]
