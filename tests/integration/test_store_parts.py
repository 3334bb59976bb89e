"""Weight versions in parts (issue 28 item 5, `store/parts.py`) on both backends: a temp directory (file://) and a
real redis-server (redis://). Several owners write their own parts, one commits: the version reads back whole and
bit-exact (bf16 as its 16 bits, the owners' dtypes joined into the meta); nothing is visible before the commit; an
owner that failed, wrote no record or lost a part leaves nothing committed, is named, and its attempt's parts are
removed; release removes parts (committed or not); a damaged part is refused naming it."""

from __future__ import annotations

import numpy as np
import pytest

from tests.integration.test_store import assert_payload_equal, store  # noqa: F401 - the two-backend fixture
from trainingrun.store import CorruptPayload, IncompleteWeights, StoreError


def model(version: int) -> dict[str, np.ndarray]:
    """A small 'model': fp32 tensors and bf16 ones stored as their raw 16 bits (uint16), as the publisher sends."""
    rng = np.random.default_rng(version)
    out = {f"layers.{i}.weight": rng.standard_normal((5, 3)).astype(np.float32) for i in range(4)}
    out.update({f"layers.{i}.bf16": rng.integers(0, 2**16, size=(2, 7), dtype=np.uint16) for i in range(3)})
    out["embedding"] = rng.standard_normal((11, 3)).astype(np.float32)
    return out


def split(arrays: dict[str, np.ndarray], owners: int) -> list[list[dict[str, np.ndarray]]]:
    """Each owner's parts (buckets of two tensors, dealt round robin over the owners)."""
    names = sorted(arrays)
    buckets = [{n: arrays[n] for n in names[i:i + 2]} for i in range(0, len(names), 2)]
    return [buckets[o::owners] for o in range(owners)]


def write_owner(store, version: int, owner: int, buckets: list[dict[str, np.ndarray]]) -> list[dict]:
    parts = [store.write_weights_part(version, owner, i, b) for i, b in enumerate(buckets)]
    dtypes = {n: ("bfloat16" if a.dtype == np.uint16 else "float32") for b in buckets for n, a in b.items()}
    store.write_weights_owner(version, owner, parts=parts, meta={"dtypes": dtypes})
    return parts


def publish(store, version: int, owners: int = 2, meta: dict | None = None) -> None:
    assert store.begin_weights(version)
    for owner, buckets in enumerate(split(model(version), owners)):
        write_owner(store, version, owner, buckets)
    assert store.commit_weights(version, owners, {"version": version, **(meta or {})})


def leftovers(store, version: int) -> list:
    """What the store still holds of `version` (files of its directory, or its Redis keys)."""
    if store.url.startswith("file"):
        d = store.root / "weights" / f"{version:08d}"
        return sorted(str(p.relative_to(d)) for p in d.rglob("*")) if d.exists() else []
    return sorted(store.client.keys(f"trainingrun:w:{version}:*"))


def test_parts_round_trip_bit_exact_and_visible_only_when_committed(store):
    publish(store, 0)
    assert store.begin_weights(1)
    owned = split(model(1), 3)
    for owner in (0, 1, 2):
        write_owner(store, 1, owner, owned[owner])
        assert store.latest_weights() == 0  # parts written: not visible before the commit
        with pytest.raises(StoreError, match="weight version 1 is not committed"):
            store.read_weights(1)
    assert store.commit_weights(1, 3, {"version": 1, "lora": "adapters"})
    assert store.latest_weights() == 1
    arrays, meta = store.read_weights(1)
    assert_payload_equal(arrays, model(1))  # every owner's parts, bit-exact (the bf16 bits too)
    assert meta == {"version": 1, "lora": "adapters",
                    "dtypes": {n: ("bfloat16" if a.dtype == np.uint16 else "float32") for n, a in model(1).items()}}
    # each owner wrote its own parts
    names = leftovers(store, 1)
    for owner in (0, 1, 2):
        assert sum(f"o{owner:04d}-" in str(n) for n in names) == len(owned[owner]), names
    assert store.begin_weights(1) is False and store.commit_weights(1, 3, {}) is False  # committed: nothing to do
    assert_payload_equal(store.read_weights(0)[0], model(0))


