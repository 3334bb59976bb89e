"""A full volume told apart from other failures (`trainingrun/diskspace.py`), however a writer reported it."""

from __future__ import annotations

import errno
import os

import pytest

from trainingrun import diskspace


def _checkpoint_exception(failures: dict):
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    wrapped = {}
    for rank, exc in failures.items():
        try:
            raise exc
        except BaseException as raised:  # noqa: BLE001 - only to give it a traceback, as torch's writer does
            wrapped[rank] = _wrap_exception(raised)
    return CheckpointException("write", wrapped)


def test_the_errno_is_found_however_the_oserror_was_wrapped():
    plain = OSError(errno.ENOSPC, "No space left on device", "/vol/x")
    assert diskspace.no_space(plain) is plain
    try:
        try:
            raise plain
        except OSError as inner:
            raise RuntimeError("writing failed") from inner
    except RuntimeError as outer:
        assert diskspace.no_space(outer) is plain  # by its cause
    # torch's checkpoint writer: each rank's exception gathered to one rank, Megatron's worker made the OSError text
    # (before: not found, so the rank that gathered them ended in a traceback)
    gathered = _checkpoint_exception({0: ValueError("fine"), 1: RuntimeError("Worker failure: [Errno 28] No space "
                                                                           "left on device")})
    found = diskspace.no_space(gathered)
    assert found is not None and found.errno == errno.ENOSPC
    quota = diskspace.no_space(RuntimeError("Worker failure: [Errno 122] Disk quota exceeded"))
    assert quota is not None and quota.errno == errno.EDQUOT


@pytest.mark.parametrize("exc", [
    RuntimeError("Worker failure: [Errno 13] Permission denied"),
    OSError(errno.EIO, "I/O error"),
    ValueError("no errno at all"),
])
def test_other_failures_are_not_a_full_volume(exc):
    assert diskspace.no_space(exc) is None
    assert diskspace.no_space(_checkpoint_exception({1: exc})) is None


def test_describe_names_the_volume_or_falls_back_to_the_given_paths(tmp_path, monkeypatch):
    line = diskspace.describe(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "f")))
    assert line is not None and line.startswith(f"no space left on the volume holding {tmp_path / 'f'} (")
    peer = _checkpoint_exception({})  # a rank whose writer failed elsewhere: no errno to find
    assert diskspace.describe(peer, [tmp_path]) is None  # the volume has room
    full = os.statvfs_result((4096, 4096, 16384, 0, 0, 1000, 0, 0, 0, 255))
    monkeypatch.setattr(diskspace.os, "statvfs", lambda _path: full)
    assert diskspace.describe(peer, [tmp_path]).startswith(f"no space left on the volume holding {tmp_path} (0 B")


def test_usage_counts_allocated_blocks_and_a_volume_is_full_below_what_is_needed(tmp_path):
    ckpt = tmp_path / "step_00000003"
    (ckpt / "dist").mkdir(parents=True)
    (ckpt / "dist" / "shard").write_bytes(os.urandom(300_000))
    (ckpt / "state.pt").write_bytes(b"x" * 10)  # one block however small
    used = diskspace.usage(ckpt)
    assert used >= 300_010 and used % 512 == 0
    assert used == sum(p.stat().st_blocks * 512 for p in ckpt.rglob("*") if p.is_file())
    assert diskspace.usage(tmp_path / "gone") == 0
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    assert diskspace.full_volume([tmp_path], free // 2, what="a checkpoint") is None
    line = diskspace.full_volume([tmp_path], free + (1 << 30), what="a checkpoint")
    assert line is not None and line.startswith(f"no space left on the volume holding {tmp_path} (")
    assert "; a checkpoint takes " in line


def test_a_need_that_reads_like_the_free_space_is_said_in_bytes(tmp_path, monkeypatch):
    st = os.statvfs_result((4096, 4096, 16384, 0, 435, 1000, 0, 0, 0, 255))  # 435 blocks: 1.7 MiB free
    monkeypatch.setattr(diskspace.os, "statvfs", lambda _path: st)
    line = diskspace.full_volume([tmp_path], 1_800_000, what="a checkpoint")
    assert "(1.7 MiB free of 64.0 MiB; a checkpoint takes 1800000 B (free: 1781760 B))" in line
    line = diskspace.full_volume([tmp_path], 3 << 20, what="a checkpoint")
    assert "(1.7 MiB free of 64.0 MiB; a checkpoint takes 3.0 MiB)" in line
