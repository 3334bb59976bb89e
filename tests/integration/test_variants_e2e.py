"""Spec variants run the way users run them (`trainingrun run`), plus the rollout-side regressions they exposed.

Megatron runs (module-scoped, shared between assertions; a shortened examples/tiny.yaml, 4 rollouts of 32 samples):
  file2   2 trainers, file store: policy_gradient + token normalisation, static micro-batches (microBatchSize 2,
          microbatchMultiple 2), fixed steps of more groups than one rollout keeps (carried, a leftover at the end)
  redis2  the same spec on a real redis-server: bit-identical per-step loss
  file1   the same spec with 1 trainer: DP invariance (loss within 1e-4; LR, GBS, samples, sample ids equal)
  reuse   the redis spec again with a fresh --out on the same store: a config error (78) naming the fix, no restarts
  jsonl   a pre-tokenized jsonl source given by a path relative to where `trainingrun run` is invoked
In-process (no Megatron): static micro-batching on steps it cannot align, a jsonl source whose samples are all
filtered.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from tests.localrun import finish, records, start
from tests.services import redis_server
from trainingrun.api import parse_trainingrun
from trainingrun.contract.errors import EXIT_CONFIG_ERROR
from trainingrun.contract.rollout_state import data_account
from trainingrun.rollout.main import run_rollout
from trainingrun.contract.errors import ConfigError
from trainingrun.schedule import DPSchedule
from trainingrun.store import open_store

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 240
GROUPS_PER_STEP = 10  # > the 8 groups a rollout of 32 samples (groupSize 4) yields: groups carried across rollouts


def spec_doc(**over) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    s = doc["spec"]
    s["rollout"].update(numRollouts=4, samplesPerRollout=32)
    s["trainer"]["checkpoint"]["interval"] = 0
    s["failurePolicy"] = {"maxRestarts": 1, "backoffSeconds": 0, "progressDeadlineSeconds": 120}
    s["metrics"]["port"] = 9600
    for path, value in over.items():  # "trainer.lossType": ...; None removes the field
        *parents, last = path.split(".")
        d = s
        for p in parents:
            d = d.setdefault(p, {})
        if value is None:
            d.pop(last, None)
        else:
            d[last] = value
    return doc


VARIANT = {
    "trainer.lossType": "policy_gradient",
    "trainer.lossNormalization": "token",
    "trainer.maxTokensPerGPU": None,
    "trainer.microBatchSize": 2,
    "trainer.microbatchMultiple": 2,
    "rollout.steps": {"policy": "fixed", "globalBatchSize": GROUPS_PER_STEP},
}


def launch(doc: dict, out: Path, *extra: str, cwd: Path = ROOT) -> tuple[int, str]:
    spec = out.with_suffix(".yaml")
    spec.write_text(yaml.safe_dump(doc))
    return finish(start(spec, out, *extra, cwd=cwd, progress_interval=30), timeout=RUN_TIMEOUT)


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


# ------------------------------------------------------------------------------------------------ Megatron runs
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("variants")
    outs: dict[str, tuple[int, str, Path]] = {}
    with redis_server() as server:
        for name, doc, extra in (
            ("file2", spec_doc(**VARIANT), ()),
            ("redis2", spec_doc(**VARIANT, **{"store": {"url": server.url}}), ()),
            ("file1", spec_doc(**VARIANT), ("--trainers", "1")),
            ("reuse", spec_doc(**VARIANT, **{"store": {"url": server.url}}), ()),
        ):
            code, text = launch(doc, base / name, *extra)
            outs[name] = (code, text, base / name)
    return outs


def _ok(runs, name) -> Path:
    code, text, out = runs[name]
    assert code == 0, f"{name} failed ({code}):\n{text[-3000:]}"
    return out


@pytest.mark.megatron
def test_static_microbatches_token_loss_fixed_steps_run(runs):
    out = _ok(runs, "file2")
    recs = records(out)
    assert [r["step"] for r in recs] == list(range(1, len(recs) + 1)) and len(recs) == 4
    for r in recs:
        assert r["global_batch_size"] == GROUPS_PER_STEP * 4  # fixed: 10 groups of 4, whole groups only
        assert r["num_microbatches"] % 2 == 0  # microbatchMultiple
        assert r["num_microbatches"] * 2 * 2 >= r["global_batch_size"]  # ≤ 2 samples per micro-batch, 2 ranks
        assert abs(r["loss"] - r["token_loss"]) <= 1e-6  # token normalisation: J_s = mean token loss
    assert recs[-1]["samples_consumed"] == sum(r["global_batch_size"] for r in recs)


@pytest.mark.megatron
def test_summary_accounts_for_every_sample_and_names_the_leftover(runs):
    out = _ok(runs, "file2")
    _, text, _ = runs["file2"]
    data = summary(out)["data"]
    assert data["finished"] and data["samples_published"] == records(out)[-1]["samples_consumed"]
    filtered = sum(data["samples_filtered"].values())
    assert data["samples_produced"] == data["samples_published"] + filtered + data["leftover_samples"]
    # 10 groups per step never divide what the rollouts keep exactly here: groups are left at the end, and said so
    assert data["leftover_samples"] > 0 and data["leftover_groups"] == data["leftover_samples"] // 4
    assert f"{data['leftover_samples']} sample(s) were left over" in text
    assert "left over, not trained" in text


@pytest.mark.megatron
def test_redis_store_matches_file_store_bit_for_bit(runs):
    a, b = records(_ok(runs, "file2")), records(_ok(runs, "redis2"))
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        for key in ("loss", "lr", "grad_norm", "global_batch_size", "num_microbatches", "samples_consumed",
                    "tokens", "sample_id_sum"):
            assert x[key] == y[key], (key, x["step"], x[key], y[key])
    assert summary(runs["redis2"][2])["data"] == summary(runs["file2"][2])["data"]


@pytest.mark.megatron
def test_dp_invariance_static_microbatches_token_loss(runs):
    two, one = records(_ok(runs, "file2")), records(_ok(runs, "file1"))
    assert len(two) == len(one) == 4
    for x, y in zip(two, one):
        assert (x["dp_size"], y["dp_size"]) == (2, 1)
        for key in ("global_batch_size", "lr", "samples_consumed", "sample_id_sum", "loss_tokens"):
            assert x[key] == y[key], (key, x["step"])
        assert abs(x["loss"] - y["loss"]) <= 1e-4, (x["step"], x["loss"], y["loss"])


@pytest.mark.megatron
def test_reused_store_is_a_config_error_not_a_restart_loop(runs):
    _ok(runs, "redis2")  # trained and released everything in this store
    code, text, out = runs["reuse"]
    assert code == EXIT_CONFIG_ERROR, text[-3000:]
    s = summary(out)
    assert s["restarts"] == 0 and s["steps"] == 0 and s["status"] == "failed"
    assert "already trained and deleted by an earlier run using this store" in text
    assert "fresh store" in text and "Traceback" not in text


@pytest.mark.megatron
def test_jsonl_source_relative_to_invoking_directory(tmp_path):
    rng = random.Random(5)
    lines = []
    for g in range(12):
        prompt = [rng.randint(3, 60) for _ in range(rng.randint(3, 9))]
        for i in range(4):
            toks = prompt + [1] + [rng.randint(3, 60) for _ in range(rng.randint(2, 8))] + [2]
            lines.append({"group": f"q{g}", "tokens": toks, "prompt_length": len(prompt) + 1,
                          "reward": float(i % 2) if g % 2 else rng.random()})
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rollouts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    doc = spec_doc(**{"trainer.lossNormalization": "token", "rollout.numRollouts": 5,
                      "rollout.source": {"type": "jsonl", "jsonl": {"path": "data/rollouts.jsonl"}}})
    code, text = launch(doc, tmp_path / "out", "--trainers", "1", cwd=tmp_path)
    assert code == 0, text[-3000:]
    recs = records(tmp_path / "out")
    # 12 groups, 8 per source rollout, rewards differ in every group (nothing filtered): two dynamic steps, then
    # the file is exhausted (before numRollouts)
    assert [r["global_batch_size"] for r in recs] == [32, 16]
    data = summary(tmp_path / "out")["data"]
    assert data["samples_produced"] == 48 and data["samples_published"] == recs[-1]["samples_consumed"] == 48


# ------------------------------------------------------------------------------------------------ in-process
def _run(doc: dict, store_url: str, dp: int):
    return run_rollout(parse_trainingrun(doc), open_store(store_url), dp_size=dp, progress=lambda _m: None)


def test_static_microbatches_carry_a_dynamic_step_they_cannot_align(tmp_path):
    """8 samples per source rollout in groups of 2, microBatchSize 2 × microbatchMultiple 2 × 2 ranks: a step needs
    ≥ 4 samples (4 aligned micro-batches of ≥ 1 sample). Steps that the filter leaves smaller used to crash the
    rollout with the scheduler's ValueError (and every restart crashed again); now they are carried."""
    doc = spec_doc(**{"trainer.maxTokensPerGPU": None, "trainer.microBatchSize": 2, "trainer.microbatchMultiple": 2,
                      "rollout.groupSize": 2, "rollout.samplesPerRollout": 8, "rollout.numRollouts": 8,
                      "rollout.maxPendingRollouts": 100})
    url = f"file://{tmp_path}/store"
    result = _run(doc, url, 2)
    store = open_store(url)
    assert result.rollouts == 8
    carried_in = 0
    for k in range(result.rollouts):
        sched = store.read_schedule(k)
        DPSchedule.from_dict(sched["schedule"]).validate()
        assert all(n >= 4 for n in sched["global_batch_sizes"])
        carried_in += sched["carried_in"]
    assert carried_in > 0  # this seed does produce steps too small to align (the case that crashed)
    report = data_account(store).to_json()
    assert report["samples_produced"] == (report["samples_published"] + sum(report["samples_filtered"].values())
                                          + report["leftover_samples"])


