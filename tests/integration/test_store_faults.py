"""Store faults on both backends (a temp directory and a real redis-server): attempt fencing and the single writer,
lost data (a Redis restarted without persistence, a wiped directory, evicted keys), corrupt and malformed stored
values, and hostile files at store paths. Real processes where the fault is about processes (a zombie writer of an
older attempt, two rollout writers started at the same moment, a writer killed while holding the claim)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.test_store import assert_payload_equal, make_rollout, overwrite_payload, stored_payload
from tests.services import redis_server
from trainingrun.store import (
    CorruptPayload,
    StaleAttempt,
    StoreDataLost,
    StoreTimeout,
    WriterConflict,
    open_store,
)
from trainingrun.store.wire import MAGIC

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["file", "redis"])
def url(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path}/store"
    server = request.getfixturevalue("redis")
    return server.url + "?retry_seconds=5"


def is_file(url: str) -> bool:
    return url.startswith("file")


def child(code: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


# ------------------------------------------------------------------------------------------------- attempt fencing
def test_every_write_of_an_older_attempt_is_refused_naming_the_attempts(url):
    old = open_store(url, attempt=1)
    old.claim_writer()
    old.publish_rollout(0, *make_rollout(0, dp=2))
    new = open_store(url, attempt=2)  # the run restarted: attempt 2 enters the store
    payloads, schedule = make_rollout(1, dp=2)
    writes = {
        "publish": lambda: old.publish_rollout(1, payloads, schedule),
        "finish": lambda: old.finish(1),
        "ack": lambda: old.ack(0, 0),
        "release": lambda: old.release_upto(1),
        "progress": lambda: old.put_json("progress", {"step": 99}),
    }
    for name, write in writes.items():
        with pytest.raises(StaleAttempt, match="belongs to attempt 1, but the store's current attempt is 2") as info:
            write()
        assert (info.value.attempt, info.value.current) == (1, 2), name
    assert not new.is_committed(1) and new.get_json("progress") is None
    new.claim_writer()  # takes over from attempt 1
    assert new.publish_rollout(1, payloads, schedule)
    new.ack(0, 0)
    new.put_json("progress", {"step": 1})
    with pytest.raises(StaleAttempt):
        open_store(url, attempt=1)  # a process of attempt 1 started late is refused at once
    old.close()
    new.close()


ZOMBIE = """
import sys
from trainingrun.store import open_store
from tests.integration.test_store import make_rollout
store = open_store(sys.argv[1], attempt=0)
store.claim_writer()
payloads, schedule = make_rollout(1, dp=2, seed=111)
def pause():  # payloads written, commit not yet: stall like a process on a lost node
    print("payloads written", flush=True)
    sys.stdin.readline()
try:
    store.publish_rollout(1, payloads, schedule, _after_payloads=pause)
except Exception as exc:
    print(type(exc).__name__, exc, flush=True)
    sys.exit(3)
