"""The payload wire format: round trip, no pickle, every kind of damage is CorruptPayload."""

from __future__ import annotations

import io
import pickle
import struct

import numpy as np
import pytest

from trainingrun.contract.errors import CorruptPayload
from trainingrun.contract.payload import PAYLOAD_FIELDS
from trainingrun.store.wire import ALIGN, MAGIC, check_payload, decode_payload, encode_json, encode_payload


def payload(n=3, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 20, size=n)
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    return {
        "tokens": rng.integers(0, 2**31 - 1, size=offsets[-1], dtype=np.int32),
        "offsets": offsets,
        "loss_mask": rng.integers(0, 2, size=offsets[-1]).astype(np.uint8),
        "advantages": rng.standard_normal(n).astype(np.float32),
        "rewards": rng.random(n).astype(np.float32),
        "sample_ids": rng.integers(0, 2**62, size=n),
    }


@pytest.mark.parametrize("n", [0, 1, 7, 300])
def test_round_trip_bit_exact(n):
    p = payload(n, seed=n)
    data = encode_payload(p)
    back = decode_payload(data, where="test")
    for name, dtype in PAYLOAD_FIELDS.items():
        assert back[name].dtype == dtype
        np.testing.assert_array_equal(back[name], p[name])
    # buffers are 64-byte aligned inside the stored bytes, so views can be used directly
    raw = bytearray(data)
    base = np.frombuffer(raw, np.uint8).ctypes.data
    for view in decode_payload(raw, where="test").values():
        assert view.nbytes == 0 or (view.ctypes.data - base) % ALIGN == 0


def test_check_payload_names_the_field():
    p = payload()
    with pytest.raises(ValueError, match=r"payload\.rewards: dtype must be float32"):
        check_payload({**p, "rewards": p["rewards"].astype(np.float64)})
    with pytest.raises(ValueError, match=r"payload\.loss_mask: length"):
        check_payload({**p, "loss_mask": p["loss_mask"][1:]})
    with pytest.raises(ValueError, match=r"missing \['tokens'\]"):
        check_payload({k: v for k, v in p.items() if k != "tokens"})
    bad = p["offsets"].copy()
    bad[1], bad[2] = bad[2], bad[1]
    with pytest.raises(ValueError, match=r"offsets: must not decrease"):
        check_payload({**p, "offsets": bad})


class Bomb:
    ran = []

    def __reduce__(self):
        return (Bomb.ran.append, ("exploded",))


def test_pickles_are_refused_without_unpickling():
    with pytest.raises(CorruptPayload, match="looks like a pickle"):
        decode_payload(pickle.dumps(Bomb()), where="store x: key k")
    buf = io.BytesIO()
    np.save(buf, np.array([Bomb()], dtype=object), allow_pickle=True)
    with pytest.raises(CorruptPayload, match="store x: key k: not a trainingrun payload"):
        decode_payload(buf.getvalue(), where="store x: key k")
    assert Bomb.ran == []


def test_damage_is_detected():
    p = payload(5)
    data = encode_payload(p)
    at = data.find(p["tokens"].tobytes()) + 3  # a byte inside the token buffer
    cases = {
        "truncated": data[:-70],
        "header length": data[:8] + struct.pack("<I", 10**9) + data[12:],
        "not valid JSON": data[:12] + b"x" + data[13:],
        "checksum": data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :],
        "bad magic": b"X" + data[1:],
    }
    for what, damaged in cases.items():
        with pytest.raises(CorruptPayload, match=what if what != "truncated" else "truncated write"):
            decode_payload(damaged, where="w")
    assert data.startswith(MAGIC)


def test_json_is_strict():
    assert encode_json({"a": np.int64(3), "b": np.float32(0.5), "c": np.arange(2)}) == b'{"a":3,"b":0.5,"c":[0,1]}'
    with pytest.raises(ValueError, match="schedule: cannot be stored as JSON"):
        encode_json({"x": float("inf")}, where="schedule")
    with pytest.raises(ValueError, match="cannot be stored as JSON"):
        encode_json({"x": object()})


def test_checksum_catches_every_single_bit_flip_and_moved_blocks():
    from trainingrun.store.wire import CHECKSUM_BLOCK, checksum

    rng = np.random.default_rng(1)
    data = bytearray(rng.integers(0, 256, size=CHECKSUM_BLOCK * 8 * 3 + 13, dtype=np.uint8).tobytes())
    ref = checksum(data)
    for pos in list(rng.integers(0, len(data), size=200)) + [0, len(data) - 1, len(data) - 13]:
        for bit in (0, 7):
            data[pos] ^= 1 << bit
            assert checksum(data) != ref, (pos, bit)
            data[pos] ^= 1 << bit
    block = CHECKSUM_BLOCK * 8
    swapped = data[block : 2 * block] + data[:block] + data[2 * block :]
    assert checksum(swapped) != ref and checksum(bytes(data)) == ref