def test_static_microbatches_fixed_step_too_small_is_a_config_error(tmp_path):
    doc = spec_doc(**{"trainer.maxTokensPerGPU": None, "trainer.microBatchSize": 1, "trainer.microbatchMultiple": 2,
                      "rollout.groupSize": 3, "rollout.samplesPerRollout": 30,
                      "rollout.steps": {"policy": "fixed", "globalBatchSize": 1},
                      "rollout.filters.zeroVariance": False, "rollout.maxPendingRollouts": 100})
    with pytest.raises(ConfigError, match=r"rollout\.steps\.globalBatchSize.*microBatchSize 1"):
        _run(doc, f"file://{tmp_path}/store", 2)


def test_jsonl_source_whose_samples_are_all_filtered_is_a_config_error(tmp_path):
    """Groups of one sample all have zero reward variance: the run used to 'succeed' with 0 steps."""
    path = tmp_path / "one.jsonl"
    path.write_text("".join(json.dumps({"group": g, "tokens": [5, 6, 7, 8], "prompt_length": 2, "reward": 1.0}) + "\n"
                            for g in range(10)))
    doc = spec_doc(**{"rollout.source": {"type": "jsonl", "jsonl": {"path": str(path)}},
                      "rollout.maxPendingRollouts": 100})
    with pytest.raises(ConfigError, match=r"10 samples gave no training step.*zero_variance 10"):
        _run(doc, f"file://{tmp_path}/store", 2)


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_waiting_for_a_released_rollout_is_rollout_released(backend, tmp_path, request):
    """The trainer tells 'the store is ahead of this run' (config error) from other store errors by this type."""
    from trainingrun.store import RolloutReleased
    from trainingrun.contract.errors import StoreError

    url = f"file://{tmp_path}/store" if backend == "file" else request.getfixturevalue("redis").url
    doc = spec_doc(**{"rollout.numRollouts": 2, "rollout.maxPendingRollouts": 100})
    _run(doc, url, 2)
    store = open_store(url)
    for k in range(2):
        store.ack(k, 0)
        store.ack(k, 1)
    store.release_upto(2)
    with pytest.raises(RolloutReleased, match="rollout 0 was released"):
        store.wait_rollout(0, timeout=1)
    assert issubclass(RolloutReleased, StoreError)
    assert store.wait_rollout(2, timeout=1) is False  # the stream ended after 2: not an error
