"""The `Trainer` of one rank: build → resume → fit (train_rollout, sync_weights, per rollout) → close.

Read top to bottom, `fit` is the whole loop:

    for each rollout k from where the checkpoint left off (stop when the stream finished):
        train_rollout(k):  [oldLogprobs trainer: π_old of the rollout's tokens, a forward-only pass with the
                           weights before its first update]
                           for each step not yet trained: its micro-batches through Megatron, the loss scaled by the
                           step's real global batch size (or loss tokens), LR scheduler += GBS_s, optimizer step,
                           (sum, count) metrics reduced and reported; checkpoint when due
                           → ack k → checkpoint when due
        sync_weights():    the new weights to the generator (`spec.weightSync`; nothing without a publisher)
    final checkpoint

Everything the loop needs per step comes from the published rollout (`contract/published.py`): the schedule, GBS_s,
T_s, micro-batch positions, the run's step and sample offsets. The model's `Architecture` and the `LossSettings` are
resolved from the spec once, in `build`. Megatron is imported only after `prepare_device` has installed the CPU shim
(CPU mode), so this module imports it lazily.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from trainingrun.api import load_trainingrun
from trainingrun.api.checks import lora_settings
from trainingrun.contract.errors import ConfigError
from trainingrun.contract.payload import RankPayload
from trainingrun.contract.published import PublishedRollout, StepPlan, read
from trainingrun.contract.resume import ResumePoint
from trainingrun.engines.table import logprob_dtype
from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.convert import check_tp
from trainingrun.modeling.hf_io import copy_assets
from trainingrun.modeling.lora_base import DIGEST_CACHE, base_reference
from trainingrun.modeling.lora_targets import LAYERS
from trainingrun.modeling.pipeline import check_pp
from trainingrun.store import RolloutReleased, StoreTimeout, open_store
from trainingrun.tracking import TrackingConfigError, open_tracker, tracking_paths
from trainingrun.trainer.checkpoint import CheckpointError, CheckpointFenced, TrainingProgress, release_point
from trainingrun.trainer.checkpoint_megatron import TrainerCheckpoints
from trainingrun.trainer.config import TrainerEnv
from trainingrun.trainer.loss import LossSettings, StepTotals, loss_settings
from trainingrun.trainer.moe import MoETraining, aux_loss_coeff
from trainingrun.trainer.reshard import acked_ranks, reschedule


def log(rank: int, msg: str) -> None:
    print(f"[trainer {rank}] {msg}", file=sys.stderr, flush=True)


def _copy_hf_assets(hf: str, checkpoint_dir: Path) -> None:
    """What export-hf needs besides the weights: the HF config and tokenizer the run started from, in `hf/`."""
    copy_assets(hf, checkpoint_dir / "hf")


class Trainer:
    """One trainer rank (see the module docstring). Build it with `Trainer.build(env)`."""

    def __init__(self, *, env: TrainerEnv, spec, arch: Architecture, loss: LossSettings, run_name: str, device,
                 model, ddp, optimizer, scheduler, store, reporter, publisher=None, ref_model=None, moe=None):
        from megatron.core import parallel_state  # deferred: megatron (after the CPU shim)

        self.env, self.spec, self.run_name, self.device = env, spec, run_name, device
        self.model, self.ddp, self.optimizer, self.scheduler = model, ddp, optimizer, scheduler
        self.store, self.reporter, self.publisher = store, reporter, publisher
        self.arch = arch  # the model (checkpoints record it)
        self.loss = loss
        self.ref_model = ref_model  # the frozen initial policy (ppo with policyLoss.klCoef > 0)
        self.moe = moe  # mixtures of experts: trainer.moe.MoETraining (router hooks, EP padding, statistics)
        self.rank = env.rank
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.ckpt_root = Path(spec.trainer.checkpoint.path)  # relative: the launcher runs us in the run directory
        self.progress = TrainingProgress()
        self.data_wait = 0.0  # seconds this rank waited for (and read) the rollout it trains now
        self.sync_seconds = 0.0  # seconds the last weight sync took (reported with the next step)
        self.sync_bytes = 0  # bytes it published (rank 0; reported with the next step)
        self.old_logprob_seconds = 0.0  # the π_old pass of the rollout trained now (reported with its first step)
        self.last_saved = -1  # global step of the newest checkpoint on disk
        self.tracking = None  # rank 0: where TensorBoard / W&B / the cluster's metrics.jsonl go (trainingrun.tracking)
        if self.rank == 0:
            self.tracking = tracking_paths(spec.metrics, checkpoint_dir=self.ckpt_root)
            if env.metrics_jsonl is None:  # in a cluster: the history next to the checkpoints
                reporter.jsonl_path = str(self.tracking.metrics_jsonl)
        hf = arch.hf
        try:
            tp_size = parallel_state.get_tensor_model_parallel_world_size()
            pp_size = parallel_state.get_pipeline_model_parallel_world_size()
            self.checkpoints = TrainerCheckpoints(
                self.ckpt_root, ddp.module, optimizer, scheduler, attempt=env.attempt,
                keep=spec.trainer.checkpoint.keep, epoch=env.epoch,
                meta={"run": run_name, "dp_size": self.dp_size, "tp_size": tp_size, "pp_size": pp_size,
                      "model": arch.to_dict(),
                      **({"ep_size": parallel_state.get_expert_model_parallel_world_size()} if arch.moe else {})},
                log=lambda msg: log(self.rank, msg) if self.rank == 0 else None,
                assets=(lambda d: _copy_hf_assets(hf, d)) if hf else None,
                # LoRA: checkpoints hold the adapters only, naming the base by its reference and digest
                base=(lambda: base_reference(arch, spec.seed, cache=self.ckpt_root / DIGEST_CACHE))
                if spec.trainer.lora is not None else None,
                seed=spec.seed,
            )
        except CheckpointError as exc:
            raise ConfigError(str(exc)) from None
        if publisher is not None and spec.trainer.lora is not None and hasattr(publisher, "set_base"):
            publisher.set_base(self.checkpoints.base_reference)  # LoRA versions name their base (`store_sync.py`)

    # ------------------------------------------------------------------------------------------------ build
    @classmethod
    def build(cls, env: TrainerEnv) -> Trainer:
        """Spec, device, process groups, model, DDP, optimizer + samples-based LR schedule, store, metrics."""
        try:
            tr = load_trainingrun(env.config_path)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        spec, ts = tr.spec, tr.spec.trainer
        run_name = env.run_name or tr.metadata.name
        tp, pp = ts.tensor_parallel_size, ts.pipeline_parallel_size
        if env.world_size % (tp * pp):
            raise ConfigError(f"WORLD_SIZE: {env.world_size} not divisible by trainer.tensorParallelSize {tp} × "
                              f"trainer.pipelineParallelSize {pp}")
        try:
            arch = spec.model.resolved()
        except ValueError as exc:
            raise ConfigError(f"model: {exc}") from None
        try:  # before any process group exists: every rank refuses alike, none waits in a collective for a peer gone
            check_tp(arch, tp, ts.expert_parallel_size)
            check_pp(arch, pp)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        loss = dataclasses.replace(loss_settings(spec), moe_aux_coeff=aux_loss_coeff(spec, arch))

        # Import order: the device decision installs the CPU shim before megatron is imported.
        from trainingrun.modeling.model import (  # deferred: megatron
            AttentionChoice,
            attention_choice,
            build_model,
            init_distributed,
            prepare_device,
            set_seed,
        )
        from trainingrun.modeling.lora import (  # deferred: megatron
            adapter_parameters,
            apply_lora,
            live_state_dict,
            load_peft_adapter,
        )
        from trainingrun.trainer.optim import (  # deferred: megatron
            build_optimizer,
            optim_settings,
            performance_settings,
            wrap_ddp,
        )

        try:
            device = prepare_device(ts.gpus_per_replica)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        log(env.rank, f"run {run_name} attempt {env.attempt}: world {env.world_size}, device {device}, "
                      f"store {env.store_url}")
        init_distributed(device, tp=tp, pp=pp, ep=ts.expert_parallel_size)

        # deferred, like the model above: megatron, prometheus_client and torch come after the device decision
        from megatron.core import parallel_state  # deferred: megatron

        from trainingrun.metrics.exporter import TrainerExporter  # deferred: prometheus_client
        from trainingrun.trainer.report import StepReporter  # deferred: torch (loss statistics)
        from trainingrun.trainer.weights import make_publisher  # deferred: torch

        try:  # what this device runs: the attention backend and the performance options (refused by name)
            attention = attention_choice(arch, device)
            if ts.lora is not None and attention.backend == "te" and arch.attention_backend == "auto" \
                    and arch.transformer_impl == "auto":  # LoRA adapts the local spec's linears (modeling.lora)
                local = attention_choice(arch.replace(transformer_impl="local"), device)
                attention = AttentionChoice(local.backend, f"auto under trainer.lora (its adapters need the local "
                                            f"layer spec): {local.reason}")
            options, ddp_settings = performance_settings(ts, arch, device, attention)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        log(env.rank, f"attention: {attention.backend} ({attention.reason})")
        set_seed(spec.seed)
        try:
            model = build_model(arch, device, options=options, seed=spec.seed)
        except (ValueError, AssertionError, TypeError, OSError) as exc:
            raise ConfigError(f"model: cannot build the model from {arch.to_dict()}: {exc}") from None
        if ts.lora is not None:  # frozen base + adapters, before DDP: its buckets hold only what trains
            try:
                layout = dict(tp=(parallel_state.get_tensor_model_parallel_rank(), tp),
                              pp=(parallel_state.get_pipeline_model_parallel_rank(), pp),
                              ep=(parallel_state.get_expert_model_parallel_rank(),
                                  parallel_state.get_expert_model_parallel_world_size()))
                adapted = apply_lora(model, arch, lora_settings(ts.lora), seed=spec.seed, **layout)
                if spec.model.adapter is not None:  # start from a PEFT adapter (checked against trainer.lora)
                    load_peft_adapter(model, arch, lora_settings(ts.lora), spec.model.adapter, **layout)
                    log(env.rank, f"lora: adapters from {spec.model.adapter}")
            except (ValueError, OSError) as exc:
                raise ConfigError(str(exc)) from None
            unmatched = [t for t in ts.lora.targets
                         if not any(".local_experts." in a if t == "experts" else a.endswith(LAYERS[t][0])
                                    for a in adapted)]
            log(env.rank, f"lora: rank {ts.lora.rank}, alpha {ts.lora.resolved_alpha:g}, dropout {ts.lora.dropout:g}, "
                          f"{len(adapted)} layers ({', '.join(ts.lora.targets)}); {adapter_parameters(model) / 1e6:.3f}M "
                          "trainable parameters on this rank, the base frozen"
                          + (f"; no layer of this stage for {', '.join(unmatched)} (a mixture of experts' MLPs are "
                             "its experts)" if unmatched else ""))
        ddp = wrap_ddp(model, ddp_settings)
        moe = MoETraining.build(model, arch, replay=ts.moe.routing_replay, device=device)
        ref_model = None
        if loss.kind.reference and ts.policy_loss.kl_coef > 0:  # a copy of the initial weights, before any resume
            ref_model = build_model(arch, device, seed=spec.seed)
            ref_model.load_state_dict(live_state_dict(model))  # with LoRA: the base (B is 0)
            ref_model.eval()
            for prm in ref_model.parameters():
                prm.requires_grad_(False)
        optimizer, scheduler = build_optimizer(ddp, optim_settings(ts.optimizer), arch.precision)
        n_params = sum(p.numel() for p in model.parameters())
        log(env.rank, f"model: {n_params / 1e6:.2f}M parameters {arch.to_dict()}; {attention.layer_impl} layers; dp "
                      f"{parallel_state.get_data_parallel_world_size()} (dp rank "
                      f"{parallel_state.get_data_parallel_rank()}), tp {tp}, pp {pp} (stage "
                      f"{parallel_state.get_pipeline_model_parallel_rank()})"
                      + (f", ep {ts.expert_parallel_size}" if arch.moe else ""))

        store = open_store(env.store_url, attempt=env.attempt)  # every write fenced by the attempt
        exporter = TrainerExporter(run_name, env.rank)
        if env.metrics_port and spec.metrics.enabled:
            try:
                exporter.serve(env.metrics_port)
            except OSError as exc:  # metrics must never stop training
                log(env.rank, f"warning: cannot serve metrics on port {env.metrics_port}: {exc}")
        reporter = StepReporter(exporter, store, rank=env.rank, jsonl_path=env.metrics_jsonl)
        try:
            publisher = make_publisher(spec, store, arch=arch, rank=env.rank, attempt=env.attempt)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return cls(env=env, spec=spec, arch=arch, loss=loss, run_name=run_name, device=device, model=model, ddp=ddp,
                   optimizer=optimizer, scheduler=scheduler, store=store, reporter=reporter, publisher=publisher,
                   ref_model=ref_model, moe=moe)

    # ------------------------------------------------------------------------------------------------ resume
    def resume(self) -> None:
        """Model, optimizer, scheduler, RNG and progress from the newest loadable checkpoint (if any; resharded when
        it was written at another data-/tensor-parallel size). Checkpoints that exist but none loads, or a newer
        attempt owning them: ConfigError (exit 78) naming the paths — a restart cannot repair them."""
        try:
            resumed = self.checkpoints.resume()
        except CheckpointError as exc:
            raise ConfigError(str(exc)) from None
        if resumed is not None:
            self.progress = resumed.progress
            self.last_saved = self.progress.global_step
            p = self.progress
            log(self.rank, f"resumed from {resumed.path}: step {p.global_step}, rollout {p.rollout}+"
                           f"{p.step_in_rollout}, samples {p.samples_consumed}")
        if self.rank == 0:  # where we resume: a rollout whose store lost the stream re-creates it up to here
            p = self.progress
            ResumePoint(rollout=p.rollout, step_in_rollout=p.step_in_rollout, global_step=p.global_step,
                        samples_consumed=p.samples_consumed, attempt=self.env.attempt).write(self.store)

    def start_tracking(self) -> None:
        """Rank 0, after `resume`: open TensorBoard / W&B (the steps after the resumed checkpoint replace a failed
        attempt's). A W&B section without the wandb package is a ConfigError."""
        if self.tracking is None:
            return
        if self.tracking.metrics_jsonl is not None:
            self.tracking.metrics_jsonl.parent.mkdir(parents=True, exist_ok=True)
        config = {"run": self.run_name, "spec": self.spec.to_dict()}
        try:
            self.reporter.tracker = open_tracker(self.spec.metrics, self.tracking, run_name=self.run_name,
                                                 resume_step=self.progress.global_step, config=config,
                                                 warn=lambda msg: log(self.rank, msg))
        except TrackingConfigError as exc:
            raise ConfigError(str(exc)) from None

    # ------------------------------------------------------------------------------------------------ the loop
    def fit(self) -> None:
        if self.progress.step_in_rollout == 0:
            self.sync_weights()  # the weights the next rollout is generated with (version 0: the initial ones)
        while True:
            t0 = time.perf_counter()
            rollout = self.next_rollout()
            self.data_wait = time.perf_counter() - t0  # reported with the rollout's first step
            if rollout is None:
                break
            self.train_rollout(*rollout)
            self.sync_weights()
        self.finish()

    def next_rollout(self) -> tuple[PublishedRollout, RankPayload] | None:
        """The next rollout to train and this rank's payload; None when the stream finished before it."""
        k = self.progress.rollout
        if not self.wait(k):
            return None
        try:
            published = read(self.store, k)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.check_continues(published)
        if published.dp_size != self.dp_size:
            return self.reschedule(published)
        return published, self.store.read_payload(k, self.dp_rank)

    def reschedule(self, published: PublishedRollout) -> tuple[PublishedRollout, RankPayload]:
        """A rollout published for another data-parallel size (the group was resized): re-planned here over this
        group's ranks with the same steps (`trainer/reshard.py`); every rank computes the same plan."""
        k = published.rollout
        old = {r: self.store.read_payload(k, r) for r in range(published.dp_size)}
        try:
            schedule, payloads = reschedule(published.schedule, old, self.dp_size)
        except ValueError as exc:
            raise ConfigError(f"rollout {k}: published for {published.dp_size} data-parallel ranks, cannot be "
                              f"re-scheduled for {self.dp_size}: {exc}") from None
        if self.rank == 0:
            log(self.rank, f"rollout {k}: published for {published.dp_size} data-parallel ranks, re-scheduled for "
                           f"{self.dp_size} (same steps and samples)")
        return dataclasses.replace(published, schedule=schedule, step_tokens=(), imbalance=(),
                                   extra={**published.extra, "published_dp_size": published.dp_size}), \
            payloads[self.dp_rank]

    def train_rollout(self, published: PublishedRollout, payload: RankPayload) -> None:
        steps = published.steps()
        if self.loss.recomputes_old_logprobs:
            payload = self.recompute_old_logprobs(published, payload, steps[self.progress.step_in_rollout:])
        for step in steps[self.progress.step_in_rollout:]:
            self.train_step(published, payload, step)
            if self.checkpoint_due() and step is not steps[-1]:
                self.save_checkpoint()
        if self.tp_rank == 0 and self.pp_rank == 0:  # once per data-parallel rank
            # in the terms of the published rollout: after a resize, this rank acks its share of the old ranks
            old_dp = int(published.extra.get("published_dp_size", self.dp_size))
            for r in acked_ranks(old_dp, self.dp_size, self.dp_rank):
                self.store.ack(published.rollout, r)
        self.progress.rollout, self.progress.step_in_rollout = published.rollout + 1, 0
        if self.checkpoint_due() and self.last_saved != self.progress.global_step:
            self.save_checkpoint()

    def recompute_old_logprobs(self, published: PublishedRollout, payload: RankPayload,
                               steps: list[StepPlan]) -> RankPayload:
        """`policyLoss.oldLogprobs: trainer`: the payload with `old_logprobs`, log π_old of each of its tokens with
        the current weights (a forward-only pass over the micro-batches of `steps`, `step.old_logprobs_pass`).
        Resumed in the middle of a rollout, the current weights are the checkpoint's (after its first steps): π_old
        of the rollout's remaining steps is theirs, and the log says so."""
        from trainingrun.trainer.step import payload_old_logprobs  # deferred: megatron

        t0 = time.perf_counter()
        old = payload_old_logprobs(self.ddp, payload, [published.microbatch_positions(self.dp_rank, step)
                                                       for step in steps], self.loss, self.device)
        self.old_logprob_seconds = time.perf_counter() - t0
        if self.rank == 0 and steps and steps[0].index > 0:
            log(self.rank, f"rollout {published.rollout}: resumed at step {steps[0].index}: pi_old of its remaining "
                           "steps recomputed with the checkpoint's weights (policyLoss.oldLogprobs trainer)")
        return {**payload, "old_logprobs": old}

    def train_step(self, published: PublishedRollout, payload: RankPayload, step: StepPlan) -> dict:
        # deferred: torch and megatron (imported after the device decision, see the module docstring)
        from trainingrun.trainer.batch import step_microbatches
        from trainingrun.trainer.report import step_record, sync_record  # deferred: torch
        from trainingrun.trainer.step import train_step  # deferred: megatron

        mbs = step_microbatches(payload, published.microbatch_positions(self.dp_rank, step), self.device)
        res = train_step(
            self.ddp, self.optimizer, self.scheduler, mbs, self.loss,
            StepTotals(global_batch_size=step.global_batch_size, loss_tokens=step.loss_tokens),
            dp_size=self.dp_size, dp_group=self.dp_group, ref_model=self.ref_model, moe=self.moe,
        )
        p = self.progress
        p.global_step += 1
        p.samples_consumed += step.global_batch_size
        p.tokens_consumed += res.tokens
        p.rollout, p.step_in_rollout = published.rollout, step.index + 1
        k, s = published.rollout, step.index
        if res.samples != step.global_batch_size:
            raise RuntimeError(f"rollout {k} step {s}: trained {res.samples} samples, schedule says "
                               f"{step.global_batch_size}")
        if self.scheduler.num_steps != p.samples_consumed:
            raise RuntimeError(f"LR scheduler consumed {self.scheduler.num_steps} samples, trainer {p.samples_consumed}")
        record = step_record(res=res, step=step, rollout=k, global_step=p.global_step,
                             samples_consumed=p.samples_consumed, scheduler_consumed=int(self.scheduler.num_steps),
                             attempt=self.env.attempt, dp_size=self.dp_size, published=published)
        record["data_wait_seconds"], self.data_wait = self.data_wait, 0.0
        record.update(sync_record(self.sync_seconds, self.sync_bytes))
        self.sync_seconds, self.sync_bytes = 0.0, 0
        if self.loss.recomputes_old_logprobs:
            record["old_logprob_seconds"], self.old_logprob_seconds = self.old_logprob_seconds, 0.0
        self.reporter.report(res, record)
        self.check_engine_logprobs(record)
        return record

    def check_engine_logprobs(self, record: dict) -> None:
        """On-policy steps: the engine's logprobs must be the trainer's (`weightSync.logprobTolerance`); a mismatch is
        a warning, or with `onLogprobMismatch: fail` a configuration error (every rank sees the same reduced value;
        a restart would load the same weights)."""
        from trainingrun.trainer.report import LOGPROB_TOLERANCE, engine_logprob_mismatch  # deferred: torch

        ws = self.spec.weight_sync
        message = engine_logprob_mismatch(record, ws.logprob_tolerance or LOGPROB_TOLERANCE[logprob_dtype(self.spec)])
        if message is None:
            return
        if ws.on_logprob_mismatch == "fail":
            raise ConfigError(f"{message}; failing the run (weightSync.onLogprobMismatch: fail)")
        if self.rank == 0:
            print(f"[trainer 0] warning: {message}", file=sys.stderr, flush=True)

    def sync_weights(self) -> None:
        """Hand the weights after this rollout to the generator (`spec.weightSync`); a no-op without a publisher.

        Collective: every rank calls it (a publisher may gather tensor-parallel shards); the publisher writes from
        rank 0. The version is the number of rollouts trained (`progress.rollout`)."""
        if self.publisher is not None:
            from trainingrun.trainer.optim import params_current  # deferred: torch

            t0 = time.perf_counter()
            params_current(self.ddp)
            self.publisher.publish(self.progress.rollout, self.ddp.module)
            self.sync_seconds = time.perf_counter() - t0
            self.sync_bytes = int(getattr(self.publisher, "last_bytes", 0) or 0)
            if self.rank == 0 and getattr(self.publisher, "last_bytes", 0):
                log(self.rank, f"weights version {self.progress.rollout} published: "
                               f"{self.publisher.last_bytes / 1e6:.2f} MB in {self.publisher.last_seconds:.3f}s")

    def finish(self) -> None:
        p = self.progress
        if self.last_saved != p.global_step and p.global_step > 0:
            self.save_checkpoint()
        elif self.rank == 0 and p.global_step > 0:
            self.store.release_upto(release_point(self.ckpt_root, default=p.rollout))
        log(self.rank, f"done: {p.global_step} steps, {p.samples_consumed} samples, {p.rollout} rollouts")
        self.barrier()

    def linger(self) -> None:
        """Keep serving the final metrics for `metrics.lingerSeconds` (a last scrape sees the final values)."""
        linger = self.spec.metrics.linger_seconds
        if linger and self.reporter.exporter.server is not None:
            log(self.rank, f"serving final metrics for {linger}s (metrics.lingerSeconds)")
            time.sleep(linger)

    def close(self) -> None:
        # deferred: torch and megatron, imported only after the device decision (CPU shim)
        from trainingrun.modeling.model import end_distributed

        if self.publisher is not None:
            self.publisher.close()
        if self.reporter.tracker is not None:
            self.reporter.tracker.close()
        self.reporter.exporter.close()
        self.store.close()
        try:
            end_distributed()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass

    # ------------------------------------------------------------------------------------------------ helpers
    def barrier(self) -> None:
        import torch.distributed as dist  # deferred: torch

        dist.barrier()

    def checkpoint_due(self) -> bool:
        interval = self.spec.trainer.checkpoint.interval
        return bool(interval) and self.progress.global_step % interval == 0

    def save_checkpoint(self) -> None:
        """Collective checkpoint of the current progress (trainer/checkpoint.py). A newer attempt owning the
        checkpoints (this process is a leftover of an older attempt): ConfigError, nothing written."""
        from trainingrun.trainer.optim import params_current  # deferred: torch

        p = self.progress
        params_current(self.ddp)
        try:
            res = self.checkpoints.save(p)
        except CheckpointFenced as exc:
            raise ConfigError(str(exc)) from None
        self.last_saved = p.global_step
        if self.rank == 0:
            # Rollouts older than the oldest kept checkpoint are covered by every checkpoint a resume may fall back
            # to: the store may drop them once all acked.
            self.store.release_upto(res.release_upto)
            log(self.rank, f"checkpoint step {p.global_step} (rollout {p.rollout}+{p.step_in_rollout}) in "
                           f"{res.seconds_total:.2f}s (shards {res.seconds_shards:.2f}s, {res.bytes / 2**20:.1f} MiB)")

    def wait(self, k: int) -> bool:
        """Wait for rollout k's commit with progress output; False when the stream finished before k.

        Rollout k already released (deleted after a checkpoint past it): the store belongs to a run that is further
        along than our checkpoints (a store reused by a fresh run, or checkpoints removed). No restart can fix that,
        so it is a ConfigError naming what to change, not a crash that the launcher/operator would retry.
        """
        timeout = self.env.wait_timeout
        waited = 0.0
        while True:
            chunk = 30.0 if timeout is None else max(min(30.0, timeout - waited), 0.1)
            try:
                return self.store.wait_rollout(k, timeout=chunk)
            except RolloutReleased as exc:
                raise ConfigError(
                    f"store {self.store.url}: rollout {k}, where training resumes (checkpoint in "
                    f"{self.ckpt_root.resolve()}: {'none' if k == 0 else f'rollout {k}'}), was already trained and "
                    f"deleted by an earlier run using this store ({exc}); give this run a fresh store (another redis "
                    "db or ?prefix=NAME, or a new store.url) or resume with the checkpoints of the run that used it"
                ) from None
            except StoreTimeout:
                waited += chunk
                if timeout is not None and waited >= timeout:
                    raise
                log(self.rank, f"waiting for rollout {k} ({waited:.0f}s)")

    def check_continues(self, published: PublishedRollout) -> None:
        """The rollout must fit this trainer group and continue where training stands."""
        k, p = published.rollout, self.progress
        start = p.step_in_rollout
        if start > published.num_steps:
            raise ConfigError(f"rollout {k}: checkpoint resumes at step {start} of a rollout with "
                              f"{published.num_steps} steps (the store does not continue this run's checkpoint)")
        if published.step_offset + start != p.global_step:
            raise ConfigError(
                f"rollout {k}: step_offset {published.step_offset} + {start} != steps trained {p.global_step} "
                "(the store does not continue this run's checkpoint)"
            )
        before = sum(published.global_batch_sizes[:start])
        if published.samples_offset + before != p.samples_consumed:
            raise ConfigError(
                f"rollout {k}: samples_offset {published.samples_offset} + {before} != samples consumed "
                f"{p.samples_consumed} (the store does not continue this run's checkpoint)"
            )

