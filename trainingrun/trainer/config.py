"""What a trainer rank is told: its environment (`TrainerEnv`): torch.distributed's RANK / WORLD_SIZE and the run's
`TRAININGRUN_*` variables (`trainingrun.contract.env.ProcessEnv`). A bad or missing value is a `ConfigError` (exit 78).

No torch or megatron here: the entrypoint reads this before it decides on a device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from trainingrun.contract.env import CONFIG_ENV, STORE_URL_ENV, ProcessEnv
from trainingrun.contract.errors import ConfigError


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
        env = ProcessEnv.from_environ()
        config_path = config or env.config
        if not config_path:
            raise ConfigError(f"{CONFIG_ENV}: not set (path of the TrainingRun YAML)")
        store_url = store or env.store_url
        if not store_url:
            raise ConfigError(f"{STORE_URL_ENV}: not set (file:///path or redis://host:port/db)")
        return cls(
            rank=rank, world_size=world, attempt=env.attempt or 0, config_path=config_path,
            store_url=store_url, run_name=env.run, metrics_port=env.metrics_port,
            metrics_jsonl=env.metrics_jsonl if rank == 0 else None,
            wait_timeout=wait_timeout, epoch=env.run_epoch or 0,
        )
