"""The rollout program against real stores (temp directory and redis-server): determinism, varying sample counts,
leftover carry-over, backpressure, restart (SIGKILL and a crash between publish and state save), metrics, exit codes."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.services import free_port, metrics_ports, wait_for
from trainingrun.api import parse_trainingrun
from trainingrun.contract.errors import EXIT_CONFIG_ERROR, ConfigError
from trainingrun.metrics.rollout import RolloutMetrics
from trainingrun.contract.rollout_state import ROLLOUT_STATE_KEY
from trainingrun.rollout.main import run_rollout
from trainingrun.store import open_store

ROOT = Path(__file__).resolve().parents[2]

BASE = {
    "apiVersion": "trainingrun.dev/v1alpha1",
    "kind": "TrainingRun",
    "metadata": {"name": "t"},
    "spec": {
        "seed": 11,
        "model": {"preset": "tiny"},
        "trainer": {"replicas": 2, "maxTokensPerGPU": 128, "lossType": "policy_gradient"},
        "rollout": {
            "source": {"type": "synthetic", "synthetic": {"task": "reverse", "minLength": 3, "maxLength": 30,
                                                           "vocabSize": 12}},
            "samplesPerRollout": 48,
            "groupSize": 4,
            "filters": {"zeroVariance": True},
            "steps": {"policy": "fixed", "globalBatchSize": 5},
            "numRollouts": 6,
            "maxPendingRollouts": 100,
        },
    },
}


def make_doc(**rollout) -> dict:
    doc = copy.deepcopy(BASE)
    doc["spec"]["rollout"].update(rollout)
    return doc


def quiet(_msg: str) -> None:
    pass


@pytest.fixture(params=["file", "redis"])
def url_factory(request, tmp_path):
    """Returns fresh, independent store URLs of one backend."""
    counter = iter(range(100))
    if request.param == "file":
        return lambda: f"file://{tmp_path}/store{next(counter)}"
    server = request.getfixturevalue("redis")
    return lambda: f"{server.url}?prefix=s{next(counter)}"


def dump(store, n: int) -> list[tuple[dict, list[bytes]]]:
    """Every published rollout: schedule and each rank's payload arrays as bytes."""
    out = []
    for k in range(n):
        assert store.wait_rollout(k, timeout=1)
        sched = store.read_schedule(k)
        payloads = [b"".join(a.tobytes() for a in store.read_payload(k, r).values()) for r in range(sched["dp_size"])]
        out.append((sched, payloads))
    return out


def test_same_seed_publishes_identical_rollouts_and_counts_vary(url_factory):
    run = parse_trainingrun(make_doc())
    stores = [open_store(url_factory()) for _ in range(3)]
    results = [run_rollout(run, stores[0], progress=quiet), run_rollout(run, stores[1], progress=quiet)]
    other = parse_trainingrun({**make_doc(), "spec": {**make_doc()["spec"], "seed": 12}})
    run_rollout(other, stores[2], progress=quiet)
    assert results[0] == results[1] and results[0].rollouts == 6
    a, b, c = (dump(s, 6) for s in stores)
    assert a == b
    assert a != c
    assert all(s.wait_rollout(6, timeout=1) is False for s in stores)  # finish(6)
    # dynamic sampling: the zero-variance filter makes the per-rollout sample count vary
    produced = [s["produced"] for s, _ in a]
    filtered = [s["filtered"]["zero_variance"] for s, _ in a]
    assert set(produced) == {48} and len(set(filtered)) > 1
    assert len({s["num_samples"] for s, _ in a}) > 1
    # fixed policy: every step holds globalBatchSize groups of groupSize samples
    assert {g for s, _ in a for g in s["global_batch_sizes"]} == {20}


def test_leftover_groups_are_carried_into_the_next_rollout(url_factory):
    store = open_store(url_factory())
    result = run_rollout(parse_trainingrun(make_doc()), store, progress=quiet)
    published_ids = []
    carried = 0
    for k in range(result.rollouts):
        sched = store.read_schedule(k)
        ids = np.concatenate([store.read_payload(k, r)["sample_ids"] for r in range(2)])
        source = ids // 48  # synthetic sample ids: source rollout × samplesPerRollout + i
        assert sched["carried_in"] == carried
        assert int((source < sched["source_index"]).sum()) == carried  # the carried samples come first from earlier
        assert sched["num_samples"] == sched["carried_in"] + sched["produced"] - sum(sched["filtered"].values()) - sched["carried_out"]
        carried = sched["carried_out"]
        published_ids.extend(ids.tolist())
        assert sched["step_offset"] == sum(store.read_schedule(j)["num_steps"] for j in range(k))
    assert len(published_ids) == len(set(published_ids)) == result.samples  # each sample published once
    assert result.leftover_samples == carried > 0  # reported, not silently dropped
    state = store.get_json(ROLLOUT_STATE_KEY)
    assert state["finished"] and len(state["carried"]) == result.leftover_groups