"""


def test_a_zombie_writer_cannot_corrupt_what_a_newer_attempt_committed(url):
    zombie = child(ZOMBIE, url)
    try:
        assert zombie.stdout.readline().strip() == "payloads written"
        fresh = open_store(url, attempt=1)
        fresh.claim_writer()  # the new attempt's rollout takes over the store
        payloads, schedule = make_rollout(1, dp=2, seed=222)
        assert fresh.publish_rollout(1, payloads, schedule)
        zombie.stdin.write("go\n")
        zombie.stdin.flush()
        out, err = zombie.communicate(timeout=60)
    finally:
        if zombie.poll() is None:
            zombie.kill()
    assert zombie.returncode == 3, err
    assert out.startswith("StaleAttempt") and "attempt 0" in out and "current attempt is 1" in out
    for rank in range(2):  # the zombie's payloads went to its own attempt's keys: nothing it wrote is visible
        assert_payload_equal(fresh.read_payload(1, rank), payloads[rank])
    assert fresh.read_schedule(1) == schedule
    fresh.close()


# ------------------------------------------------------------------------------------------------- single writer
def test_second_writer_of_the_same_attempt_is_refused_at_once_naming_the_owner(url):
    first = open_store(url, attempt=0)
    owner = first.claim_writer()
    second = open_store(url, attempt=0)
    t0 = time.monotonic()
    with pytest.raises(WriterConflict) as info:
        second.claim_writer()
    assert time.monotonic() - t0 < 2
    message = str(info.value)
    assert f"pid {os.getpid()}" in message and "attempt 0" in message and "already holds the store" in message
    assert info.value.owner["token"] == owner["token"]
    payloads, schedule = make_rollout(0, dp=1)
    with pytest.raises(WriterConflict):  # an unclaimed handle may not publish while a live writer holds the store
        second.publish_rollout(0, payloads, schedule)
    assert first.publish_rollout(0, payloads, schedule)
    first.close()  # a clean exit releases the claim
    assert second.claim_writer()["pid"] == os.getpid()
    newer = open_store(url, attempt=1)
    newer.claim_writer()  # a newer attempt takes over at once
    with pytest.raises(StaleAttempt):
        second.finish(1)
    newer.close()
    second.close()


def test_a_killed_writers_claim_is_taken_over_by_the_next_one(url):
    proc = child("import sys, time\nfrom trainingrun.store import open_store\n"
                 "s = open_store(sys.argv[1], attempt=4)\ns.claim_writer()\nprint('claimed', flush=True)\n"
                 "time.sleep(600)\n", url)
    try:
        assert proc.stdout.readline().strip() == "claimed"
        with pytest.raises(WriterConflict, match=f"pid {proc.pid}"):
            open_store(url, attempt=4).claim_writer()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    store = open_store(url, attempt=4)  # same host, the owner's process is gone: its claim is stale
    assert store.claim_writer()["pid"] == os.getpid()
    store.close()


def test_a_rollout_restarted_alone_takes_over_from_its_live_predecessor_which_is_refused(url, monkeypatch):
    """The rollout restarted alone (same attempt, TRAININGRUN_ROLE_ATTEMPT 1) while its predecessor still runs and
    holds the claim (a pod on a lost node; on Redis a lease that has not run out) takes the store at once; the
    predecessor's next publish is refused (WriterConflict: it exits 78, and its pod is of an older generation)."""
    proc = child("import sys\nfrom trainingrun.store import open_store\nfrom tests.integration.test_store_faults "
                 "import make_rollout\ns = open_store(sys.argv[1], attempt=2)\ns.claim_writer()\n"
                 "print('claimed', flush=True)\nsys.stdin.readline()\n"
                 "try:\n    s.publish_rollout(0, *make_rollout(0, dp=1))\n    print('published', flush=True)\n"
                 "except Exception as exc:\n    print(type(exc).__name__, exc, flush=True)\n", url)
    try:
        assert proc.stdout.readline().strip() == "claimed"
        monkeypatch.setenv("TRAININGRUN_ROLE_ATTEMPT", "1")
        new = open_store(url, attempt=2)
        assert new.claim_writer()["generation"] == 1  # at once, the predecessor alive
        out, _ = proc.communicate("go\n", timeout=60)
        assert out.startswith("WriterConflict") and "lost its claim" in out and "generation 1" in out, out
        assert new.publish_rollout(0, *make_rollout(0, dp=1))
        new.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_unfenced_claim_is_decided_alike_on_both_backends(url):
    # Before: the backends wrote the claim decision in two orders. Beside a live writer of attempt 0 an unfenced
    # handle's claim was WriterConflict on files but StaleAttempt ("attempt 0 ... current attempt is 0") on Redis;
    # beside a live writer of attempt 3 it was StaleAttempt on Redis but took a claim on files (and then failed at
    # its first publish). Now both backends call one rule (`common.may_claim`).
    writer = open_store(url, attempt=0)
    writer.claim_writer()
    with pytest.raises(WriterConflict, match="already holds the store"):
        open_store(url).claim_writer()
    newer = open_store(url, attempt=3)
    newer.claim_writer()
    with pytest.raises(StaleAttempt) as info:
        open_store(url).claim_writer()
    assert (info.value.attempt, info.value.current) == (0, 3)
    assert open_store(url).writer()["attempt"] == 3
    newer.close()
    writer.close()


def test_redis_writer_lease_is_renewed_while_the_writer_lives(redis):
    url = redis.url + "?lease_seconds=0.3"
    writer = open_store(url, attempt=0)
    writer.claim_writer()
    time.sleep(1.2)  # four leases: only the renewal keeps the claim
    ttl = writer.client.pttl("trainingrun:writer")
    assert 0 < ttl <= 300
    with pytest.raises(WriterConflict):
        open_store(url, attempt=0).claim_writer()
    writer.close()  # a clean exit deletes the claim at once (no waiting for the lease)
    assert open_store(url).writer() is None


