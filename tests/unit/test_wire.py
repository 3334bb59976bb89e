"""The payload wire format: round trip, no pickle, every kind of damage is CorruptPayload."""

from __future__ import annotations

import io
import pickle
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _checksum_by_definition(data: bytes) -> int:
    """The checksum as docs/store.md defines it, in plain integers: the sums mod 2**64 of each block of 4096
    little-endian 64-bit words (the last partial word zero-padded), then the CRC-32 of those sums."""
    import zlib

    padded = data + b"\0" * (-len(data) % 8)
    words = [int.from_bytes(padded[i : i + 8], "little") for i in range(0, len(padded), 8)]
    sums = [sum(words[i : i + 4096]) % 2**64 for i in range(0, len(words), 4096)]
    full = len(data) // 8 // 4096
    if len(sums) == full:  # no words after the last full block: its (empty) rest still counts as 0
        sums.append(0)
    return zlib.crc32(b"".join(s.to_bytes(8, "little") for s in sums))


@settings(max_examples=60, deadline=None)
@given(size=st.sampled_from([0, 1, 7, 8, 9, 4095 * 8, 4096 * 8 - 1, 4096 * 8, 4096 * 8 + 1, 2 * 4096 * 8 + 5])
       | st.integers(0, 3 * 4096 * 8), fill=st.sampled_from(["random", "ones"]), seed=st.integers(0, 2**16))
def test_checksum_is_the_documented_definition(size, fill, seed):
    # The fast checksum (one numpy pass; a few integer operations for a buffer shorter than a block) must stay the
    # stored format: payloads written before it must still decode.
    from trainingrun.store.wire import checksum

    data = np.random.default_rng(seed).bytes(size) if fill == "random" else b"\xff" * size  # ones: sums wrap
    assert checksum(data) == _checksum_by_definition(data)
    assert checksum(memoryview(bytearray(data))) == checksum(data)


def test_a_header_parsed_beforehand_is_checked_against_the_bytes_it_came_with():
    # The file store parses a payload's header before it maps the file and hands it to the decoder (not parsed
    # twice); the decoder still refuses bytes whose length differs from what that header accounts for, and still
    # checks every buffer's checksum.
    from trainingrun.store.wire import parse_header

    p = payload(5)
    data = encode_payload(p)
    header = parse_header(data, where="w")
    back = decode_payload(data, where="w", header=header)
    for name in PAYLOAD_FIELDS:
        np.testing.assert_array_equal(back[name], p[name])
    with pytest.raises(CorruptPayload, match="truncated write"):
        decode_payload(data[:-64], where="w", header=header)
    at = data.find(p["rewards"].tobytes())
    flipped = data[:at] + bytes([data[at] ^ 4]) + data[at + 1 :]
    with pytest.raises(CorruptPayload, match="'rewards' fails its checksum"):
        decode_payload(flipped, where="w", header=header)


@settings(max_examples=200, deadline=None)
@given(field=st.integers(0, 5), key=st.sampled_from(["shape", "offset", "nbytes", "checksum", "dtype", "name"]),
       value=st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                       st.text(max_size=4), st.lists(st.integers(-3, 2**64), max_size=3)))
def test_any_header_value_is_accepted_only_when_valid_and_refused_naming_the_field(field, key, value):
    # The header's checks take a fast path for well-formed headers; whatever one value is replaced by, the header
    # is either still consistent (and decodes to the same arrays) or CorruptPayload, never another exception.
    import json as _json

    from trainingrun.store.wire import HEADER_PREFIX, parse_header

    data = encode_payload(payload(4, seed=3))
    hlen = struct.unpack_from("<I", data, len(MAGIC))[0]
    header = _json.loads(data[HEADER_PREFIX : HEADER_PREFIX + hlen])
    header["fields"][field][key] = value
    raw = _json.dumps(header).encode()
    tampered = MAGIC + struct.pack("<I", len(raw)) + raw
    tampered += b"\0" * (-len(tampered) % ALIGN) + data[HEADER_PREFIX + hlen + (-(HEADER_PREFIX + hlen) % ALIGN) :]
    try:
        parse_header(tampered, where="w")
    except CorruptPayload as exc:
        assert str(exc).startswith("w: ")
        return
    try:
        decode_payload(tampered, where="w")  # a consistent header may still describe other bytes: refused
    except CorruptPayload:
        pass


@pytest.mark.parametrize("name", [[], {}, ["tokens"]])
def test_a_header_field_named_by_a_list_or_an_object_is_corrupt_payload(name):
    # Before: TypeError (unhashable type) escaped from the decoder instead of CorruptPayload naming the key.
    raw = ('{"fields": [{"name": ' + __import__("json").dumps(name) + ', "dtype": "<i4", "shape": [1], "offset": 0, '
           '"nbytes": 4, "checksum": 0}]}').encode()
    data = MAGIC + struct.pack("<I", len(raw)) + raw
    with pytest.raises(CorruptPayload, match="store x: key k: payload header has an unknown or repeated field"):
        decode_payload(data + b"\0" * (-len(data) % ALIGN + 64), where="store x: key k")


def test_routed_experts_travel_bit_exact_and_are_checked():
    """The optional per-token `routed_experts` (routing replay: MoE layers × top-k per token, −1 for none) round-trips
    exactly; a length that is not a positive multiple of the tokens, or an id below −1, is refused naming it."""
    p = payload(4)
    width = 6
    p["routed_experts"] = np.random.default_rng(1).integers(-1, 8, size=len(p["tokens"]) * width).astype(np.int16)
    back = decode_payload(encode_payload(p), where="t")
    assert back["routed_experts"].dtype == np.int16 and np.array_equal(back["routed_experts"], p["routed_experts"])
    for bad, why in ((p["routed_experts"][:-1], "not a positive multiple"),
                     (np.full(len(p["tokens"]) * width, -2, np.int16), "must be >= 0, or -1")):
        with pytest.raises(ValueError, match=f"routed_experts: .*{why}"):
            check_payload({**p, "routed_experts": bad})
