"""The rules of a weight version in parts (`store/parts.py`), without a store: the commit's decision over the owners'
records, the index a marker commits and the reader's checks of it (the backends' behaviour on both stores:
tests/integration/test_store_parts.py)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from trainingrun.store import CorruptPayload, IncompleteWeights
from trainingrun.store import parts
from trainingrun.store.common import WeightsMarker
from trainingrun.store.wire import encode_json


def record(owner: int, names: list[str], meta: dict | None = None) -> bytes:
    descriptors = [{"name": parts.part_name(owner, i), "nbytes": 100 + i, "chunks": 1} for i, _ in enumerate(names)]
    return parts.owner_record(7, owner, descriptors, meta or {"dtypes": {n: "float32" for n in names}}, None)


def stored(part: dict) -> int:
    return part["nbytes"]


def test_the_plan_joins_the_owners_meta_and_lists_every_part_in_owner_order():
    records = [record(0, ["a", "b"]), record(1, ["c"], {"dtypes": {"c": "bfloat16"}})]
    index, marker = parts.parts_plan(7, records, {"version": 7}, attempt=3, url="u", stored=stored)
    meta, described = parts.committed_parts(marker, index, where="w")
    assert meta == {"version": 7, "dtypes": {"a": "float32", "b": "float32", "c": "bfloat16"}}
    assert [p["name"] for p in described] == ["o0000-000000", "o0000-000001", "o0001-000000"]
    assert (marker.version, marker.attempt, marker.parts, marker.nbytes) == (7, 3, 3, 100 + 101 + 100)
    assert WeightsMarker.decode(marker.encode(), where="w") == marker  # the parts count survives the check value


@pytest.mark.parametrize("records, stored_size, message", [
    ([record(0, ["a"]), None], stored, "owner 1 wrote no record"),
    ([record(0, ["a"]), parts.owner_record(7, 1, None, None, "OSError: disk full")], stored, "owner 1 failed: OSError"),
    ([record(0, ["a"]), record(1, ["b"])], lambda p: None if p["name"].startswith("o0001") else p["nbytes"],
     "owner 1 recorded part o0001-000000, which is missing"),
    ([record(0, ["a"]), record(1, ["b"])], lambda p: 5, "owner 0 recorded part o0000-000000, which has 5 bytes"),
    ([record(0, ["a"]), record(0, ["b"])], stored, "owner 1 wrote a damaged record"),  # another owner's record
    ([record(0, ["a"], {"lora": "adapters"}), record(1, ["b"], {"lora": "base+adapters"})], stored,
     "owner 1 recorded lora='base\\+adapters', another said 'adapters'"),
    ([b"\x80\x04pickle"], stored, "owner 0 wrote a damaged record"),
])
def test_an_incomplete_version_is_refused_naming_the_owner(records, stored_size, message):
    with pytest.raises(IncompleteWeights, match=message) as err:
        parts.parts_plan(7, records, {}, attempt=0, url="u", stored=stored_size)
    assert err.value.owner == int(message.split("owner ")[1][0]) and "nothing was committed" in str(err.value)


def test_the_reader_refuses_an_index_that_does_not_match_its_marker_and_a_tensor_in_two_parts():
    index, marker = parts.parts_plan(7, [record(0, ["a", "b"])], {}, attempt=0, url="u", stored=stored)
    with pytest.raises(CorruptPayload, match="fails the CRC-32"):
        parts.committed_parts(marker, index.replace(b"101", b"102"), where="w")
    fewer = encode_json({"meta": {}, "parts": [{"name": "o0000-000000", "nbytes": 100, "chunks": 1}]})
    with pytest.raises(CorruptPayload, match="does not hold the meta and the 2 parts"):
        parts.committed_parts(WeightsMarker(7, 0, 100, 1, zlib.crc32(fewer), parts=2), fewer,
                              where="w")
    into = {"x": np.zeros(2)}
    with pytest.raises(CorruptPayload, match="array 'x' is in two parts"):
        parts.join_part(into, {"x": np.ones(2)}, where="w")
    with pytest.raises(CorruptPayload, match="7 bytes stored, but the parts index records 100"):
        parts.check_part_size(7, {"nbytes": 100}, where="w")