TINY = (ROOT / "examples/tiny.yaml").read_text()


def test_two_rollout_writers_started_together_one_is_refused(url, tmp_path):
    # Before: both carried on and interleaved data (one seed's rollout 0 with the other's rollout 1).
    procs = []
    for seed in (1, 2):
        doc = yaml.safe_load(TINY)
        doc["spec"]["seed"] = seed
        path = tmp_path / f"seed{seed}.yaml"
        path.write_text(yaml.safe_dump(doc))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "trainingrun", "rollout", "--config", str(path), "--store", url],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "TRAININGRUN_ATTEMPT": "0", "TRAININGRUN_RUN": f"seed{seed}"}))
    try:
        deadline = time.monotonic() + 60
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        loser = next(p for p in procs if p.poll() is not None)
        winner = next(p for p in procs if p is not loser)
        _, err = loser.communicate(timeout=10)
        assert loser.returncode == 78, err
        assert "another rollout writer of the same attempt already holds the store" in err
        assert f"pid {winner.pid}" in err and len(err.strip().splitlines()) == 1
        store = open_store(url)
        deadline = time.monotonic() + 60
        while not store.is_committed(1) and time.monotonic() < deadline:  # the winner fills the pending window
            time.sleep(0.05)
        seed = 1 if winner is procs[0] else 2
        assert [store.read_schedule(k)["seed"] for k in (0, 1)] == [seed, seed]
        assert winner.poll() is None  # still running (waiting for trainers), never disturbed
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.communicate(timeout=30)


# ------------------------------------------------------------------------------------------------- lost data
def test_redis_restarted_empty_is_reported_as_lost_data_not_a_hang(redis):
    # Before: the reader waited forever for rollout 1 (and the writer published into the empty server).
    url = redis.url + "?retry_seconds=20"
    writer, reader = open_store(url, attempt=0), open_store(url, attempt=0)
    writer.claim_writer()
    for k in range(2):
        writer.publish_rollout(k, *make_rollout(k, dp=1))
    assert reader.wait_rollout(0, timeout=5) and reader.read_payload(0, 0)
    reader.ack(0, 0)
    redis.restart()  # no persistence: the server comes back empty
    t0 = time.monotonic()
    with pytest.raises(StoreDataLost) as info:
        reader.wait_rollout(1, timeout=30)
    assert time.monotonic() - t0 < 10
    message = str(info.value)
    assert "lost its data" in message and "restarted without persistence" in message
    assert "resume from their newest checkpoint" in message and "appendonly" in message
    for write in (lambda: writer.publish_rollout(2, *make_rollout(2, dp=1)), writer.pending_rollouts,
                  lambda: reader.ack(1, 0), lambda: reader.put_json("progress", {"step": 1})):
        with pytest.raises(StoreDataLost):
            write()
    assert open_store(url).get_json("progress") is None  # nothing was written into the emptied server


def test_redis_restarted_with_its_data_carries_on():
    with redis_server(persist=True) as server:
        url = server.url + "?retry_seconds=20"
        writer, reader = open_store(url, attempt=0), open_store(url, attempt=0)
        writer.claim_writer()
        writer.publish_rollout(0, *make_rollout(0, dp=1))
        assert reader.wait_rollout(0, timeout=5)
        server.restart(down_seconds=0.5)
        assert reader.wait_rollout(0, timeout=10)
        assert_payload_equal(reader.read_payload(0, 0), make_rollout(0, dp=1)[0][0])
        reader.ack(0, 0)
        assert writer.publish_rollout(1, *make_rollout(1, dp=1))
        writer.close()


def test_evicted_payload_of_a_committed_rollout_is_lost_data(redis):
    store = open_store(redis.url, attempt=0)
    store.publish_rollout(0, *make_rollout(0, dp=2))
    store.client.delete(store.payload_key(0, 1))  # what maxmemory eviction does
    with pytest.raises(StoreDataLost, match=r"rollout 0 is committed but key trainingrun:r:0:a0:p:1 is missing"):
        store.read_payload(0, 1)


def test_wiped_file_store_is_lost_data(tmp_path):
    url = f"file://{tmp_path}/store"
    writer, reader = open_store(url, attempt=0), open_store(url, attempt=0)
    writer.claim_writer()
    writer.publish_rollout(0, *make_rollout(0, dp=1))
    assert reader.wait_rollout(0, timeout=5)
    shutil.rmtree(tmp_path / "store")
    with pytest.raises(StoreDataLost, match="lost its data"):
        reader.wait_rollout(1, timeout=5)
    open_store(url)  # someone recreates it empty
    with pytest.raises(StoreDataLost):
        reader.wait_rollout(1, timeout=5)
    with pytest.raises(StoreDataLost):
        writer.put_json("rollout_state", {})


