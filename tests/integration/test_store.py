"""One test suite for both store backends: a temp directory (file://) and a real redis-server (redis://).

Fault tests: a writer SIGKILLed between payloads and commit, Redis restarted while a reader waits, corrupted and
pickled payloads, a full volume (/dev/full) and permission denied on the file backend.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from trainingrun.store import CorruptPayload, StoreError, StoreTimeout, open_store
from trainingrun.store import file_io

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------------- helpers
def make_payload(rng: np.random.Generator, n: int, max_len: int = 50, id_base: int = 0) -> dict[str, np.ndarray]:
    lengths = rng.integers(2, max_len, size=n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    return {
        "tokens": rng.integers(0, 1000, size=total, dtype=np.int32),
        "offsets": offsets,
        "loss_mask": (rng.random(total) < 0.5).astype(np.uint8),
        "advantages": rng.standard_normal(n).astype(np.float32),
        "rewards": rng.random(n).astype(np.float32),
        "sample_ids": np.arange(id_base, id_base + n, dtype=np.int64),
    }


def make_rollout(rollout: int, dp: int, seed: int = 0) -> tuple[dict[int, dict[str, np.ndarray]], dict]:
    rng = np.random.default_rng([seed, rollout])
    payloads = {r: make_payload(rng, int(rng.integers(1, 6)), id_base=100 * r) for r in range(dp)}
    schedule = {
        "rollout": rollout,
        "dp_size": dp,
        "global_batch_sizes": [sum(len(p["sample_ids"]) for p in payloads.values())],
        "loss_tokens": [int(sum(int(p["loss_mask"].sum()) for p in payloads.values()))],
    }
    return payloads, schedule


def assert_payload_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def payload_location(store, rollout: int, rank: int):
    """Where a committed payload is stored (a path or a Redis key), to tamper with it as a broken disk or a
    malicious writer would."""
    if store.url.startswith("file"):
        return store.payload_path(rollout, rank)
    return store.payload_key(rollout, rank)


def overwrite_payload(store, rollout: int, rank: int, data: bytes) -> None:
    where = payload_location(store, rollout, rank)
    if isinstance(where, Path):
        where.write_bytes(data)
    else:
        store.client.set(where, data)


def stored_payload(store, rollout: int, rank: int) -> bytes:
    where = payload_location(store, rollout, rank)
    return where.read_bytes() if isinstance(where, Path) else store.client.get(where)


@pytest.fixture(params=["file", "redis"])
def store(request, tmp_path):
    if request.param == "file":
        s = open_store(f"file://{tmp_path}/store")
    else:
        server = request.getfixturevalue("redis")
        s = open_store(server.url + "?retry_seconds=20")
        s.server = server
    yield s
    s.close()


# ----------------------------------------------------------------------------------------------------- open_store
def test_open_store_schemes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rel = open_store("file://rel/dir")
    assert rel.root == tmp_path / "rel" / "dir" and rel.root.is_dir()
    assert open_store(f"file://{tmp_path}/abs").root == tmp_path / "abs"
    for bad in ("s3://bucket/x", "/just/a/path", "", "http://x"):
        with pytest.raises(ValueError, match="store url"):
            open_store(bad)
    with pytest.raises(ValueError, match="redis://host:port/db"):
        open_store("redis://127.0.0.1:6379/notadb")


# ----------------------------------------------------------------------------------------------------- protocol
def test_publish_and_read_each_rank(store):
    payloads, schedule = make_rollout(0, dp=3)
    assert store.publish_rollout(0, payloads, schedule) is True
    assert store.wait_rollout(0, timeout=5) is True
    assert store.read_schedule(0) == schedule
    for rank in range(3):
        assert_payload_equal(store.read_payload(0, rank), payloads[rank])
    with pytest.raises(StoreError, match="rank 7"):
        store.read_payload(0, 7)


def test_wait_times_out_naming_store_and_key(store):
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout) as info:
        store.wait_rollout(4, timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 3
    assert store.url in str(info.value) and "rollout 4" in str(info.value)
    with pytest.raises(StoreError, match="not committed"):
        store.read_payload(4, 0)


def test_waiter_wakes_when_published(store):
    result = {}
    waiter = threading.Thread(target=lambda: result.update(ok=store.wait_rollout(1, timeout=10)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()
    store.publish_rollout(1, *make_rollout(1, dp=2))
    waiter.join(5)
    assert result == {"ok": True}


def test_republish_is_idempotent(store):
    payloads, schedule = make_rollout(2, dp=2)
    assert store.publish_rollout(2, payloads, schedule)
    other_payloads, other_schedule = make_rollout(2, dp=2, seed=99)
    assert store.publish_rollout(2, other_payloads, other_schedule) is False
    assert store.read_schedule(2) == schedule
    assert_payload_equal(store.read_payload(2, 1), payloads[1])
    assert store.pending_rollouts() == 1


def test_finish_ends_the_stream(store):
    store.publish_rollout(0, *make_rollout(0, dp=1))
    store.finish(1)
    assert store.wait_rollout(0, timeout=1) is True
    t0 = time.monotonic()
    assert store.wait_rollout(1, timeout=5) is False
    assert store.wait_rollout(5, timeout=5) is False
    assert time.monotonic() - t0 < 2


def test_acks_pending_and_retention(store):
    for k in range(3):
        store.publish_rollout(k, *make_rollout(k, dp=2))
    assert store.pending_rollouts() == 3
    store.ack(0, 0)
    assert store.pending_rollouts() == 3  # rank 1 has not acknowledged rollout 0
    store.ack(0, 1)
    store.ack(0, 1)  # acking twice counts once
    store.ack(1, 0)
    assert store.pending_rollouts() == 2
    # A checkpoint covers rollouts < 2, but rollout 1 lacks rank 1's ack: only rollout 0 may go.
    store.release_upto(2)
    with pytest.raises(StoreError, match="released"):
        store.wait_rollout(0, timeout=1)
    assert store.wait_rollout(1, timeout=1) and store.read_schedule(1)["rollout"] == 1
    store.ack(1, 1)
    # Acknowledged but not covered by a checkpoint: a restarted trainer group can still re-read it.
    store.release_upto(1)
    assert_payload_equal(store.read_payload(1, 1), make_rollout(1, dp=2)[0][1])
    store.release_upto(3)  # rollout 2 is not acknowledged: kept
    assert not store.is_committed(1)
    assert store.wait_rollout(2, timeout=1) and store.pending_rollouts() == 1


def test_put_get_json(store):
    assert store.get_json("progress") is None
    value = {"step": 3, "samples_consumed": 40, "last_global_batch_size": 12, "rollout": 1, "updated_at": 1.5}
    store.put_json("progress", value)
    assert store.get_json("progress") == value
    store.put_json("progress", {**value, "step": 4})
    assert store.get_json("progress")["step"] == 4
    for bad in ("../etc", "a/b", "", ".hidden", "x" * 200):
        with pytest.raises(ValueError, match="key"):
            store.put_json(bad, value)
    with pytest.raises(ValueError, match="JSON"):
        store.put_json("nan", {"x": float("nan")})


def test_bad_publish_arguments_name_the_field(store):
    payloads, schedule = make_rollout(0, dp=2)
    with pytest.raises(ValueError, match=r"payloads: must have exactly the ranks 0\.\.2"):
        store.publish_rollout(0, payloads, {**schedule, "dp_size": 3})
    bad = {**payloads[1], "tokens": payloads[1]["tokens"].astype(np.int64)}
    with pytest.raises(ValueError, match=r"payloads\[1\]\.tokens: dtype must be int32"):
        store.publish_rollout(0, {0: payloads[0], 1: bad}, schedule)
    bad = {**payloads[0], "offsets": payloads[0]["offsets"][:-1]}
    with pytest.raises(ValueError, match=r"payloads\[0\]\.offsets"):
        store.publish_rollout(0, {0: bad, 1: payloads[1]}, schedule)
    assert not store.is_committed(0) and store.pending_rollouts() == 0


# ----------------------------------------------------------------------------------------------------- faults
class PickleBomb:
    """Unpickling this would create a marker file: proof that something unpickled store data."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_in_the_store_is_rejected(store, tmp_path):
    store.publish_rollout(0, *make_rollout(0, dp=2))
    marker = tmp_path / "unpickled"
    overwrite_payload(store, 0, 1, pickle.dumps(PickleBomb(str(marker))))
    with pytest.raises(CorruptPayload, match="pickle") as info:
        store.read_payload(0, 1)
    assert "rank-00001" in str(info.value) or ":p:1" in str(info.value)  # names the key
    assert not marker.exists()
    # np.save with a pickled object array is refused too (the store never passes allow_pickle=True).
    import io

    buf = io.BytesIO()
    np.save(buf, np.array([PickleBomb(str(marker))], dtype=object), allow_pickle=True)
    overwrite_payload(store, 0, 1, buf.getvalue())
    with pytest.raises(CorruptPayload, match="bad magic"):
        store.read_payload(0, 1)
    assert not marker.exists()
    assert_payload_equal(store.read_payload(0, 0), make_rollout(0, dp=2)[0][0])  # the other rank is unaffected


