"""`trainingrun trainer`: the trainer ranks of one trainer pod (a process locally).

Reads everything from the environment (see `trainingrun.plan`): RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TRAININGRUN_CONFIG, TRAININGRUN_STORE_URL, TRAININGRUN_RUN, TRAININGRUN_ATTEMPT, TRAININGRUN_METRICS_PORT,
TRAININGRUN_METRICS_JSONL (rank 0 appends one JSON object per step there).

With `spec.trainer.gpusPerReplica` = G ≤ 1 this process is the pod's one rank (RANK/WORLD_SIZE as given). With G > 1
the pod's RANK/WORLD_SIZE are the node rank / node count, and this process supervises G worker processes with
process-level RANK = node_rank × G + local_rank, WORLD_SIZE = nodes × G, LOCAL_RANK (`trainer/workers.py`); a process
with LOCAL_RANK set is a worker and trains.

Loop, top to bottom: resume from the newest complete checkpoint → for rollout k = progress.rollout, ...: wait for
its commit (stop when the stream finished) → read the schedule and this rank's payload → for each step not yet
trained: its micro-batches through Megatron, LR scheduler += GBS_s, optimizer step, metrics reduced and exported →
ack rollout k → checkpoint every `checkpoint.interval` steps and at the end.

Exit codes: 0 done; 78 (`EXIT_CONFIG_ERROR`) for a configuration error (bad spec, model that cannot be built,
inconsistent schedule) so nobody restarts us; 1 anything else (the launcher/operator restarts the group).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from trainingrun.plan import EXIT_CONFIG_ERROR


class ConfigError(Exception):
    """A configuration problem a restart cannot fix."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="TrainingRun YAML (default: $TRAININGRUN_CONFIG)")
    parser.add_argument("--store", default=None, help="store URL (default: $TRAININGRUN_STORE_URL)")
    parser.add_argument(
        "--wait-timeout", type=float, default=None,
        help="give up (exit 1) after waiting this many seconds for one rollout (default: wait forever)",
    )


def _log(rank: int, msg: str) -> None:
    print(f"[trainer {rank}] {msg}", file=sys.stderr, flush=True)


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"environment: {name} is not set (needed by every trainer rank)")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment: {name}={raw!r} is not an integer") from None


def run(args: argparse.Namespace) -> int:
    rank = int(os.environ.get("RANK", "0") or 0)
    try:
        nproc = _workers_per_node(args)
        if nproc > 1:
            return _supervise(args, nproc)
        return _train(args)
    except ConfigError as exc:
        _log(rank, f"configuration error: {exc}")
        return EXIT_CONFIG_ERROR


def _config_path(args: argparse.Namespace) -> str:
    path = args.config or os.environ.get("TRAININGRUN_CONFIG")
    if not path:
        raise ConfigError("TRAININGRUN_CONFIG: not set (path of the TrainingRun YAML)")
    return path


def _workers_per_node(args: argparse.Namespace) -> int:
    """How many worker processes this process must start: G = spec.trainer.gpusPerReplica when G > 1 and this is
    not already a worker (see trainer/workers.py); else 1 (train in this process)."""
    from trainingrun.trainer.workers import is_worker

    if is_worker():
        return 1
    from trainingrun.api import load_trainingrun

    try:
        tr = load_trainingrun(_config_path(args))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return max(tr.spec.trainer.gpus_per_replica, 1)