# ------------------------------------------------------------------------------------------------- corruption
def _tamper(store, key_or_path, transform) -> None:
    if isinstance(key_or_path, Path):
        key_or_path.write_bytes(transform(key_or_path.read_bytes()))
    else:
        store.client.set(key_or_path, transform(store.client.get(key_or_path)))


def _schedule_location(store, k):
    if is_file(store.url):
        return store.payload_path(k, 0).with_name("schedule.json")
    return f"{store.prefix}:r:{k}:schedule"


def _marker_location(store, k):
    return store.root / "rollouts" / f"{k:08d}" / "COMMIT" if is_file(store.url) else f"{store.prefix}:r:{k}:commit"


def test_a_bit_flip_in_a_committed_schedule_or_marker_is_detected(url):
    # Before: a flipped digit in the schedule JSON was read as a different schedule.
    store = open_store(url)
    payloads, schedule = make_rollout(0, dp=2)
    schedule["global_batch_sizes"] = [123456]
    store.publish_rollout(0, payloads, schedule)
    where = _schedule_location(store, 0)
    _tamper(store, where, lambda b: b.replace(b"123456", b"123457"))  # still valid JSON, different number
    with pytest.raises(CorruptPayload, match="schedule fails the CRC-32") as info:
        store.read_schedule(0)
    assert str(where) in str(info.value)
    marker = _marker_location(store, 0)
    _tamper(store, marker, lambda b: b.replace(b'"dp_size":2', b'"dp_size":3'))
    with pytest.raises(CorruptPayload, match="commit marker fails its check value"):
        store.read_payload(0, 0)
    with pytest.raises(CorruptPayload):
        store.pending_rollouts()


@pytest.mark.parametrize("marker", [
    b'{"rollout": "zero", "dp_size": 1}', b'{"rollout": 0, "dp_size": 1e300, "check": 1}', b"[1, 2]", b"\xff\xfe",
    b"[" * 100_000 + b"]" * 100_000,
])
def test_malformed_markers_are_corrupt_payload_naming_the_key(url, marker):
    store = open_store(url)
    store.publish_rollout(0, *make_rollout(0, dp=1))
    where = _marker_location(store, 0)
    _tamper(store, where, lambda _b: marker)
    for read in (lambda: store.read_payload(0, 0), store.pending_rollouts, lambda: store.release_upto(1)):
        with pytest.raises(CorruptPayload) as info:
            read()
        assert str(where) in str(info.value)


@pytest.mark.parametrize("value", [b'{"num_rollouts": 1e300}', b'{"num_rollouts": "3"}', b"NaN", b"{}"])
def test_malformed_finished_and_released_values(url, value):
    store = open_store(url)
    where = store.root / "FINISHED" if is_file(url) else "trainingrun:finished"
    if isinstance(where, Path):
        where.write_bytes(value)
    else:
        store.client.set(where, value)
    with pytest.raises(CorruptPayload, match=str(where)):
        store.wait_rollout(0, timeout=1)
    released = store.root / "RELEASED" if is_file(url) else "trainingrun:released"
    if isinstance(released, Path):
        released.write_bytes(value)
    else:
        store.client.set(released, b"1e300")
    with pytest.raises(CorruptPayload, match=str(released)):
        store.release_upto(0)


def _payload_with_header(header: dict | str) -> bytes:
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    return MAGIC + len(raw).to_bytes(4, "little") + raw + b"\0" * 64


