"""The checkpoint file protocol (trainingrun/trainer/checkpoint.py) in one process: commit, keep-N, verification,
fallback to the previous checkpoint, exit-78 material when none loads, and attempt fencing. The shards are stand-in
files here; tests/integration/test_checkpoint_megatron.py runs the same protocol with Megatron's shards."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from trainingrun.trainer import checkpoint as ckpt
from trainingrun.trainer.checkpoint import CheckpointError, CheckpointFenced, TrainingProgress, Solo


def _shards(tag: str):
    def write(d: Path) -> None:
        (d / "__0_0.distcp").write_bytes(tag.encode() * 1000)
        (d / "common.pt").write_bytes(b"common-" + tag.encode())
    return write


class Loader:
    def __init__(self, fail_on: set[str] = frozenset()):
        self.loaded: list[str] = []
        self.fail_on = fail_on

    def __call__(self, d: Path) -> None:
        tag = (d / "common.pt").read_bytes().decode().removeprefix("common-")
        if tag in self.fail_on:
            raise RuntimeError(f"cannot load {tag}")
        self.loaded.append(tag)


def save(root: Path, step: int, *, rollout: int | None = None, attempt: int = 0, keep: int = 3,
         epoch: int = 0) -> ckpt.SaveResult:
    progress = TrainingProgress(global_step=step, rollout=step if rollout is None else rollout,
                                samples_consumed=10 * step)
    return ckpt.save(root, progress, group=Solo(), write_shards=_shards(f"s{step}"),
                     state=lambda: {"scheduler": {"num_steps": 10 * step}, "rng": ckpt.rng_state()},
                     meta={"run": "t", "dp_size": 2, "tp_size": 1, "model": {"hidden_size": 8}},
                     attempt=attempt, keep=keep, epoch=epoch)


def resume(root: Path, *, attempt: int = 0, loader: Loader | None = None, log: list[str] | None = None,
           epoch: int = 0):
    return ckpt.resume(root, group=Solo(), load_shards=loader or Loader(), attempt=attempt,
                       log=(log.append if log is not None else lambda _m: None), epoch=epoch)


def test_save_commits_a_verified_manifest_and_keeps_n(tmp_path):
    for step in (2, 4, 6):
        result = save(tmp_path, step, keep=2)
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step_00000004", "step_00000006"]
    assert result.path == tmp_path / "step_00000006" and result.bytes > 2000
    marker = json.loads((result.path / ckpt.MARKER).read_text())
    assert marker["format"] == ckpt.FORMAT and marker["attempt"] == 0
    assert sorted(marker["files"]) == ["dist/__0_0.distcp", "dist/common.pt", "meta.json", "progress.json", "state.pt"]
    assert ckpt.verify(result.path) is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert not list(result.path.rglob(".hash-*"))  # the per-rank notes are folded into the marker
    # the store may drop rollouts older than the OLDEST kept checkpoint (the fallback must find its data)
    assert result.release_upto == 4


def test_assets_are_part_of_the_checkpoint(tmp_path):
    def assets(d: Path) -> None:
        (d / "hf").mkdir()
        (d / "hf" / "config.json").write_text('{"model_type": "llama"}')

    result = ckpt.save(tmp_path, TrainingProgress(global_step=3), group=Solo(), write_shards=_shards("a"),
                       state=lambda: {}, meta={}, attempt=0, keep=2, assets=assets)
    assert "hf/config.json" in json.loads((result.path / ckpt.MARKER).read_text())["files"]
    (result.path / "hf" / "config.json").write_text('{"model_type": "llamb"}')  # same size, other bytes
    assert "hf/config.json does not match its SHA-256" in ckpt.verify(result.path)


def test_resume_loads_the_newest(tmp_path):
    for step in (2, 4):
        save(tmp_path, step)
    loader = Loader()
    got = resume(tmp_path, loader=loader)
    assert loader.loaded == ["s4"] and got.progress.global_step == 4 and got.skipped == []
    assert got.state["scheduler"] == {"num_steps": 40} and got.meta["dp_size"] == 2


def test_no_checkpoint_is_a_fresh_start(tmp_path):
    assert resume(tmp_path / "none") is None
    # a half-written newer directory (no marker) is never a candidate
    save(tmp_path, 2)
    bad = tmp_path / "step_00000005"
    bad.mkdir()
    (bad / "progress.json").write_text("{}")
    assert resume(tmp_path).progress.global_step == 2


@pytest.mark.parametrize("damage, why", [
    ("truncate", r"dist/__0_0\.distcp has 100 bytes, 2000 were written \(truncated or replaced\)"),
    ("flip", r"dist/__0_0\.distcp does not match its SHA-256"),
    ("delete", r"dist/__0_0\.distcp is missing"),
    ("marker", r"COMPLETE is unreadable"),
])
def test_newest_damaged_falls_back_to_the_previous_and_names_why(tmp_path, damage, why):
    for step in (2, 4):
        save(tmp_path, step)
    newest = tmp_path / "step_00000004"
    shard = newest / "dist" / "__0_0.distcp"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(shard.read_bytes())
        data[1234] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "delete":
        shard.unlink()
    else:
        (newest / ckpt.MARKER).write_text('{"format": 2, "files": {"dist/__0')
    log: list[str] = []
    loader = Loader()
    got = resume(tmp_path, attempt=1, loader=loader, log=log)
    assert loader.loaded == ["s2"] and got.progress.global_step == 2  # nothing of the damaged one was loaded
    assert got.skipped[0][0] == newest
    text = "\n".join(log)
    assert str(newest) in text and "trying the previous one" in text
    import re

    assert re.search(why, text), text
    # set aside under a name that is never loaded or pruned, so the next resume does not trip over it again
    assert not newest.exists() and (tmp_path / "step_00000004.unloadable-a1").is_dir()
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step_00000002"]


def test_load_error_falls_back_too(tmp_path):
    for step in (2, 4):
        save(tmp_path, step)
    log: list[str] = []
    got = resume(tmp_path, loader=Loader(fail_on={"s4"}), log=log)
    assert got.progress.global_step == 2
    assert "loading failed: RuntimeError: cannot load s4" in "\n".join(log)


def test_none_loadable_names_every_path_and_keeps_them(tmp_path):
    for step in (2, 4):
        save(tmp_path, step)
    for step in (2, 4):
        shard = tmp_path / f"step_{step:08d}" / "dist" / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(CheckpointError) as err:
        resume(tmp_path)
    msg = str(err.value)
    assert not isinstance(err.value, CheckpointFenced)
    for step in (2, 4):
        assert f"step_{step:08d}: dist/__0_0.distcp has 10 bytes, 2000 were written" in msg
    assert "restore a good checkpoint" in msg
    # nothing renamed: a fixed configuration or a restored file must find them where they were
    assert len(ckpt.complete_checkpoints(tmp_path)) == 2


def test_metadata_pickle_with_a_foreign_global_is_refused(tmp_path):
    save(tmp_path, 2)
    save(tmp_path, 4)
    # a checkpoint whose torch metadata would run code on load: refused by the allow-list, even with a valid hash
    d = tmp_path / "step_00000004"
    evil = pickle.dumps(print)  # builtins.print: not a checkpoint class
    (d / "dist" / ".metadata").write_bytes(evil)
    marker = json.loads((d / ckpt.MARKER).read_text())
    marker["files"]["dist/.metadata"] = ckpt.digest(d / "dist" / ".metadata")
    (d / ckpt.MARKER).write_text(json.dumps(marker))
    assert "global builtins.print is not allowed" in ckpt.verify(d)
    assert resume(tmp_path).progress.global_step == 2


def test_metadata_pickle_of_torch_dcp_is_allowed(tmp_path):
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )

    meta = Metadata(state_dict_metadata={"w": TensorStorageMetadata(
        TensorProperties(dtype=torch.bfloat16), torch.Size([4, 2]), [ChunkStorageMetadata(torch.Size([0, 0]),
                                                                                           torch.Size([4, 2]))])},
        storage_data={MetadataIndex("w", torch.Size([0, 0])): "x"})
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(meta))
    ckpt.check_metadata_pickle(path)


def test_older_attempt_cannot_commit_prune_or_resume(tmp_path):
    save(tmp_path, 2, attempt=3)
    resume(tmp_path, attempt=5)  # attempt 5 takes over: recorded in the fence
    assert ckpt.newest_attempt(tmp_path) == 5
    with pytest.raises(CheckpointFenced, match=r"attempt 3 may not commit step_00000004: attempt 5 has resumed"):
        save(tmp_path, 4, attempt=3)  # a zombie of attempt 3
    assert not (tmp_path / "step_00000004").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    with pytest.raises(CheckpointFenced):
        ckpt.prune(tmp_path, 1, attempt=4)
    with pytest.raises(CheckpointFenced, match="give it another trainer.checkpoint.path"):
        resume(tmp_path, attempt=4)
    # the newer attempt itself (and later ones) carry on
    assert save(tmp_path, 4, attempt=5).path.name == "step_00000004"
    assert save(tmp_path, 6, attempt=6).path.name == "step_00000006"
    assert json.loads((tmp_path / "step_00000006" / "progress.json").read_text())["attempt"] == 6


def test_a_re_created_run_takes_the_checkpoints_over_and_fences_the_old_run_off(tmp_path):
    # A TrainingRun deleted and re-created with the same name over the same volume starts again at attempt 0, with
    # a later creation time (TRAININGRUN_RUN_EPOCH). Before, its attempt 0 was refused (exit 78) by the old run's
    # attempt 3 recorded in the fence, so the re-created run could never start.
    old, new = 1_700_000_000, 1_700_000_600
    save(tmp_path, 2, attempt=0, epoch=old)
    resume(tmp_path, attempt=3, epoch=old)
    save(tmp_path, 4, attempt=3, epoch=old)
    log: list[str] = []
    got = resume(tmp_path, attempt=0, epoch=new, log=log)
    assert got is not None and got.progress.global_step == 4
    assert any("taking the checkpoints over from the run created 2023-11-14T22:13:20Z (its attempt 3)" in m
               for m in log), log
    assert ckpt.newest_fence(tmp_path) == (new, 0) and ckpt.newest_attempt(tmp_path) == 0
    # the old run's leftover (a trainer on a lost node) may no longer commit, prune or resume
    with pytest.raises(CheckpointFenced, match=r"attempt 3 may not commit step_00000006: a run created later "
                                               r"\(2023-11-14T22:23:20Z, attempt 0\)"):
        save(tmp_path, 6, attempt=3, epoch=old)
    with pytest.raises(CheckpointFenced):
        ckpt.prune(tmp_path, 1, attempt=9, epoch=old)
    with pytest.raises(CheckpointFenced, match="deleted and re-created with the same name"):
        resume(tmp_path, attempt=4, epoch=old)
    # the new run carries on, and its own restarts are ordered after its attempt 0
    assert save(tmp_path, 6, attempt=0, epoch=new).path.name == "step_00000006"
    resume(tmp_path, attempt=1, epoch=new)
    with pytest.raises(CheckpointFenced, match="attempt 0 may not commit step_00000008: attempt 1 has resumed"):
        save(tmp_path, 8, attempt=0, epoch=new)
    # a fence written before epochs existed (plain attempt names) counts as epoch 0: every re-created run is newer
    legacy = tmp_path / "legacy"
    save(legacy, 2, attempt=7)
    resume(legacy, attempt=7)
    assert sorted(p.name for p in (legacy / ckpt.FENCE_DIR).iterdir()) == ["00000007"]
    assert resume(legacy, attempt=0, epoch=new) is not None


def test_prune_orders_temporary_directories_by_run_and_attempt(tmp_path):
    save(tmp_path, 2, attempt=1, epoch=500)
    (tmp_path / ".tmp-step_00000004-e500-a2").mkdir()  # the same run's attempt 2, writing right now
    (tmp_path / ".tmp-step_00000004-e900-a0").mkdir()  # a re-created run's attempt 0, writing right now
    (tmp_path / ".tmp-step_00000003-a5").mkdir()  # left by a run before epochs (epoch 0)
    (tmp_path / ".tmp-step_00000003-e500-a0").mkdir()  # left by a crashed attempt 0 of this run
    ckpt.prune(tmp_path, 2, attempt=1, epoch=500)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")) == [
        ".tmp-step_00000004-e500-a2", ".tmp-step_00000004-e900-a0"]


def test_commit_is_fenced_when_a_newer_attempt_starts_during_the_write(tmp_path):
    """The fence is checked again right before the rename: a takeover while shards were written still wins."""
    root = tmp_path

    def write(d: Path) -> None:
        _shards("late")(d)
        ckpt.record_attempt(root, 9)  # attempt 9 resumes while attempt 2 is writing

    with pytest.raises(CheckpointFenced, match="attempt 2 may not commit"):
        ckpt.save(root, TrainingProgress(global_step=8), group=Solo(), write_shards=write, state=lambda: {},
                  meta={}, attempt=2, keep=2)
    assert ckpt.complete_checkpoints(root) == []


def test_prune_leaves_newer_attempts_temporary_directories(tmp_path):
    save(tmp_path, 2, attempt=1)
    (tmp_path / ".tmp-step_00000004-a2").mkdir()  # attempt 2 writing right now
    (tmp_path / ".tmp-step_00000003-a0").mkdir()  # left by a crashed attempt 0
    ckpt.prune(tmp_path, 2, attempt=1)
    names = {p.name for p in tmp_path.iterdir()}
    assert ".tmp-step_00000004-a2" in names and ".tmp-step_00000003-a0" not in names


def test_same_step_saved_again_replaces_it(tmp_path):
    save(tmp_path, 4, attempt=0)
    save(tmp_path, 4, attempt=1)
    [only] = ckpt.complete_checkpoints(tmp_path)
    assert json.loads((only / "meta.json").read_text())["attempt"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".old-")]


# ------------------------------------------------------------------------------------------------ full volume
def _full_volume_save(root: Path, *, write_shards=None, assets=None) -> ckpt.SaveResult:
    progress = TrainingProgress(global_step=4, rollout=4, samples_consumed=40)
    return ckpt.save(root, progress, group=Solo(), write_shards=write_shards or _shards("s4"),
                     state=lambda: {"scheduler": {"num_steps": 40}, "rng": ckpt.rng_state()},
                     meta={"run": "t"}, attempt=0, keep=3, assets=assets)


def _writer_failure(d: Path) -> None:
    # what a rank sees from Megatron's shard writer: the worker's OSError as text, under torch's CheckpointException
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    (d / "__0_0.distcp").write_bytes(b"partial")
    try:
        raise RuntimeError("Worker failure: [Errno 28] No space left on device")
    except RuntimeError as exc:
        failure = _wrap_exception(exc)
    from trainingrun.trainer.checkpoint_megatron import ShardsFailed

    raise ShardsFailed("writing the checkpoint shards", d, CheckpointException("write", {1: failure}))


def _commit_failure(d: Path) -> None:
    raise OSError(28, "No space left on device", str(d / "hf" / "tokenizer.json"))


@pytest.mark.parametrize("where", ["shards", "commit"])
def test_a_full_volume_is_one_oserror_naming_the_root_and_nothing_half_written(tmp_path, where):
    # Before: the shard writer's failure escaped as a CheckpointException (a BaseException: a traceback past every
    # handler) and the commit's as a CheckpointError, neither told apart from other failures (trainer/main.py).
    save(tmp_path, 2)
    kw = {"write_shards": _writer_failure} if where == "shards" else {"assets": _commit_failure}
    with pytest.raises(OSError) as info:
        _full_volume_save(tmp_path, **kw)
    assert info.value.errno == 28 and info.value.filename == str(tmp_path)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []  # the partial one removed
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step_00000002"]


def test_other_failures_of_a_save_pass_unchanged(tmp_path):
    def broken(d: Path) -> None:
        raise ValueError("a bug, not a full disk")

    with pytest.raises(ValueError, match="a bug"):
        _full_volume_save(tmp_path, write_shards=broken)
    with pytest.raises(CheckpointError, match="cannot commit checkpoint step_00000004"):
        _full_volume_save(tmp_path, assets=lambda d: (_ for _ in ()).throw(PermissionError(13, "denied")))


def test_a_shard_failure_without_the_errno_is_a_full_volume_when_the_volume_is_full(tmp_path, monkeypatch):
    # rank 1 of torch's writer: a CheckpointException without failures (they went to rank 0); the volume decides
    from torch.distributed.checkpoint.api import CheckpointException

    from trainingrun import diskspace
    from trainingrun.trainer.checkpoint_megatron import ShardsFailed

    def peer_failure(d: Path) -> None:
        raise ShardsFailed("writing the checkpoint shards", d, CheckpointException("write", {}))

    with pytest.raises(ShardsFailed, match=r"on another rank"):  # the volume has room: not a full disk
        _full_volume_save(tmp_path, write_shards=peer_failure)
    full = os.statvfs_result((4096, 4096, 16384, 0, 0, 1000, 0, 0, 0, 255))  # 64 MiB, nothing available
    monkeypatch.setattr(diskspace.os, "statvfs", lambda _path: full)
    with pytest.raises(OSError) as info:
        _full_volume_save(tmp_path, write_shards=peer_failure)
    assert info.value.errno == 28 and "no space left on the volume holding" in str(info.value)


def test_the_distributed_optimizers_state_is_refused_at_another_pipeline_parallel_size(tmp_path):
    """Its shards are per pipeline stage as they are per tensor-parallel rank: refused before anything loads, naming
    the field; the plain optimizer's state reshards across pipeline sizes (tests/integration/test_trainer_pipeline.py)."""
    from trainingrun.trainer.checkpoint_megatron import optimizer_format_problem

    d = tmp_path / "step_00000004"
    d.mkdir()
    (d / "meta.json").write_text(json.dumps({"optimizer": "distributed", "tp_size": 1, "dp_size": 2, "pp_size": 2}))
    (d / "COMPLETE").write_text("{}")
    here = {"optimizer": "distributed", "tp_size": 1, "dp_size": 4, "pp_size": 2}
    assert optimizer_format_problem(tmp_path, here) is None  # another data-parallel size, the same stages
    assert optimizer_format_problem(tmp_path, {**here, "pp_size": 1}) == (
        f"checkpoint {d} holds the distributed optimizer's state at pipeline-parallel 2: it loads at any "
        "data-parallel size, not at pipeline-parallel 1; allowed: trainer.pipelineParallelSize 2")
    (d / "meta.json").write_text(json.dumps({"optimizer": "plain", "tp_size": 1, "dp_size": 2, "pp_size": 2}))
    assert optimizer_format_problem(tmp_path, {**here, "optimizer": "plain", "pp_size": 1}) is None