@pytest.mark.parametrize("fault", ["no record", "error", "lost part"])
def test_a_failed_owner_commits_nothing_is_named_and_its_parts_are_removed(store, fault):
    publish(store, 2)
    assert store.begin_weights(3)
    owned = split(model(3), 2)
    write_owner(store, 3, 0, owned[0])
    if fault == "error":
        store.write_weights_part(3, 1, 0, owned[1][0])
        store.write_weights_owner(3, 1, error="OSError: No space left on device (test)")
        message = "trainer owner 1 failed: OSError: No space left on device"
    elif fault == "lost part":
        parts = write_owner(store, 3, 1, owned[1])
        name = parts[-1]["name"]
        if store.url.startswith("file"):
            (store.root / "weights" / "00000003" / "a00000000" / f"part-{name}.bin").unlink()
        else:
            store.client.delete(f"trainingrun:w:3:a0:p:{name}:0")
        message = f"trainer owner 1 recorded part {name}, which is missing"
    else:
        store.write_weights_part(3, 1, 0, owned[1][0])  # then died before its record
        message = "trainer owner 1 wrote no record"
    with pytest.raises(IncompleteWeights, match=message) as err:
        store.commit_weights(3, 2, {"version": 3})
    assert err.value.owner == 1 and "nothing was committed" in str(err.value)
    assert store.latest_weights() == 2
    with pytest.raises(StoreError, match="not committed"):
        store.read_weights(3)
    assert [n for n in leftovers(store, 3) if "o000" in str(n)] == []  # the half-written parts are gone
    publish(store, 3)  # the next try commits
    assert_payload_equal(store.read_weights(3)[0], model(3))


def test_release_removes_parts_of_committed_and_never_committed_versions(store):
    for v in (0, 1):
        publish(store, v)
    assert store.begin_weights(2)
    store.write_weights_part(2, 0, 0, model(2))  # a publish that died: never committed
    publish(store, 3)
    assert leftovers(store, 0) and leftovers(store, 2)
    store.release_weights_below(3)
    assert leftovers(store, 0) == leftovers(store, 1) == leftovers(store, 2) == []
    assert store.latest_weights() == 3
    assert_payload_equal(store.read_weights(3)[0], model(3))
    with pytest.raises(StoreError, match="weight version 1 is not committed"):
        store.read_weights(1)


def flipped(data: bytes) -> bytes:
    """`data` (an encoded part) with one bit of its first array flipped."""
    from trainingrun.store.wire import parse_header

    out = bytearray(data)
    out[parse_header(data, where="test", spec=None).data_start] ^= 0x01
    return bytes(out)


def test_begin_removes_this_attempts_leftovers_and_a_damaged_part_is_refused(store):
    assert store.begin_weights(4)
    store.write_weights_part(4, 0, 7, model(9))  # a publish of this attempt that died
    publish(store, 4)  # begin removed the leftover: it is not in the version
    assert not any("000007" in str(n) for n in leftovers(store, 4))
    assert_payload_equal(store.read_weights(4)[0], model(4))
    if store.url.startswith("file"):
        path = sorted((store.root / "weights" / "00000004" / "a00000000").glob("part-o0001-*.bin"))[0]
        path.write_bytes(flipped(path.read_bytes()))
        where = path.name
    else:
        key = sorted(k for k in store.client.keys("trainingrun:w:4:a0:p:o0001-*"))[0]
        store.client.set(key, flipped(store.client.get(key)))
        where = key.decode().rsplit(":", 1)[0]
    with pytest.raises(CorruptPayload, match=f"{where}.*fails its checksum"):
        store.read_weights(4)


def test_redis_parts_larger_than_a_piece_are_stored_in_pieces(redis, monkeypatch):
    from trainingrun.store import open_store
    from trainingrun.store import redis as redis_store

    monkeypatch.setattr(redis_store, "WEIGHT_CHUNK_BYTES", 100)
    s = open_store(redis.url)
    try:
        assert s.begin_weights(0)
        big = {"w": np.arange(300, dtype=np.float32)}  # 1200 bytes of data: 13+ pieces of 100 bytes
        part = s.write_weights_part(0, 0, 0, big)
        assert part["chunks"] == -(-part["nbytes"] // 100) > 10
        s.write_weights_owner(0, 0, parts=[part])
        assert s.commit_weights(0, 1, {})
        assert_payload_equal(s.read_weights(0)[0], big)
    finally:
        s.close()
