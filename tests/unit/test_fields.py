"""The table of a sample's fields (`contract/fields.py`): its invariants, the views derived from it, the payload's
documented field list, and the formats on disk before the table (a resume state's groups, a rank payload) still read
and written the same."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from trainingrun.contract import payload as payload_module
from trainingrun.contract.fields import (
    FIELDS, SAMPLE, STAGES, TOKEN, Field, SampleArrays, check_row, concat, register_field, unregister_field,
)
from trainingrun.contract.payload import PAYLOAD_FIELDS, PAYLOAD_OPTIONAL
from trainingrun.contract.published import Samples, rank_payload
from trainingrun.rollout.groups import SampleGroup
from trainingrun.store.wire import ARRAY_DTYPE, decode_payload, encode_payload

DATA = Path(__file__).resolve().parents[1] / "data" / "formats"


# ------------------------------------------------------------------------------------------------ invariants
def test_every_row_is_well_formed_and_unique():
    assert all(name == f.name for name, f in FIELDS.items())
    attributes = [f.attribute for f in FIELDS.values()]
    assert len(set(attributes)) == len(attributes)
    widths = [f.width for f in FIELDS.values() if f.width]
    assert len(set(widths)) == len(widths) and not set(widths) & set(FIELDS)
    for f in FIELDS.values():
        check_row(f, {k: v for k, v in FIELDS.items() if k != f.name})
        assert ARRAY_DTYPE.fullmatch(f.dtype), f"{f.name}: {f.dtype} is not little-endian numeric as the wire stores"
        assert np.dtype(f.dtype).str == f.dtype and f.per in (TOKEN, SAMPLE) and f.stage in STAGES
        if f.per == TOKEN:  # the pad is a value of the dtype, exactly
            assert np.array(f.pad).astype(f.dtype).item() == f.pad
        else:
            assert f.pad is None and not f.width
        assert not f.required or f.stage != "trainer"
    assert {"tokens", "loss_mask", "advantages", "rewards", "sample_ids"} == {
        f.name for f in FIELDS.values() if f.required}


def test_the_wire_fields_are_the_tables_with_offsets_after_tokens():
    on_wire = [f for f in FIELDS.values() if f.stage != "trainer"]
    required = [f.name for f in on_wire if f.required]
    assert list(PAYLOAD_FIELDS) == [required[0], "offsets", *required[1:]]
    assert PAYLOAD_FIELDS["offsets"] == np.dtype(np.int64)
    assert list(PAYLOAD_OPTIONAL) == [f.name for f in on_wire if not f.required]
    for f in on_wire:
        assert {**PAYLOAD_FIELDS, **PAYLOAD_OPTIONAL}[f.name] == np.dtype(f.dtype)
    assert "old_logprobs" in FIELDS and "old_logprobs" not in PAYLOAD_OPTIONAL  # the trainer's own: never stored


@pytest.mark.parametrize("row, why", [
    (Field("tokens", "<i4", TOKEN, 0, False, "source"), "clashes"),
    (Field("loss_masks", "<i4", TOKEN, 0, False, "source"), "clashes"),  # the attribute of loss_mask
    (Field("offsets", "<i8", SAMPLE, None, False, "source"), "other than 'offsets'"),
    (Field("big", ">i4", TOKEN, 0, False, "source"), "little-endian"),
    (Field("objects", "O", SAMPLE, None, False, "source"), "little-endian"),
    (Field("text", "<U4", SAMPLE, None, False, "source"), "little-endian"),
    (Field("nonsense", "banana", SAMPLE, None, False, "source"), "not a numpy dtype"),
    (Field("odd", "<f4", "step", None, False, "source"), "per must be"),
    (Field("stageless", "<f4", SAMPLE, None, False, "loader"), "stage must be"),
    (Field("padded", "<f4", SAMPLE, 0.0, False, "source"), "no pad"),
    (Field("widened", "<f4", SAMPLE, None, False, "source", width="n_wide"), "no pad and no width"),
    (Field("unpadded", "<i4", TOKEN, None, False, "source"), "pad None"),
    (Field("overflow", "|u1", TOKEN, -1, False, "source"), "pad -1 must be a value of uint8"),
    (Field("fraction", "<i2", TOKEN, 0.5, False, "source"), "must be a value of int16"),
    (Field("mine", "<f4", TOKEN, 0.0, True, "trainer"), "cannot be required"),
    (Field("wide", "<i2", TOKEN, -1, False, "source", width="routed_width"), "clashes"),
    (Field("group_id", "<i8", SAMPLE, None, False, "source"), "is taken"),  # a group's own attribute
    (Field("values", "<i8", SAMPLE, None, False, "source"), "is taken"),
    (Field("payload", "<i8", SAMPLE, None, False, "source"), "is taken"),  # a method of SampleArrays
    (Field("hidden", "<i8", SAMPLE, None, False, "source", attr="_hidden"), "is taken"),
])
def test_a_malformed_or_clashing_row_is_refused_naming_the_field(row, why):
    before = (dict(FIELDS), dict(PAYLOAD_FIELDS), dict(PAYLOAD_OPTIONAL))
    with pytest.raises(ValueError, match=f"sample field '{row.name}': .*{re.escape(why)}"):
        register_field(row)
    assert (dict(FIELDS), dict(PAYLOAD_FIELDS), dict(PAYLOAD_OPTIONAL)) == before  # nothing half-registered


def test_a_registered_row_is_in_every_derived_view_until_removed():
    row = Field("probe", "<f4", TOKEN, 0.0, False, "generator")
    register_field(row)
    try:
        assert FIELDS["probe"] is row and PAYLOAD_OPTIONAL["probe"] == np.float32
        g = SampleGroup(0, [np.arange(3, dtype=np.int32)], [np.array([0, 1, 1], np.uint8)],
                        np.zeros(1, np.float32), np.arange(1), np.zeros(1, np.float32),
                        probe=[np.array([0.5, 1.5, 2.5], np.float32)])
        assert g.probe[0].tolist() == [0.5, 1.5, 2.5]
        back = SampleGroup.from_json(json.loads(json.dumps(g.to_json())))
        assert back.get("probe")[0].tolist() == [0.5, 1.5, 2.5]
        assert decode_payload(encode_payload(rank_payload(_samples([g]), [0])), where="t")["probe"].tolist() == \
            [0.5, 1.5, 2.5]
    finally:
        unregister_field("probe")
    assert "probe" not in FIELDS and "probe" not in PAYLOAD_OPTIONAL


def _samples(groups):
    s = Samples(group_ids=[g.group_id for g in groups for _ in range(len(g))])
    s.values.update(concat(groups))
    return s


def test_sample_arrays_by_attribute_and_by_name():
    g = SampleGroup(3, [np.arange(2, dtype=np.int32)], [np.array([0, 1], np.uint8)], np.ones(1, np.float32),
                    np.arange(1))
    assert g.loss_masks is g.get("loss_mask") and g.logprobs is None and g.group_id == 3 and len(g) == 1
    g.versions = np.array([4])
    assert g.get("versions").tolist() == [4] and g.values["versions"] is g.versions
    with pytest.raises(TypeError, match="'color' is not a sample field"):
        SampleGroup(0, [], [], np.zeros(0), np.zeros(0), color=[])
    with pytest.raises(AttributeError, match="no attribute 'colour'"):
        _ = g.colour
    with pytest.raises(KeyError, match="'colour' is not a sample field"):
        g.set("colour", [])
    assert isinstance(g, SampleArrays) and isinstance(Samples(group_ids=[]), SampleArrays)


def test_concat_keeps_an_optional_field_only_when_every_group_has_it():
    a, b = _group(0, logprobs=True), _group(1, logprobs=False)
    assert "logprobs" in concat([a, a]) and "logprobs" not in concat([a, b])
    b.advantages = None
    with pytest.raises(ValueError, match="required field 'advantages' is missing"):
        concat([a, b])


def _group(gid, logprobs):
    toks = [np.arange(4, dtype=np.int32), np.arange(2, dtype=np.int32)]
    return SampleGroup(gid, toks, [np.ones(len(t), np.uint8) for t in toks], np.zeros(2, np.float32),
                       np.arange(2) + 2 * gid, np.zeros(2, np.float32),
                       logprobs=[np.zeros(len(t), np.float32) for t in toks] if logprobs else None)


# ------------------------------------------------------------------------------------------------ the docs
def test_the_payload_docstring_lists_exactly_the_wire_fields():
    """contract/payload.py documents each field as `name dtype [shape]`, the required ones before the first
    "Optional" line: the same names, dtypes, shapes and required-ness as the table."""
    documented, optional = {}, False
    for line in payload_module.__doc__.splitlines():
        optional |= line.startswith("Optional")
        m = re.match(r"  (\w+)\s+(\w+)\s+\[([^\]]+)\]", line)
        if m:
            documented[m[1]] = (m[2], m[3], not optional)
    shape = {TOKEN: "total tokens", SAMPLE: "n"}
    table = {"offsets": ("int64", "n + 1", True)}
    for f in FIELDS.values():
        if f.stage != "trainer":
            table[f.name] = (np.dtype(f.dtype).name, shape[f.per] + (" × W" if f.width else ""), f.required)
    assert documented == table


# ------------------------------------------------------------------------------------------------ formats on disk
def _reference_groups():
    """The groups whose JSON form d51d10a (before the table) wrote to tests/data/formats/sample_groups_d51d10a.json,
    and whose rank payload (samples 2, 0, 1 of the full group) it wrote to rank_payload_d51d10a.bin."""
    lens = [3, 5, 1]
    toks = [np.arange(10 * i, 10 * i + n, dtype=np.int32) for i, n in enumerate(lens)]
    masks = [np.r_[np.zeros(1, np.uint8), np.ones(n - 1, np.uint8)] for n in lens]
    full = SampleGroup(7, toks, masks, np.array([1.0, 0.0, 0.5], np.float32), np.array([70, 71, 72], np.int64),
                       np.array([0.25, -1.5, 1e-7], np.float32), False,
                       logprobs=[np.linspace(-1, 0, n).astype(np.float32) for n in lens],
                       versions=np.array([4, 3, 4], np.int64),
                       token_versions=[np.r_[-1, np.full(n - 1, 4 - (i == 1))].astype(np.int64)
                                       for i, n in enumerate(lens)],
                       routed_experts=[(np.arange(n * 3).reshape(n, 3) % 5 - 1).astype(np.int16) for n in lens])
    plain = SampleGroup(8, toks[:2], masks[:2], np.array([0.0, 1.0], np.float32), np.array([80, 81], np.int64))
    return {"full": full, "plain": plain}


def _same_group(a: SampleGroup, b: SampleGroup) -> None:
    assert (a.group_id, a.has_reward, sorted(k for k, v in a.values.items() if v is not None)) == \
        (b.group_id, b.has_reward, sorted(k for k, v in b.values.items() if v is not None))
    for name, value in a.values.items():
        if value is None:
            continue
        for x, y in zip(value, b.get(name)) if FIELDS[name].per == TOKEN else [(value, b.get(name))]:
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name


def test_resume_state_groups_written_before_the_table_read_and_write_the_same():
    stored = json.loads((DATA / "sample_groups_d51d10a.json").read_text())
    for label, group in _reference_groups().items():
        back = SampleGroup.from_json(stored[label])
        _same_group(group, back)
        written = back.to_json()
        # the same JSON; an absent routed_experts is now written as null, as the other optional fields always were
        assert written == {**stored[label], **({} if "routed_experts" in stored[label] else {"routed_experts": None})}


def test_a_rank_payload_written_before_the_table_decodes_and_is_written_byte_for_byte_the_same():
    stored = (DATA / "rank_payload_d51d10a.bin").read_bytes()
    full = _reference_groups()["full"]
    ours = rank_payload(_samples([full]), [2, 0, 1])
    old = decode_payload(stored, where="d51d10a")
    assert list(old) == list(ours)
    for name in ours:
        assert old[name].dtype == ours[name].dtype and np.array_equal(old[name], ours[name]), name
    assert encode_payload(ours) == stored