@pytest.mark.parametrize("header, message", [
    ('{"fields": [{"name": "tokens", "dtype": "<i4", "shape": [1e999], "offset": 0, "nbytes": 4, "checksum": 0}]}',
     "must be an integer"),
    ('{"fields": [{"name": "tokens", "dtype": "<i4", "shape": [Infinity], "offset": 0, "nbytes": 4, "checksum": 0}]}',
     "not valid JSON"),
    ('{"fields": [{"name": "tokens", "dtype": "<i4", "shape": [1], "offset": 100000000000000000000000000000, '
     '"nbytes": 4, "checksum": 0}]}', "must be an integer"),
    ('{"fields": [{"name": "tokens", "dtype": "<i4", "shape": [-1], "offset": 0, "nbytes": -4, "checksum": 0}]}',
     "must be an integer"),
    ('{"fields": ' + "[" * 200_000 + "]" * 200_000 + "}", "nested too deeply"),
    ('{"fields": [{"name": "tokens", "dtype": "|O", "shape": [1], "offset": 0, "nbytes": 8, "checksum": 0}]}',
     "expected <i4"),
])
def test_hostile_payload_headers_are_corrupt_payload(url, header, message):
    store = open_store(url)
    store.publish_rollout(0, *make_rollout(0, dp=1))
    overwrite_payload(store, 0, 0, _payload_with_header(header))
    with pytest.raises(CorruptPayload, match=message) as info:
        store.read_payload(0, 0)
    assert "rank-00000" in str(info.value) or ":p:0" in str(info.value)


def test_a_payload_file_far_larger_than_its_header_is_refused_before_mapping(tmp_path):
    store = open_store(f"file://{tmp_path}/store")
    store.publish_rollout(0, *make_rollout(0, dp=1))
    path = store.payload_path(0, 0)
    with open(path, "r+b") as f:
        f.truncate(64 * 1024**3)  # sparse: 64 GiB that MAP_POPULATE would try to read in
    t0 = time.monotonic()
    with pytest.raises(CorruptPayload, match="refused before reading it"):
        store.read_payload(0, 0)
    assert time.monotonic() - t0 < 2


def test_non_regular_files_at_store_paths_are_refused_without_blocking(tmp_path):
    # Before: a FIFO at a payload path blocked the reader forever in open().
    store = open_store(f"file://{tmp_path}/store")
    store.publish_rollout(0, *make_rollout(0, dp=1))
    payload = store.payload_path(0, 0)
    payload.unlink()
    os.mkfifo(payload)
    os.mkfifo(tmp_path / "store" / "kv" / "progress.json")
    result: dict = {}

    def read() -> None:
        for name, op in (("payload", lambda: store.read_payload(0, 0)), ("kv", lambda: store.get_json("progress"))):
            try:
                op()
            except Exception as exc:  # noqa: BLE001 - checked below
                result[name] = exc

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "the reader blocked on a FIFO"
    assert isinstance(result["payload"], CorruptPayload) and "is a FIFO" in str(result["payload"])
    assert isinstance(result["kv"], CorruptPayload) and "progress.json" in str(result["kv"])


def test_keys_with_a_trailing_newline_and_bad_url_options_are_refused(url, tmp_path):
    store = open_store(url)
    for key in ("progress\n", "progress\r\n", "a\nb"):
        with pytest.raises(ValueError, match="key"):
            store.put_json(key, {"x": 1})
    if not is_file(url):
        base = url.split("?")[0]
        for option in ("retry_seconds=nan", "retry_seconds=inf", "lease_seconds=-1", "prefix=run%0A"):
            with pytest.raises(ValueError, match="store url"):
                open_store(f"{base}?{option}")
    with pytest.raises(ValueError, match="attempt"):
        open_store(url, attempt=-1)


def test_the_same_corrupt_key_fails_the_same_way_every_time(url):
    store = open_store(url)
    payloads, schedule = make_rollout(0, dp=1)
    store.publish_rollout(0, payloads, schedule)
    good = stored_payload(store, 0, 0)
    bad = bytearray(good)
    bad[good.find(payloads[0]["rewards"].tobytes()) + 1] ^= 0x01
    overwrite_payload(store, 0, 0, bytes(bad))
    errors = set()
    for _ in range(3):
        with pytest.raises(CorruptPayload) as info:
            store.read_payload(0, 0)
        errors.add(str(info.value))
    assert len(errors) == 1
    with pytest.raises(StoreTimeout):  # the rest of the store still works
        store.wait_rollout(1, timeout=0.2)


