"""A new per-token field is one row of the sample table (`contract/fields.py`): registered from this test alone (no
other code changes), filled by the source, it travels rollout → store (file:// and redis://) → the trainers'
re-schedule → the packed micro-batch with its values intact and its row's pad wherever a micro-batch is padded;
carried groups keep it in the rollout's resume state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.integration.test_rollout import make_doc
from trainingrun.api import parse_trainingrun
from trainingrun.contract import published as contract
from trainingrun.contract.fields import TOKEN, Field, register_field, unregister_field
from trainingrun.rollout.groups import SampleGroup
from trainingrun.contract.rollout_state import ROLLOUT_STATE_KEY
from trainingrun.rollout.main import run_rollout
from trainingrun.rollout.synthetic import SyntheticSource
from trainingrun.store import open_store
from trainingrun.trainer.batch import pack, pad_to_length, step_microbatches
from trainingrun.trainer.reshard import reschedule

W = 3  # values per token of the wide probe

PROBES = {
    # one value per token, a pad no real value takes
    "probe": Field("probe", "<i4", TOKEN, -7, False, "source", doc="a test's per-token field"),
    # W values per token (like routed_experts)
    "probe_wide": Field("probe_wide", "<i2", TOKEN, -3, False, "source", width="probe_width",
                        doc="a test's per-token field with W values per token"),
}


def expected(name: str, sample_id: int, length: int) -> np.ndarray:
    """The probe's values of sample `sample_id` (what the source fills in, what every later stage must hold)."""
    pos = np.arange(length)
    if name == "probe":
        return (sample_id * 1000 + pos).astype(np.int32)
    return ((sample_id * 7 + pos[:, None] * W + np.arange(W)) % 30000).astype(np.int16)


@pytest.fixture(params=sorted(PROBES))
def probe(request, monkeypatch):
    """The probe row registered for the test (and removed after it), and the synthetic source filling it."""
    row = PROBES[request.param]
    register_field(row)
    request.addfinalizer(lambda: unregister_field(row.name))
    draw = SyntheticSource.draw

    def draw_with_probe(self, index: int) -> list[SampleGroup]:
        groups = draw(self, index)
        for g in groups:
            g.set(row.name, [expected(row.name, int(i), len(t)) for i, t in zip(g.sample_ids, g.tokens)])
        return groups

    monkeypatch.setattr(SyntheticSource, "draw", draw_with_probe)
    return row


@pytest.fixture(params=["file", "redis"])
def store(request, tmp_path):
    if request.param == "file":
        return open_store(f"file://{tmp_path}/store")
    return open_store(f"{request.getfixturevalue('redis').url}?prefix=fields")


def check_payload(payload, name: str) -> None:
    """Every sample of a rank payload holds the probe's values, flat (W per token with a width)."""
    off = payload["offsets"]
    for p, sid in enumerate(payload["sample_ids"]):
        a, b = int(off[p]), int(off[p + 1])
        w = len(payload[name]) // len(payload["tokens"])
        np.testing.assert_array_equal(payload[name][a * w:b * w], expected(name, int(sid), b - a).reshape(-1))


def check_microbatch(mb, row: Field) -> int:
    """Each document of a packed micro-batch holds its sample's probe values, then the row's pad up to the next
    document (per-document padding) and on the dummy tokens; returns the pad tokens seen."""
    values = mb.fields[row.name].numpy()
    assert values.dtype == np.dtype(row.dtype) and len(values) == mb.input_ids.shape[1]
    cu = mb.cu_seqlens.tolist()
    lengths = mb.loss.lengths.int().tolist()
    padded = 0
    for j, sid in enumerate(mb.sample_ids):
        start, end = cu[j], cu[j + 1]
        want = expected(row.name, sid, lengths[j])
        np.testing.assert_array_equal(values[start:start + lengths[j]], want)
        assert (values[start + lengths[j]:end] == row.pad).all()
        padded += end - start - lengths[j]
    tail = values[cu[len(mb.sample_ids)]:]  # dummy tokens (an empty micro-batch, pad_to_length)
    assert (tail == row.pad).all()
    return padded + len(tail)


def test_a_new_per_token_field_travels_from_the_source_to_the_trainer_batch(probe, store):
    cpu = torch.device("cpu")
    result = run_rollout(parse_trainingrun(make_doc()), store, progress=lambda _msg: None)  # 6 synthetic rollouts
    assert result.rollouts == 6
    pad_seen = 0
    for k in range(result.rollouts):
        published = contract.read(store, k)
        payloads = {r: store.read_payload(k, r) for r in range(published.dp_size)}
        for r, payload in payloads.items():
            assert payload[probe.name].dtype == np.dtype(probe.dtype)
            check_payload(payload, probe.name)
            for step in published.steps():
                positions = published.microbatch_positions(r, step)
                for longest in (False, True):  # packed, and each document padded to the micro-batch's longest
                    for mb in step_microbatches(payload, positions, cpu, pad_to_longest=longest):
                        pad_seen += check_microbatch(mb, probe)
                        pad_seen += check_microbatch(pad_to_length(mb, mb.input_ids.shape[1] + 5), probe)
            pad_seen += check_microbatch(pack(payload, [], cpu), probe)  # an empty micro-batch: one dummy token
        # the trainers' re-schedule for another data-parallel size keeps it too
        _, resharded = reschedule(published.schedule, payloads, 3)
        for payload in resharded.values():
            check_payload(payload, probe.name)
    assert pad_seen > 0
    # groups carried past the last rollout keep it in the resume state (the group's JSON form)
    carried = [SampleGroup.from_json(g) for g in store.get_json(ROLLOUT_STATE_KEY)["carried"]]
    assert carried and result.leftover_groups == len(carried)
    for g in carried:
        for sid, t, values in zip(g.sample_ids, g.tokens, g.get(probe.name)):
            np.testing.assert_array_equal(values, expected(probe.name, int(sid), len(t)))
