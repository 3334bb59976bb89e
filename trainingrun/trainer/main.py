"""`trainingrun trainer`: the trainer ranks of one trainer pod (a process locally).

Reads everything from the environment (see `trainingrun.plan` and `trainer/config.py`): RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and the run's `TRAININGRUN_*` variables (`trainingrun.contract.env.ProcessEnv`: config,
store URL, run, attempt, run epoch, metrics port, metrics JSONL — rank 0 appends one JSON object per step there).

With `spec.trainer.gpusPerReplica` = G ≤ 1 this process is the pod's one rank (RANK/WORLD_SIZE as given). With G > 1
the pod's RANK/WORLD_SIZE are the node rank / node count, and this process supervises G worker processes with
process-level RANK = node_rank × G + local_rank, WORLD_SIZE = nodes × G, LOCAL_RANK (`trainer/workers.py`); a process
with LOCAL_RANK set is a worker and trains: `Trainer.build` → `resume` → `fit` → `close` (`trainer/trainer.py`).

Exit codes: 0 done; 78 (`EXIT_CONFIG_ERROR`) for a configuration error (bad spec, model that cannot be built,
inconsistent schedule) so nobody restarts us; 1 anything else (the launcher/operator restarts the group).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from trainingrun.api import load_trainingrun
from trainingrun.childlog import quiet_known_warnings
from trainingrun.cliargs import positive_seconds
from trainingrun.contract.env import CONFIG_ENV, ProcessEnv
from trainingrun.contract.errors import EXIT_CONFIG_ERROR, ConfigError, StoreError
from trainingrun.diskspace import describe
from trainingrun.store import exit_status
from trainingrun.trainer.config import TrainerEnv, env_int
from trainingrun.trainer.workers import Supervisor, is_worker, worker_command

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="TrainingRun YAML (default: $TRAININGRUN_CONFIG)")
    parser.add_argument("--store", default=None, help="store URL (default: $TRAININGRUN_STORE_URL)")
    parser.add_argument(
        "--wait-timeout", type=positive_seconds, default=None,
        help="give up (exit 1) after waiting this many seconds for one rollout (default: wait forever)",
    )


def run(args: argparse.Namespace) -> int:
    rank = int(os.environ.get("RANK", "0") or 0)
    try:
        nproc = _workers_per_node(args)
        if nproc > 1:
            return _supervise(args, nproc)
        return _train(args)
    except ConfigError as exc:
        print(f"[trainer {rank}] configuration error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG_ERROR
    except StoreError as exc:  # one line naming the key; 78 when no restart can fix it (corrupt data, fenced off)
        _say(f"[trainer {rank}] store error: {exc}")
        return exit_status(exc)
    except (OSError, RuntimeError) as exc:  # a full volume (a checkpoint, a log, the metrics file): no restart helps
        line = describe(exc, _volumes(args))
        if line is None:
            raise
        _say(f"[trainer {rank}] {line}")
        return EXIT_CONFIG_ERROR


def _volumes(args: argparse.Namespace) -> list[str]:
    """Where this trainer writes: the working directory (the run directory locally) and the checkpoint path (in a
    cluster often a volume of its own). A failure whose exception lost the errno (a peer's broken collective after
    the rank that hit the full volume ended) is a full volume when one of these is full."""
    paths = [os.getcwd()]
    try:
        paths.append(load_trainingrun(_config_path(args)).spec.trainer.checkpoint.path)
    except (ValueError, ConfigError, OSError):
        pass
    return paths


def _say(line: str) -> None:
    """One line to stderr; on a full volume even that may fail, and the exit code still tells."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def _config_path(args: argparse.Namespace) -> str:
    path = args.config or ProcessEnv.from_environ().config
    if not path:
        raise ConfigError(f"{CONFIG_ENV}: not set (path of the TrainingRun YAML)")
    return path


def _workers_per_node(args: argparse.Namespace) -> int:
    """How many worker processes this process must start: G = spec.trainer.gpusPerReplica when G > 1 and this is
    not already a worker (see trainer/workers.py); else 1 (train in this process)."""
    if is_worker():
        return 1
    try:
        tr = load_trainingrun(_config_path(args))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return max(tr.spec.trainer.gpus_per_replica, 1)


def _supervise(args: argparse.Namespace, nproc: int) -> int:
    """Node-level RANK/WORLD_SIZE (pod index / pod count) → `nproc` workers with process-level ranks."""
    node_rank = env_int("RANK", 0)
    num_nodes = env_int("WORLD_SIZE", 1)
    if not 0 <= node_rank < num_nodes:
        raise ConfigError(f"RANK: {node_rank} is not a trainer pod index below WORLD_SIZE {num_nodes}")
    argv: list[str] = []
    if args.config:
        argv += ["--config", args.config]
    if args.store:
        argv += ["--store", args.store]
    if args.wait_timeout is not None:
        argv += ["--wait-timeout", repr(args.wait_timeout)]
    return Supervisor(worker_command(argv), nproc=nproc, node_rank=node_rank, num_nodes=num_nodes).run()


def _train(args: argparse.Namespace) -> int:
    from trainingrun.trainer.trainer import Trainer  # deferred: megatron and torch (after the device decision)

    env = TrainerEnv.from_environ(config=args.config, store=args.store, wait_timeout=args.wait_timeout)
    quiet_known_warnings(env.rank)  # before megatron is imported: its start-up warnings once, from rank 0
    _exit_cleanly_on_sigterm()
    trainer = Trainer.build(env)
    try:
        trainer.resume()
        trainer.start_tracking()
        trainer.fit()
        trainer.linger()
        return 0
    except StoreError as exc:
        if exit_status(exc) == EXIT_CONFIG_ERROR:
            # Corrupt data, fenced off: say so and exit at once, before tearing down torch.distributed. Our peers'
            # collectives break only when we are gone, so whoever watches (launcher, operator) sees this rank end
            # first and names it, not a peer whose all-reduce broke.
            _say(f"[trainer {env.rank}] store error: {exc}")
            os._exit(EXIT_CONFIG_ERROR)
        raise
    except (OSError, RuntimeError) as exc:
        # A full volume (a checkpoint on any rank, through any writer; the metrics file; a peer's collective broken
        # by the rank that found it full): one line and exit at once, as above, before the teardown (which a
        # launcher stopping the group could interrupt, and which may itself need the disk).
        line = describe(exc, _volumes(args))
        if line is None:
            raise
        _say(f"[trainer {env.rank}] {line}")
        os._exit(EXIT_CONFIG_ERROR)
    finally:
        trainer.close()


def _exit_cleanly_on_sigterm() -> None:
    """SIGTERM (the launcher stopping the group, Kubernetes stopping the pod) ends the trainer through its `finally`
    blocks, so rank 0 closes its TensorBoard and W&B writers (W&B keeps buffered records otherwise) and the store;
    exit status 143 as before. A second SIGTERM, or the SIGKILL after the grace period, ends it at once."""

    def handler(signum, frame):  # noqa: ARG001
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