def test_corrupted_payload_is_a_clear_error_every_time(store):
    payloads, schedule = make_rollout(0, dp=1)
    store.publish_rollout(0, payloads, schedule)
    good = stored_payload(store, 0, 0)
    flipped = bytearray(good)
    at = good.find(payloads[0]["tokens"].tobytes())
    assert at > 0
    flipped[at + 5] ^= 0x10  # one bit flipped inside the token buffer
    overwrite_payload(store, 0, 0, bytes(flipped))
    for _ in range(2):  # same answer again: a restarted reader fails the same clear way, no hang, no crash
        with pytest.raises(CorruptPayload, match="checksum"):
            store.read_payload(0, 0)
    overwrite_payload(store, 0, 0, good[: len(good) // 2])
    with pytest.raises(CorruptPayload, match="truncated"):
        store.read_payload(0, 0)
    overwrite_payload(store, 0, 0, good)
    assert_payload_equal(store.read_payload(0, 0), payloads[0])


def test_writer_killed_before_commit_is_invisible_then_republished(store):
    child = (
        "import os, signal, sys\n"
        "from trainingrun.store import open_store\n"
        "from tests.integration.test_store import make_rollout\n"
        "store = open_store(sys.argv[1])\n"
        "payloads, schedule = make_rollout(3, dp=3)\n"
        "store.publish_rollout(3, payloads, schedule, _after_payloads=lambda: os.kill(os.getpid(), signal.SIGKILL))\n"
    )
    proc = subprocess.run([sys.executable, "-c", child, store.url], cwd=ROOT, capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr.decode()
    # The payloads reached the store, the commit did not: readers see nothing.
    written = (store._ddir(3, None) / "rank-00002.bin").read_bytes() if store.url.startswith("file") \
        else store.client.get(store._payload_key(3, None, 2))
    assert len(written) > 0
    assert not store.is_committed(3) and store.pending_rollouts() == 0
    with pytest.raises(StoreTimeout):
        store.wait_rollout(3, timeout=0.3)
    with pytest.raises(StoreError, match="not committed"):
        store.read_payload(3, 0)
    # The restarted writer publishes again: now complete.
    payloads, schedule = make_rollout(3, dp=3)
    assert store.publish_rollout(3, payloads, schedule) is True
    assert store.wait_rollout(3, timeout=1)
    for rank in range(3):
        assert_payload_equal(store.read_payload(3, rank), payloads[rank])
    if store.url.startswith("file"):
        assert not list((store.root / "rollouts").rglob(".tmp.*"))


def test_redis_restart_while_waiting(redis):
    store = open_store(redis.url + "?retry_seconds=30")
    result: dict = {}

    def wait() -> None:
        try:
            result["ok"] = store.wait_rollout(0, timeout=30)
        except Exception as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)
    redis.restart(down_seconds=1.0)
    assert waiter.is_alive(), result
    writer = open_store(redis.url)
    writer.publish_rollout(0, *make_rollout(0, dp=1))
    waiter.join(15)
    assert result == {"ok": True}


def test_redis_down_is_a_clear_permanent_error(redis):
    store = open_store(redis.url + "?retry_seconds=0.5")
    redis.stop()
    t0 = time.monotonic()
    with pytest.raises(StoreError) as info:
        store.put_json("progress", {"step": 1})
    assert time.monotonic() - t0 < 5
    assert redis.url in str(info.value) and "trainingrun:kv:progress" in str(info.value)
    with pytest.raises(StoreTimeout):
        store.wait_rollout(0, timeout=0.5)


def test_file_store_full_leaves_no_half_rollout(tmp_path, monkeypatch):
    store = open_store(f"file://{tmp_path}/store")
    payloads, schedule = make_rollout(0, dp=3)
    real_write_all = file_io._write_all
    calls = {"n": 0}

    def write_to_full_device(fd, chunk):
        calls["n"] += 1
        if calls["n"] > 3:  # after a few chunks, the volume is "full": the bytes go to /dev/full (ENOSPC)
            full = os.open("/dev/full", os.O_WRONLY)
            try:
                real_write_all(full, chunk)
            finally:
                os.close(full)
        else:
            real_write_all(fd, chunk)

    monkeypatch.setattr(file_io, "_write_all", write_to_full_device)
    with pytest.raises(StoreError, match="volume is full") as info:
        store.publish_rollout(0, payloads, schedule)
    assert str(store.root) in str(info.value)
    assert not store.is_committed(0) and store.pending_rollouts() == 0
    assert not list(store.root.rglob(".tmp.*"))  # no temporary file left behind
    monkeypatch.setattr(file_io, "_write_all", real_write_all)
    assert store.publish_rollout(0, payloads, schedule)
    assert_payload_equal(store.read_payload(0, 2), payloads[2])


def test_file_store_permission_denied(tmp_path):
    root = Path(tempfile.mkdtemp(prefix="trainingrun-ro-"))
    try:
        os.chmod(root, 0o755)
        # created (and first written: its epoch) by us; the writer below runs as another user
        open_store(f"file://{root}/store").put_json("created", {"by": "test"})
        os.chmod(root / "store" / "rollouts", 0o555)
        child = (
            "import os, sys\n"
            "from trainingrun.store import open_store, StoreError\n"
            "from tests.integration.test_store import make_rollout\n"
            "store = open_store(sys.argv[1])\n"
            "payloads, schedule = make_rollout(0, dp=1)\n"
            "if os.getuid() == 0:\n"
            "    os.setgid(65534); os.setuid(65534)  # root ignores file modes: become nobody\n"
            "try:\n"
            "    store.publish_rollout(0, payloads, schedule)\n"
            "except StoreError as exc:\n"
            "    print(exc); sys.exit(3)\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", child, f"file://{root}/store"], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 3, proc.stderr
        assert "permission denied" in proc.stdout and f"{root}/store/rollouts/00000000" in proc.stdout
        assert not open_store(f"file://{root}/store").is_committed(0)
    finally:
        os.chmod(root / "store" / "rollouts", 0o755)
        import shutil

        shutil.rmtree(root, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------- weights
def make_weights(version: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(version)
    return {"embedding.weight": rng.standard_normal((7, 5)).astype(np.float32),
            "layers.0.bias": rng.standard_normal(5).astype(np.float32),
            "bf16.as.uint16": rng.integers(0, 2**16, size=(3, 4), dtype=np.uint16)}


def test_weights_round_trip_latest_and_release(store):
    assert store.latest_weights() is None
    for v in range(3):
        assert store.publish_weights(v, make_weights(v), {"version": v, "dtypes": {"bf16.as.uint16": "bfloat16"}})
    assert store.publish_weights(2, make_weights(9), {}) is False  # committed: a re-publish writes nothing
    assert store.latest_weights() == 2
    arrays, meta = store.read_weights(1)
    assert meta == {"version": 1, "dtypes": {"bf16.as.uint16": "bfloat16"}}
    assert_payload_equal(arrays, make_weights(1))
    store.release_weights_below(2)
    assert store.latest_weights() == 2
    with pytest.raises(StoreError, match="weight version 1 is not committed"):
        store.read_weights(1)
    assert_payload_equal(store.read_weights(2)[0], make_weights(2))
    with pytest.raises(ValueError, match="dtype object cannot be stored"):
        store.publish_weights(3, {"x": np.array([object()])}, {})


def test_weight_publish_killed_halfway_is_never_visible(store):
    """A trainer killed after writing a version's tensors but before its commit: the engine keeps seeing the previous
    version (never half of the new one); the restarted trainer's re-publish completes it."""
    store.publish_weights(4, make_weights(4), {})
    child = (
        "import os, signal, sys\n"
        "from trainingrun.store import open_store\n"
        "from tests.integration.test_store import make_weights\n"
        "store = open_store(sys.argv[1])\n"
        "store.publish_weights(5, make_weights(5), {}, _after_tensors=lambda: os.kill(os.getpid(), signal.SIGKILL))\n"
    )
    proc = subprocess.run([sys.executable, "-c", child, store.url], cwd=ROOT, capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr.decode()
    assert store.latest_weights() == 4
    with pytest.raises(StoreError, match="not committed"):
        store.read_weights(5)
    assert store.publish_weights(5, make_weights(5), {"again": True}) is True
    assert store.latest_weights() == 5
    arrays, meta = store.read_weights(5)
    assert meta == {"again": True}
    assert_payload_equal(arrays, make_weights(5))


def test_payload_optional_rl_fields_round_trip(store):
    payloads, schedule = make_rollout(0, dp=1)
    p = payloads[0]
    p["logprobs"] = -np.random.default_rng(1).random(len(p["tokens"])).astype(np.float32)
    p["versions"] = np.full(len(p["sample_ids"]), 3, np.int64)
    store.publish_rollout(0, payloads, schedule)
    assert_payload_equal(store.read_payload(0, 0), p)
