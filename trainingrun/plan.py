"""One RunPlan for a TrainingRun: the processes (roles, ranks, environment, commands) that make up the run.

The operator renders a plan into pods (`trainingrun.operator`), the local launcher into processes
(`trainingrun.local`); both read the same plan, so a run behaves the same on a laptop and in a cluster.

Every process reads its configuration from the environment: the `TRAININGRUN_*` variables of
`trainingrun.contract.env.ProcessEnv` (TRAININGRUN_RUN and TRAININGRUN_STORE_URL are contracts; also CONFIG, the path
of the TrainingRun YAML, a ConfigMap mount in a cluster; ATTEMPT, the restart attempt; RUN_EPOCH, the run's creation
time in unix seconds, unset when unknown, e.g. local runs: with the attempt it orders the writers of a run's
checkpoints, so a TrainingRun deleted and re-created over the same volume takes them over and the old run's leftovers
are fenced off; METRICS_PORT, this process's /metrics), and trainers `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
`MASTER_PORT` (contract; see "Ranks" below). `extra_env` adds what a caller gives every process (the launcher: the
run directory's paths and the run's engine, also through `ProcessEnv`).

Ranks. A trainer process of the plan (a pod) is a *node* of the torch.distributed job. Its `RANK` is the pod index
(0 .. replicas-1, = the `trainingrun.dev/rank` label and the `trainer-<rank>` hostname) and its `WORLD_SIZE` the
number of trainer pods (`spec.trainer.replicas`), i.e. torchrun's node rank / node count; `MASTER_ADDR:MASTER_PORT`
is trainer pod 0. With `gpusPerReplica` G ≤ 1 a pod runs one rank, so these are also the process rank and world
size. With G > 1, `trainingrun trainer` starts G worker processes per pod (`trainingrun.trainer.workers`) and gives
each the process-level values torch.distributed reads: RANK = node_rank × G + local_rank, WORLD_SIZE = replicas × G
(= `spec.trainer.world_size`), LOCAL_RANK, LOCAL_WORLD_SIZE = G, and keeps the pod's values as TRAININGRUN_NODE_RANK /
TRAININGRUN_NUM_NODES (`ProcessEnv.node_rank` / `num_nodes`). The pod keeps node-level values (rather than, say,
RANK = first process rank) because they are what the pod knows and is labelled with, and because they stay correct
however many processes the pod starts.

Metrics ports: a trainer pod's workers serve /metrics on TRAININGRUN_METRICS_PORT + local_rank
(`ProcessPlan.metrics_ports`).

Engines. The run's own inference servers (`rollout.engine.replicas` of them, when the run's engine type is served by
servers and no `engine.url` names the user's: `trainingrun.engines.table.own_servers`, which the caller passes as
`engine_replicas`) are the plan's engine roles (`EngineRole`, `RunPlan.engines`): replica i is `engine-<i>`
(`engine_name`) — the local launcher's process (pids.json `engine-<i>`, logs/engine-<i>.log) and the operator's pod
R-engine-<i> with hostname engine-<i>, role label `engine`. They are not processes of an attempt: they start before
the first attempt and outlive the group's restarts (the launcher and the operator restart a replica alone), so every
attempt's plan holds the same ones and the launcher starts them from `engine_roles` before it builds one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainingrun.api.constants import ROLE_ENGINE
from trainingrun.api.models import TrainingRun
from trainingrun.contract.env import ProcessEnv

Role = Literal["rollout", "trainer"]

CONFIG_MOUNT_PATH = "/etc/trainingrun/run.yaml"
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class ProcessPlan:
    """One process of the run (a pod in a cluster)."""

    role: Role
    rank: int | None  # trainer node rank (pod index); None for the rollout
    args: tuple[str, ...]  # arguments after the `trainingrun` executable
    env: dict[str, str]
    metrics_port: int
    workers: int = 1  # processes this one runs (trainers: max(gpusPerReplica, 1)), each with its own metrics port

    @property
    def name(self) -> str:
        return self.role if self.rank is None else f"{self.role}-{self.rank}"

    @property
    def metrics_ports(self) -> tuple[int, ...]:
        """/metrics ports of this process's workers: metrics_port + local_rank."""
        return tuple(range(self.metrics_port, self.metrics_port + self.workers))


