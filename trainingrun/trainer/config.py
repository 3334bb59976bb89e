"""What a trainer rank is told: its environment (`TrainerEnv`) and the error a restart cannot fix (`ConfigError`).

No torch or megatron here: the entrypoint reads this before it decides on a device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


class ConfigError(Exception):
    """A configuration problem a restart cannot fix (the trainer exits 78)."""


def env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"environment: {name} is not set (needed by every trainer rank)")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment: {name}={raw!r} is not an integer") from None


def _epoch() -> int:
    epoch = env_int("TRAININGRUN_RUN_EPOCH", 0)
    if epoch < 0:
        raise ConfigError(f"environment: TRAININGRUN_RUN_EPOCH={epoch} must be >= 0 (unix seconds of the run's creation)")
    return epoch


@dataclass(frozen=True)
class TrainerEnv:
    """One rank's view of the plan (trainingrun/plan.py): ranks, attempt, config, store and outputs."""

    rank: int
    world_size: int
    attempt: int
    config_path: str
    store_url: str
    run_name: str | None  # TRAININGRUN_RUN (default: the manifest's metadata.name)
    metrics_port: int | None
    metrics_jsonl: str | None  # rank 0 appends one JSON object per step here
    wait_timeout: float | None  # give up after waiting this long for one rollout
    epoch: int = 0  # TRAININGRUN_RUN_EPOCH: the run's creation time; orders attempts of re-created runs

    @classmethod
    def from_environ(cls, *, config: str | None = None, store: str | None = None,
                     wait_timeout: float | None = None) -> TrainerEnv:
        rank = env_int("RANK", 0)
        world = env_int("WORLD_SIZE", 1)
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        config_path = config or os.environ.get("TRAININGRUN_CONFIG")
        if not config_path:
            raise ConfigError("TRAININGRUN_CONFIG: not set (path of the TrainingRun YAML)")
        store_url = store or os.environ.get("TRAININGRUN_STORE_URL")
        if not store_url:
            raise ConfigError("TRAININGRUN_STORE_URL: not set (file:///path or redis://host:port/db)")
        port = os.environ.get("TRAININGRUN_METRICS_PORT")
        return cls(
            rank=rank, world_size=world, attempt=env_int("TRAININGRUN_ATTEMPT", 0), config_path=config_path,
            store_url=store_url, run_name=os.environ.get("TRAININGRUN_RUN") or None,
            metrics_port=int(port) if port else None,
            metrics_jsonl=os.environ.get("TRAININGRUN_METRICS_JSONL") if rank == 0 else None,
            wait_timeout=wait_timeout, epoch=_epoch(),
        )