def test_crash_between_publish_and_state_save_resumes_identically(url_factory):
    run = parse_trainingrun(make_doc())
    reference = open_store(url_factory())
    run_rollout(run, reference, progress=quiet)

    store = open_store(url_factory())

    class Killed(Exception):
        pass

    class DiesAfterPublishing:
        """The real store, but the process 'dies' right after committing rollout 3, before saving its state."""

        def __init__(self, inner):
            self.inner = inner
            self.url = inner.url

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def put_json(self, key, value):
            if key == ROLLOUT_STATE_KEY and value["next_rollout"] == 4:
                raise Killed()
            self.inner.put_json(key, value)

    with pytest.raises(Killed):
        run_rollout(run, DiesAfterPublishing(store), progress=quiet)
    assert store.is_committed(3) and store.get_json(ROLLOUT_STATE_KEY)["next_rollout"] == 3
    messages = []
    result = run_rollout(run, store, progress=messages.append)
    assert result.resumed and result.rollouts == 6
    assert any("rollout 3 (already committed: re-publish skipped)" in m for m in messages)
    assert dump(store, 6) == dump(reference, 6)


def test_rollout_process_killed_and_restarted(tmp_path):
    reference = open_store(f"file://{tmp_path}/ref")
    run_rollout(parse_trainingrun(make_doc()), reference, progress=quiet)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(make_doc(maxPendingRollouts=3)))
    url = f"file://{tmp_path}/store"
    env = {**os.environ, "TRAININGRUN_CONFIG": str(config), "TRAININGRUN_STORE_URL": url, "TRAININGRUN_RUN": "t"}
    env.pop("TRAININGRUN_METRICS_PORT", None)
    proc = subprocess.Popen([sys.executable, "-m", "trainingrun", "rollout"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    store = open_store(url)
    try:
        # no trainers: it publishes 3 rollouts and then waits (backpressure) — kill it there
        wait_for(lambda: (store.get_json(ROLLOUT_STATE_KEY) or {}).get("next_rollout") == 3, 30, "3 rollouts published")
        time.sleep(0.3)
        assert proc.poll() is None and not store.is_committed(3)
    finally:
        proc.send_signal(signal.SIGKILL)
        out = proc.communicate(timeout=10)[0].decode()
    assert "waiting for trainers (3 rollouts pending >= maxPendingRollouts=3)" in out
    for k in range(2):  # trainers consumed two rollouts
        store.ack(k, 0)
        store.ack(k, 1)
    config.write_text(yaml.safe_dump(make_doc(maxPendingRollouts=100)))  # not part of the data: may change
    proc = subprocess.run([sys.executable, "-m", "trainingrun", "rollout"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "resuming at rollout 3" in proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["rollouts"] == 6
    assert dump(store, 6) == dump(reference, 6)


def test_backpressure_never_exceeds_max_pending(url_factory):
    url = url_factory()
    run = parse_trainingrun(make_doc(maxPendingRollouts=1, numRollouts=4))
    errors = []
    producer = threading.Thread(
        target=lambda: errors.extend([None]) if run_rollout(run, open_store(url), progress=quiet, poll_interval=0.02) else None
    )
    producer.start()
    trainer = open_store(url)
    try:
        for k in range(4):
            assert trainer.wait_rollout(k, timeout=20)
            time.sleep(0.3)  # the rollout had time to publish more, were it allowed
            assert not trainer.is_committed(k + 1)
            assert trainer.pending_rollouts() == 1
            for rank in range(2):
                trainer.read_payload(k, rank)
                trainer.ack(k, rank)
        assert trainer.wait_rollout(4, timeout=20) is False
    finally:
        producer.join(20)
    assert errors == [None]


def test_metrics_count_what_was_published(tmp_path):
    metrics = RolloutMetrics("t")
    port = metrics.serve(free_port())
    try:
        result = run_rollout(parse_trainingrun(make_doc()), open_store(f"file://{tmp_path}/s"), metrics=metrics,
                             progress=quiet)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        metrics.close()
    from prometheus_client.parser import text_string_to_metric_families

    values = {(s.name, s.labels.get("filter")): s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert values[("trainingrun_rollout_samples_produced_total", None)] == result.totals["produced"] == 6 * 48
    assert values[("trainingrun_rollout_samples_filtered_total", "zero_variance")] == result.totals["zero_variance"]
    assert values[("trainingrun_rollout_samples_published_total", None)] == result.samples
    assert values[("trainingrun_rollout_rollouts_published_total", None)] == result.rollouts
    assert values[("trainingrun_rollout_publish_seconds_count", None)] == result.rollouts
    assert values[("trainingrun_rollout_schedule_imbalance", None)] >= 1.0


def test_rollout_program_lingers_serving_its_final_metrics(tmp_path):
    """With metrics.lingerSeconds the finished rollout keeps /metrics up (final counters = its summary), then exits;
    a short-lived rollout would otherwise end between two scrapes and its last values would never be seen."""
    doc = make_doc(numRollouts=2)
    doc["spec"]["metrics"] = {"lingerSeconds": 3}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(doc))
    port = metrics_ports(1)
    env = {**os.environ, "TRAININGRUN_CONFIG": str(config), "TRAININGRUN_STORE_URL": f"file://{tmp_path}/store",
           "TRAININGRUN_RUN": "t", "TRAININGRUN_METRICS_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "-m", "trainingrun", "rollout"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        summary = json.loads(proc.stdout.readline())  # printed when the work is done, before lingering
        finished = time.monotonic()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert proc.poll() is None, "the rollout exited instead of lingering"
        code = proc.wait(timeout=30)
        lingered = time.monotonic() - finished
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
    from prometheus_client.parser import text_string_to_metric_families

    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert code == 0 and summary["rollouts"] == 2
    assert values["trainingrun_rollout_samples_published_total"] == summary["samples"] > 0
    assert values["trainingrun_rollout_rollouts_published_total"] == 2
    assert 2.0 < lingered < 20, lingered


def test_jsonl_source_end_to_end(tmp_path):
    rng = np.random.default_rng(0)
    lines = []
    for g in range(10):
        for i in range(3):
            n = int(rng.integers(3, 20))
            reward = 1.0 if g % 3 == 0 else float(i)  # every third group has zero variance
            lines.append({"group": f"p{g}", "tokens": rng.integers(0, 256, size=n).tolist(), "prompt_length": 2,
                          "reward": reward})
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    doc = make_doc(source={"type": "jsonl", "jsonl": {"path": str(path)}}, samplesPerRollout=12, groupSize=3,
                   steps={"policy": "dynamic"}, numRollouts=100)
    store = open_store(f"file://{tmp_path}/s")
    result = run_rollout(parse_trainingrun(doc), store, progress=quiet)
    # 10 groups, 4 per source rollout → 3 source rollouts; groups 0, 3, 6, 9 have zero variance
    assert result.rollouts == 3 and result.totals["zero_variance"] == 12 and result.samples == 18
    assert store.wait_rollout(3, timeout=1) is False
    payload = store.read_payload(0, 0)
    for j, sid in enumerate(payload["sample_ids"]):
        line = lines[int(sid)]
        a, b = payload["offsets"][j], payload["offsets"][j + 1]
        assert payload["tokens"][a:b].tolist() == line["tokens"]
        assert payload["loss_mask"][a:b].tolist() == [0, 0] + [1] * (b - a - 2)
        assert payload["rewards"][j] == line["reward"]
        assert payload["advantages"][j] == pytest.approx({0.0: -1.2247, 1.0: 0.0, 2.0: 1.2247}[line["reward"]], abs=1e-3)


def test_jsonl_advantages_and_reinforce_pp_are_refused_naming_the_estimator(tmp_path):
    """Given advantages are used as they are; reinforce_pp would normalise them over the step: a config error naming
    trainer.advantage.estimator, nothing published."""
    path = tmp_path / "adv.jsonl"
    path.write_text("\n".join(json.dumps({"group": g, "tokens": [3, 4, 5, 6], "prompt_length": 2, "advantage": a})
                              for g in range(4) for a in (-1.0, 1.0)))
    doc = make_doc(source={"type": "jsonl", "jsonl": {"path": str(path)}}, samplesPerRollout=4, groupSize=2,
                   steps={"policy": "dynamic"})
    doc["spec"]["trainer"]["lossType"] = "policy_gradient"
    doc["spec"]["trainer"]["advantage"] = {"estimator": "reinforce_pp"}
    store = open_store(f"file://{tmp_path}/s")
    with pytest.raises(ConfigError, match="trainer.advantage.estimator"):
        run_rollout(parse_trainingrun(doc), store, progress=quiet)
    assert not store.is_committed(0)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(groupSize=1, samplesPerRollout=8), "rollout.filters.zeroVariance"),
        (dict(source={"type": "jsonl", "jsonl": {"path": "/nonexistent.jsonl"}}), "rollout.source.jsonl.path"),
        (dict(steps={"policy": "fixed", "globalBatchSize": 1}, groupSize=2, samplesPerRollout=8, trainers=4),
         "rollout.steps.globalBatchSize"),
        (dict(samplesPerRollout=7), "samplesPerRollout"),
    ],
)
def test_config_errors_exit_78_naming_the_field(tmp_path, change, message):
    change = dict(change)
    doc = make_doc(**{k: v for k, v in change.items() if k != "trainers"})
    if "trainers" in change:
        doc["spec"]["trainer"]["replicas"] = change["trainers"]
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(doc))
    proc = subprocess.run(
        [sys.executable, "-m", "trainingrun", "rollout", "--config", str(config), "--store", f"file://{tmp_path}/s"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "s" / "rollouts").exists() or not any((tmp_path / "s" / "rollouts").iterdir())