def engine_name(replica: int) -> str:
    """Engine replica i's name: engine-<i> (local process, log file, pod hostname)."""
    return f"{ROLE_ENGINE}-{replica}"


@dataclass(frozen=True)
class EngineRole:
    """One of the run's own engine servers (see "Engines" in the module docstring)."""

    type: str  # rollout.engine.type: its entry in the engine table starts (locally) or renders (a pod) it
    replica: int
    role: str = ROLE_ENGINE

    @property
    def name(self) -> str:
        return engine_name(self.replica)


def engine_roles(run: TrainingRun, replicas: int) -> tuple[EngineRole, ...]:
    """The run's `replicas` own engine servers (`trainingrun.engines.table.own_servers`; 0: none)."""
    return tuple(EngineRole(type=run.spec.rollout.engine.type, replica=i) for i in range(replicas))


@dataclass(frozen=True)
class RunPlan:
    """What to run for one TrainingRun attempt."""

    name: str
    store_url: str
    world_size: int
    data_parallel_size: int
    attempt: int
    processes: tuple[ProcessPlan, ...] = field(default_factory=tuple)
    engines: tuple[EngineRole, ...] = ()  # the run's own engine servers (outlive the attempt)

    @property
    def rollout(self) -> ProcessPlan:
        return next(p for p in self.processes if p.role == "rollout")

    @property
    def trainers(self) -> tuple[ProcessPlan, ...]:
        return tuple(p for p in self.processes if p.role == "trainer")


def build_plan(
    run: TrainingRun,
    *,
    store_url: str,
    config_path: str,
    master_addr: str,
    master_port: int = DEFAULT_MASTER_PORT,
    attempt: int = 0,
    epoch: int = 0,
    metrics_port: int | None = None,
    distinct_ports: bool = False,
    extra_env: dict[str, str] | None = None,
    engine_replicas: int = 0,
) -> RunPlan:
    """The processes of one attempt of `run`, and its `engine_replicas` own engine servers.

    `distinct_ports`: give every process its own metrics ports, as processes on one machine need: the rollout
    `port`, trainer r (with G = max(gpusPerReplica, 1) workers) `port + 1 + r·G` .. `port + r·G + G`, so a run uses
    `1 + replicas·G` consecutive ports. Pods each have their own network namespace and all use `spec.metrics.port`
    (+ local_rank for a pod's workers).
    """
    spec = run.spec
    name = run.metadata.name
    base_port = spec.metrics.port if metrics_port is None else metrics_port
    common = {
        **ProcessEnv(run=name, store_url=store_url, config=config_path, attempt=attempt,
                     run_epoch=epoch or None).to_env(),
        **(extra_env or {}),
    }
    replicas = spec.trainer.replicas
    nproc = max(spec.trainer.gpus_per_replica, 1)
    processes = [
        ProcessPlan(
            role="rollout",
            rank=None,
            args=("rollout",),
            env={**common, **ProcessEnv(metrics_port=base_port).to_env()},
            metrics_port=base_port,
        )
    ]
    for rank in range(replicas):
        port = base_port + 1 + rank * nproc if distinct_ports else base_port
        processes.append(
            ProcessPlan(
                role="trainer",
                rank=rank,
                args=("trainer",),
                env={
                    **common,
                    "RANK": str(rank),
                    "WORLD_SIZE": str(replicas),
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(master_port),
                    **ProcessEnv(metrics_port=port).to_env(),
                },
                metrics_port=port,
                workers=nproc,
            )
        )
    return RunPlan(
        name=name,
        store_url=store_url,
        world_size=spec.trainer.world_size,
        data_parallel_size=spec.trainer.data_parallel_size,
        attempt=attempt,
        processes=tuple(processes),
        engines=engine_roles(run, engine_replicas),
    )


__all__ = ["CONFIG_MOUNT_PATH", "DEFAULT_MASTER_PORT", "EngineRole", "ProcessPlan", "Role", "RunPlan",
           "build_plan", "engine_name", "engine_roles"]