def _supervise(args: argparse.Namespace, nproc: int) -> int:
    """Node-level RANK/WORLD_SIZE (pod index / pod count) → `nproc` workers with process-level ranks."""
    from trainingrun.trainer.workers import Supervisor, worker_command

    node_rank = _env_int("RANK", 0)
    num_nodes = _env_int("WORLD_SIZE", 1)
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
    from trainingrun.api import load_trainingrun

    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    attempt = _env_int("TRAININGRUN_ATTEMPT", 0)
    config_path = _config_path(args)
    store_url = args.store or os.environ.get("TRAININGRUN_STORE_URL")
    if not store_url:
        raise ConfigError("TRAININGRUN_STORE_URL: not set (file:///path or redis://host:port/db)")
    try:
        tr = load_trainingrun(config_path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    spec = tr.spec
    ts = spec.trainer
    run_name = os.environ.get("TRAININGRUN_RUN") or tr.metadata.name
    if ts.pipeline_parallel_size != 1:
        raise ConfigError(
            f"trainer.pipelineParallelSize: {ts.pipeline_parallel_size} is not supported by this trainer yet; allowed: 1"
        )
    if world % ts.tensor_parallel_size:
        raise ConfigError(f"WORLD_SIZE: {world} not divisible by trainer.tensorParallelSize {ts.tensor_parallel_size}")
    try:
        sizes = spec.model.resolved()
    except ValueError as exc:
        raise ConfigError(f"model: {exc}") from None

    # Import order: the device decision installs the CPU shim before megatron is imported.
    from trainingrun.trainer.model import (
        build_gpt, build_optimizer, init_distributed, optim_settings, prepare_device, set_seed, wrap_ddp,
    )

    try:
        device = prepare_device(ts.gpus_per_replica)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _log(rank, f"run {run_name} attempt {attempt}: world {world}, device {device}, store {store_url}")
    init_distributed(device, tp=ts.tensor_parallel_size, pp=1)

    import torch.distributed as dist
    from megatron.core import parallel_state

    from trainingrun.metrics.exporter import TrainerExporter
    from trainingrun.store import open_store
    from trainingrun.trainer import checkpoint as ckpt
    from trainingrun.trainer.batch import step_microbatches
    from trainingrun.trainer.step import train_step

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    dp_group = parallel_state.get_data_parallel_group()
    set_seed(spec.seed)
    try:
        model = build_gpt(sizes, device)
    except (ValueError, AssertionError, TypeError) as exc:
        raise ConfigError(f"model: cannot build the GPT model from {sizes}: {exc}") from None
    ddp = wrap_ddp(model)
    optimizer, scheduler = build_optimizer(ddp, optim_settings(ts.optimizer), str(sizes["precision"]))
    n_params = sum(p.numel() for p in model.parameters())
    _log(rank, f"model: {n_params / 1e6:.2f}M parameters {sizes}; dp {dp_size} (dp rank {dp_rank}), tp {ts.tensor_parallel_size}")

    # ------------------------------------------------------------------ resume
    ckpt_root = Path(ts.checkpoint.path)  # relative: against the cwd (the launcher runs us in the run directory)
    shard = f"tp{tp_rank}_pp0"
    progress = ckpt.Progress()
    latest = ckpt.latest_checkpoint(ckpt_root)
    if latest is not None:
        progress = ckpt.load(latest, module=ddp.module, optimizer=optimizer, scheduler=scheduler, shard=shard)
        _log(rank, f"resumed from {latest}: step {progress.global_step}, rollout {progress.rollout}"
                   f"+{progress.step_in_rollout}, samples {progress.samples_consumed}")
    last_saved = progress.global_step if latest is not None else -1

    store = open_store(store_url)
    exporter = TrainerExporter(run_name, rank)
    port = os.environ.get("TRAININGRUN_METRICS_PORT")
    if port and spec.metrics.enabled:
        try:
            exporter.serve(int(port))
        except OSError as exc:  # metrics must never stop training
            _log(rank, f"warning: cannot serve metrics on port {port}: {exc}")
    jsonl_path = os.environ.get("TRAININGRUN_METRICS_JSONL") if rank == 0 else None

    def barrier() -> None:
        dist.barrier()

    def save_checkpoint(prog: ckpt.Progress) -> None:
        nonlocal last_saved
        t0 = time.perf_counter()
        ckpt.save(
            ckpt_root, prog, module=ddp.module, optimizer=optimizer, scheduler=scheduler, keep=ts.checkpoint.keep,
            attempt=attempt, shard=shard, writes_shard=dp_rank == 0, is_rank0=rank == 0, barrier=barrier,
            extra={"attempt": attempt, "run": run_name},
        )
        last_saved = prog.global_step
        if rank == 0:
            # Everything before prog.rollout is covered by the checkpoint: the store may drop it once all acked.
            store.release_upto(prog.rollout)
            _log(rank, f"checkpoint step {prog.global_step} (rollout {prog.rollout}+{prog.step_in_rollout}) "
                       f"in {time.perf_counter() - t0:.2f}s")

    interval = ts.checkpoint.interval
    k = progress.rollout
    start_step = progress.step_in_rollout
    try:
        while True:
            if not _wait(store, k, args.wait_timeout, rank, ckpt_root):
                break
            schedule = store.read_schedule(k)
            payload = store.read_payload(k, dp_rank)
            gbs_list = [int(x) for x in schedule["global_batch_sizes"]]
            loss_tokens = [int(x) for x in schedule.get("loss_tokens", [0] * len(gbs_list))]
            num_mb = schedule["schedule"]["num_microbatches"]
            _check_schedule(schedule, k, dp_size, progress, start_step)
            for s in range(start_step, len(gbs_list)):
                mbs = step_microbatches(schedule, payload, dp_rank, s, device)
                res = train_step(
                    ddp, optimizer, scheduler, mbs, loss_type=ts.loss_type, normalization=ts.loss_normalization,
                    global_batch_size=gbs_list[s], loss_tokens=loss_tokens[s], dp_size=dp_size, dp_group=dp_group,
                )
                progress.global_step += 1
                progress.samples_consumed += gbs_list[s]
                progress.tokens_consumed += res.tokens
                progress.rollout, progress.step_in_rollout = k, s + 1
                if res.samples != gbs_list[s]:
                    raise RuntimeError(f"rollout {k} step {s}: trained {res.samples} samples, schedule says {gbs_list[s]}")
                if scheduler.num_steps != progress.samples_consumed:
                    raise RuntimeError(
                        f"LR scheduler consumed {scheduler.num_steps} samples, trainer {progress.samples_consumed}"
                    )
                record = {
                    "step": progress.global_step, "rollout": k, "step_in_rollout": s,
                    "global_batch_size": gbs_list[s], "num_microbatches": int(num_mb[s]),
                    "loss": res.loss, "lr": res.lr, "grad_norm": res.grad_norm,
                    "samples_consumed": progress.samples_consumed, "tokens": res.tokens,
                    "loss_tokens": loss_tokens[s],
                    "sample_loss": res.mean("sample_loss"), "token_loss": res.mean("token_loss"),
                    "reward": res.mean("sample_reward"),
                    "attempt": attempt, "step_seconds": res.seconds,
                    "samples_per_second": gbs_list[s] / res.seconds if res.seconds > 0 else 0.0,
                    "tokens_per_second": res.tokens / res.seconds if res.seconds > 0 else 0.0,
                    "scheduler_consumed_samples": int(scheduler.num_steps),
                    "samples_trained": res.samples, "sample_id_sum": res.sample_id_sum,
                    "dp_size": dp_size, "time": time.time(),
                }
                _export(exporter, res, record)
                if rank == 0:
                    _report(store, jsonl_path, record)
                last_of_rollout = s + 1 == len(gbs_list)
                if interval and progress.global_step % interval == 0 and not last_of_rollout:
                    save_checkpoint(progress)
            if tp_rank == 0:
                store.ack(k, dp_rank)
            k += 1
            progress.rollout, progress.step_in_rollout = k, 0
            start_step = 0
            if interval and progress.global_step % interval == 0 and last_saved != progress.global_step:
                save_checkpoint(progress)
        if last_saved != progress.global_step and progress.global_step > 0:
            save_checkpoint(progress)
        elif rank == 0 and progress.global_step > 0:
            store.release_upto(progress.rollout)
        if rank == 0:
            store.put_json("trainer_done", {"step": progress.global_step, "samples_consumed": progress.samples_consumed,
                                            "rollouts": progress.rollout, "attempt": attempt, "time": time.time()})
        _log(rank, f"done: {progress.global_step} steps, {progress.samples_consumed} samples, {progress.rollout} rollouts")
        barrier()
        if spec.metrics.linger_seconds and exporter.server is not None:
            _log(rank, f"serving final metrics for {spec.metrics.linger_seconds}s (metrics.lingerSeconds)")
            time.sleep(spec.metrics.linger_seconds)
        return 0
    finally:
        exporter.close()
        store.close()
        if dist.is_initialized():
            try:
                parallel_state.destroy_model_parallel()
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass


def _wait(store, k: int, timeout: float | None, rank: int, ckpt_root: Path | None = None) -> bool:
    """Wait for rollout k's commit with progress output; False when the stream finished before k.

    Rollout k already released (deleted after a checkpoint past it): the store belongs to a run that is further
    along than our checkpoints (a store reused by a fresh run, or checkpoints removed). No restart can fix that, so
    it is a ConfigError naming what to change, not a crash that the launcher/operator would retry.
    """
    from trainingrun.store import RolloutReleased, StoreTimeout

    waited = 0.0
    while True:
        chunk = 30.0 if timeout is None else max(min(30.0, timeout - waited), 0.1)
        try:
            return store.wait_rollout(k, timeout=chunk)
        except RolloutReleased as exc:
            where = f" in {ckpt_root.resolve()}" if ckpt_root is not None else ""
            raise ConfigError(
                f"store {store.url}: rollout {k}, where training resumes (checkpoint{where}: "
                f"{'none' if k == 0 else f'rollout {k}'}), was already trained and deleted by an earlier run using "
                f"this store ({exc}); give this run a fresh store (another redis db or ?prefix=NAME, or a new "
                "store.url) or resume with the checkpoints of the run that used it"
            ) from None
        except StoreTimeout:
            waited += chunk
            if timeout is not None and waited >= timeout:
                raise
            _log(rank, f"waiting for rollout {k} ({waited:.0f}s)")


def _check_schedule(schedule: dict, k: int, dp_size: int, progress, start_step: int) -> None:
    """The rollout's schedule must fit this trainer group and continue where training stands."""
    if int(schedule.get("dp_size", dp_size)) != dp_size:
        raise ConfigError(
            f"rollout {k}: schedule is for dp_size {schedule.get('dp_size')}, this trainer group has {dp_size} "
            "data-parallel ranks (trainer.replicas must match the rollout's plan)"
        )
    gbs = [int(x) for x in schedule["global_batch_sizes"]]
    if "step_offset" in schedule and int(schedule["step_offset"]) + start_step != progress.global_step:
        raise ConfigError(
            f"rollout {k}: step_offset {schedule['step_offset']} + {start_step} != steps trained "
            f"{progress.global_step} (the store does not continue this run's checkpoint)"
        )
    if "samples_offset" in schedule and int(schedule["samples_offset"]) + sum(gbs[:start_step]) != progress.samples_consumed:
        raise ConfigError(
            f"rollout {k}: samples_offset {schedule['samples_offset']} + {sum(gbs[:start_step])} != samples "
            f"consumed {progress.samples_consumed} (the store does not continue this run's checkpoint)"
        )


def _export(exporter, res, record: dict) -> None:
    from trainingrun.trainer.loss import STAT_NAMES

    local = {name: tuple(res.local_stats[i].tolist()) for i, name in enumerate(STAT_NAMES)}
    exporter.add_weighted({
        "trainingrun_trainer_sample_loss": local["sample_loss"],
        "trainingrun_trainer_token_loss": local["token_loss"],
        "trainingrun_trainer_sample_reward": local["sample_reward"],
        "trainingrun_trainer_sample_tokens": local["sample_tokens"],
    })
    exporter.inc("trainingrun_trainer_rank_tokens", res.local_tokens)
    exporter.inc("trainingrun_trainer_rank_samples", res.local_samples)
    exporter.inc("trainingrun_trainer_steps", 1)
    exporter.set_gauges({
        "trainingrun_trainer_loss": record["loss"],
        "trainingrun_trainer_global_batch_size": record["global_batch_size"],
        "trainingrun_trainer_lr": record["lr"],
        "trainingrun_trainer_grad_norm": record["grad_norm"],
        "trainingrun_trainer_step_seconds": record["step_seconds"],
        "trainingrun_trainer_samples_per_second": record["samples_per_second"],
        "trainingrun_trainer_tokens_per_second": record["tokens_per_second"],
        "trainingrun_trainer_step": record["step"],
        "trainingrun_trainer_samples_consumed": record["samples_consumed"],
        "trainingrun_trainer_rollout": record["rollout"],
        "trainingrun_trainer_num_microbatches": record["num_microbatches"],
    })


def _report(store, jsonl_path: str | None, record: dict) -> None:
    """Rank 0: one JSON line per step (local runs) and the progress key the launcher/operator read."""
    if jsonl_path:
        with open(jsonl_path, "a") as f:
            f.write(json.dumps(record) + "\n")
    # The operator reads this key into the TrainingRun's status (trainingrun/operator/progress.py).
    store.put_json("progress", {
        **{k: record[k] for k in ("step", "rollout", "global_batch_size", "loss", "lr", "samples_consumed", "tokens",
                                  "attempt", "samples_per_second", "time")},
        "last_global_batch_size": record["global_batch_size"],
    })
    print(
        f"[trainer 0] step {record['step']} rollout {record['rollout']} gbs {record['global_batch_size']} "
        f"mb {record['num_microbatches']} loss {record['loss']:.4f} lr {record['lr']:.2e} "
        f"gnorm {record['grad_norm']:.3f} {record['samples_per_second']:.1f} samples/s",
        file=sys.stderr, flush=True,
    )