# ------------------------------------------------------------------------------------------------- weight versions
def _weights(seed: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    return {"embedding.weight": rng.standard_normal((7, 5)).astype(np.float32),
            "layers.0.bias": rng.standard_normal(5).astype(np.float32)}


def _assert_weights(got: dict, want: dict) -> None:
    import numpy as np

    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_trainer_publishes_weights_beside_the_rollout_writer_and_a_zombie_trainer_cannot(url):
    # Before: publish_weights / release_weights_below checked nothing: a trainer of an older attempt (a zombie on a
    # lost node) could publish a version the new attempt's engine would load, or delete the versions it needs.
    old = open_store(url, attempt=1)
    assert old.publish_weights(0, _weights(0), {"v": 0})
    rollout = open_store(url, attempt=2)  # the run restarted: its rollout holds the writer claim
    rollout.claim_writer()
    trainer = open_store(url, attempt=2)  # trainer rank 0: fenced by its attempt, no writer claim needed
    writes = {
        "publish": lambda: old.publish_weights(1, _weights(99), {"v": "zombie"}),
        "release": lambda: old.release_weights_below(1),
    }
    for name, write in writes.items():
        with pytest.raises(StaleAttempt, match="belongs to attempt 1, but the store's current attempt is 2") as info:
            write()
        assert (info.value.attempt, info.value.current) == (1, 2), name
    assert trainer.latest_weights() == 0
    assert trainer.publish_weights(1, _weights(1), {"v": 1})  # allowed beside the rollout's writer claim
    trainer.release_weights_below(1)
    assert rollout.latest_weights() == 1
    arrays, meta = rollout.read_weights(1)
    assert meta == {"v": 1}
    _assert_weights(arrays, _weights(1))
    for s in (old, rollout, trainer):
        s.close()


ZOMBIE_TRAINER = """
import sys
from trainingrun.store import open_store
from tests.integration.test_store_faults import _weights
store = open_store(sys.argv[1], attempt=0)
def pause():  # tensors written, commit not yet: stall like a process on a lost node
    print("tensors written", flush=True)
    sys.stdin.readline()
try:
    store.publish_weights(3, _weights(111), {"by": "zombie"}, _after_tensors=pause)
except Exception as exc:
    print(type(exc).__name__, exc, flush=True)
    sys.exit(3)
"""


def test_a_zombie_trainer_halfway_through_a_publish_cannot_commit_its_weights(url):
    zombie = child(ZOMBIE_TRAINER, url)
    try:
        assert zombie.stdout.readline().strip() == "tensors written"
        fresh = open_store(url, attempt=1)  # the new attempt's trainer
        assert fresh.publish_weights(3, _weights(222), {"by": "attempt 1"})
        zombie.stdin.write("go\n")
        zombie.stdin.flush()
        out, err = zombie.communicate(timeout=60)
    finally:
        if zombie.poll() is None:
            zombie.kill()
    assert zombie.returncode == 3, err
    assert out.startswith("StaleAttempt") and "attempt 0" in out and "current attempt is 1" in out
    arrays, meta = fresh.read_weights(3)  # the zombie's tensors went to its own attempt's place: never visible
    assert meta == {"by": "attempt 1"}
    _assert_weights(arrays, _weights(222))
    fresh.close()


def _weights_location(store, v, what):
    if is_file(store.url):
        tensors = store.weights_path(v)
        return {"tensors": tensors, "meta": tensors.with_name("meta.json"),
                "marker": store.root / "weights" / f"{v:08d}" / "COMMIT"}[what]
    return {"tensors": f"{store.prefix}:w:{v}:a0:c:0", "meta": f"{store.prefix}:w:{v}:meta",
            "marker": f"{store.prefix}:w:{v}:commit"}[what]


@pytest.mark.parametrize("what, transform, message", [
    ("meta", lambda b: b.replace(b'"v":5', b'"v":6'), "weight meta fails the CRC-32"),
    ("marker", lambda b: b.replace(b'"version":5', b'"version":4'), "commit marker fails its check value"),
    ("marker", lambda _b: b'{"version": 5, "attempt": 0}', "without a check value"),
    ("tensors", lambda b: b[:-8], "its commit marker records"),
    ("tensors", lambda b: b[:-50] + bytes([b[-50] ^ 1]) + b[-49:], "fails its checksum"),  # in the last array
    ("tensors", lambda b: b.replace(b'"<f4"', b'"|O8"', 1), "expected a little-endian numeric dtype"),
    ("tensors", lambda b: b"\x80\x04" + b[2:], "looks like a pickle"),
])
def test_damaged_weight_versions_are_corrupt_payload_naming_the_key(url, what, transform, message):
    store = open_store(url)
    store.publish_weights(5, _weights(5), {"v": 5})
    where = _weights_location(store, 5, what)
    _tamper(store, where, transform)
    for _ in range(2):  # the same way every time
        with pytest.raises(CorruptPayload, match=message) as info:
            store.read_weights(5)
        assert str(where) in str(info.value) or (what == "tensors" and ":w:5:a0:c:" in str(info.value))
    store.close()
