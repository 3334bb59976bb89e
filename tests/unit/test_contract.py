"""The typed contracts between processes (`trainingrun.contract`): the process environment, the trainers' progress
record and resume point. Each is written by one process and read by another; these tests hold both ends to one
value."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainingrun.api import load_trainingrun
from trainingrun.contract.env import ProcessEnv
from trainingrun.contract.errors import ConfigError, CorruptPayload
from trainingrun.contract.progress import PROGRESS_KEY, ProgressRecord
from trainingrun.contract.resume import RESUME_KEY, ResumePoint
from trainingrun.contract.rollout_state import ROLLOUT_STATE_KEY, RolloutStateRecord, data_account
from trainingrun.operator.observe import Observed, ProgressObs
from trainingrun.operator.progress import ProgressReader
from trainingrun.operator.status import decide
from trainingrun.plan import build_plan
from trainingrun.store import open_store

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny.yaml"
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)

# ------------------------------------------------------------------------------------------------ environment
_text = st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), min_size=1, max_size=40)
_count = st.none() | st.integers(0, 2**63 - 1)
_envs = st.builds(
    ProcessEnv, run=st.none() | _text, store_url=st.none() | _text, config=st.none() | _text, attempt=_count,
    run_epoch=_count, metrics_port=_count, metrics_jsonl=st.none() | _text, output_dir=st.none() | _text,
    engine_url=st.none() | _text, engine_url_file=st.none() | _text, node_rank=_count, num_nodes=_count,
    log_timestamps=st.booleans(),
)


@given(_envs)
def test_process_env_round_trips_through_the_environment(env):
    variables = env.to_env()
    assert all(name.startswith("TRAININGRUN_") and isinstance(v, str) for name, v in variables.items())
    assert ProcessEnv.from_environ(variables) == env
    # a process's environment holds other variables too; they do not change what it reads
    assert ProcessEnv.from_environ({**variables, "PATH": "/bin", "TRAININGRUN_CHILD_COMMAND": "x"}) == env


def test_the_pod_contract_variables_keep_their_names():
    """design.md: trainer pods get TRAININGRUN_STORE_URL and TRAININGRUN_RUN."""
    assert ProcessEnv(run="r", store_url="redis://s:6379/0").to_env() == {
        "TRAININGRUN_RUN": "r", "TRAININGRUN_STORE_URL": "redis://s:6379/0"}


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(ProcessEnv) if f.metadata["kind"] is int])
@pytest.mark.parametrize("raw", ["x", "-1", "1.5", " 3", "٣"])
def test_a_malformed_number_in_the_environment_is_refused_naming_the_variable(field, raw):
    name = next(f.metadata["env"] for f in dataclasses.fields(ProcessEnv) if f.name == field)
    with pytest.raises(ConfigError, match=f"environment: {name}=.* is not a decimal integer >= 0"):
        ProcessEnv.from_environ({name: raw})


def test_an_empty_variable_is_unset():
    assert ProcessEnv.from_environ({"TRAININGRUN_ATTEMPT": "", "TRAININGRUN_RUN": ""}) == ProcessEnv()


@pytest.mark.parametrize("kwargs", [{"attempt": -1}, {"metrics_port": True}, {"run": ""}, {"config": "a\0b"},
                                    {"log_timestamps": None}])
def test_a_process_env_that_no_environment_could_carry_is_refused_naming_the_field(kwargs):
    (field, _), = kwargs.items()
    with pytest.raises(ConfigError, match=rf"\({field}\)"):
        ProcessEnv(**kwargs)


def test_every_process_of_the_plan_reads_back_what_the_plan_gave_it():
    run = load_trainingrun(TINY)
    plan = build_plan(run, store_url="file:///s", config_path="/c/run.yaml", master_addr="m", attempt=3, epoch=17,
                      metrics_port=9100, distinct_ports=True,
                      extra_env=ProcessEnv(metrics_jsonl="/r/m.jsonl", log_timestamps=True).to_env())
    for p in plan.processes:
        env = ProcessEnv.from_environ(p.env)
        assert (env.run, env.store_url, env.config, env.attempt, env.run_epoch) == (
            run.metadata.name, "file:///s", "/c/run.yaml", 3, 17)
        assert env.metrics_port == p.metrics_port and env.metrics_jsonl == "/r/m.jsonl" and env.log_timestamps


# ------------------------------------------------------------------------------------------------ progress record
_records = st.builds(
    ProgressRecord, step=st.integers(0, 2**63 - 1), time=st.floats(0, 253402300799.0),
    rollout=_count, samples_consumed=_count, last_global_batch_size=_count, attempt=_count,
    loss=st.none() | st.floats(allow_nan=False, allow_infinity=False), lr=st.none() | st.floats(0, 1),
    tokens=_count, samples_per_second=st.none() | st.floats(0, 1e9),
)


@given(_records)
def test_progress_record_round_trips_through_its_json_form(record):
    assert ProgressRecord.from_json(record.to_json()) == record


def test_progress_record_through_a_store(tmp_path):
    store = open_store(f"file://{tmp_path}/s")
    assert ProgressRecord.read(store) is None
    record = ProgressRecord(step=4, time=1.5e9, rollout=1, samples_consumed=40, last_global_batch_size=12, attempt=2,
                            loss=0.25, lr=1e-4, tokens=800, samples_per_second=3.0)
    record.write(store)
    assert store.get_json(PROGRESS_KEY)["last_global_batch_size"] == 12  # the key the operator has always read
    assert ProgressRecord.read(open_store(f"file://{tmp_path}/s")) == record


@pytest.mark.parametrize("doc, field", [
    ({"time": 1.0}, "step"),
    ({"step": 1}, "time"),
    ({"step": True, "time": 1.0}, "step"),
    ({"step": -1, "time": 1.0}, "step"),
    ({"step": 1.0, "time": 1.0}, "step"),
    ({"step": 1, "time": "now"}, "time"),
    ({"step": 1, "time": 1e300}, "time"),  # no date holds it: the operator's hang detection would crash on it
    ({"step": 1, "time": float("nan")}, "time"),
    ({"step": 1, "time": 1.0, "rollout": "2"}, "rollout"),
    ({"step": 1, "time": 1.0, "samples_consumed": None}, "samples_consumed"),
    ({"step": 1, "time": 1.0, "last_global_batch_size": 2**63}, "last_global_batch_size"),
    ({"step": 1, "time": 1.0, "loss": "0.5"}, "loss"),
])
def test_a_malformed_progress_record_is_refused_naming_the_field(doc, field):
    with pytest.raises(CorruptPayload, match=rf"key progress: {field} (must be|is missing)"):
        ProgressRecord.from_json(doc)


def test_a_malformed_stored_progress_record_names_the_store_and_the_key(tmp_path):
    url = f"file://{tmp_path}/s"
    open_store(url).put_json(PROGRESS_KEY, {"step": "seven", "time": 1.0})
    with pytest.raises(CorruptPayload, match=rf"store {url}: key progress: step must be an integer"):
        ProgressRecord.read(open_store(url))


def test_fields_a_reader_does_not_know_are_ignored():
    assert ProgressRecord.from_json({"step": 2, "time": 1.0, "new_field": [1]}) == ProgressRecord(step=2, time=1.0)


def _status(progress: ProgressObs) -> dict:
    run = load_trainingrun(TINY)
    return decide(run, None, Observed(progress=progress), now=NOW).status


def test_the_trainers_record_reaches_the_status_through_the_dataclass(tmp_path):
    from trainingrun.trainer.report import StepReporter

    store = open_store(f"file://{tmp_path}/s")
    step = {"step": 7, "rollout": 2, "global_batch_size": 12, "loss": 0.5, "lr": 1e-3, "samples_consumed": 93,
            "tokens": 900, "attempt": 1, "samples_per_second": 4.0, "time": NOW.timestamp() - 5,
            "num_microbatches": 2, "grad_norm": 1.0}
    StepReporter(None, store, rank=0, jsonl_path=None).write(step)
    st_ = _status(ProgressObs(ProgressRecord.read(store)))
    assert (st_["step"], st_["samplesConsumed"], st_["lastGlobalBatchSize"], st_["rollout"]) == (7, 93, 12, 2)


def test_camel_case_keys_are_not_read_any_more():
    before = _status(ProgressObs({"step": 3, "time": NOW.timestamp()}))
    camel = _status(ProgressObs({"step": 3, "time": NOW.timestamp(), "samplesConsumed": 30, "lastGlobalBatchSize": 5}))
    assert camel["step"] == 3
    assert (camel["samplesConsumed"], camel["lastGlobalBatchSize"]) == (before["samplesConsumed"],
                                                                        before["lastGlobalBatchSize"])


def test_the_operator_observes_a_malformed_record_as_unreadable_progress_naming_the_field(redis):
    url = redis.url
    open_store(url).put_json(PROGRESS_KEY, {"step": 3, "time": 1e300})

    async def observe() -> ProgressObs:
        reader = ProgressReader(max_age=0.0)
        try:
            for _ in range(200):
                obs = reader.peek(url)
                if obs is not None:
                    return obs
                await asyncio.sleep(0.02)
            raise AssertionError("no observation")
        finally:
            reader.forget(url)

    obs = asyncio.run(observe())
    assert obs.value is None and "CorruptPayload" in obs.error and "key progress: time must be" in obs.error
    cond = next(c for c in _status(obs)["conditions"] if c["type"] == "ProgressUnknown")
    assert cond["status"] == "True" and "time must be" in cond["message"]


# ------------------------------------------------------------------------------------------------ resume point
def test_resume_point_through_a_store(tmp_path):
    store = open_store(f"file://{tmp_path}/s")
    assert ResumePoint.read(store) is None
    point = ResumePoint(rollout=4, step_in_rollout=1, global_step=9, samples_consumed=90, attempt=2)
    point.write(store)
    assert ResumePoint.read(open_store(f"file://{tmp_path}/s")) == point


@pytest.mark.parametrize("doc, field", [
    ({"step_in_rollout": 0, "global_step": 0, "samples_consumed": 0, "attempt": 0}, "rollout"),
    ({"rollout": 1, "step_in_rollout": -1, "global_step": 0, "samples_consumed": 0, "attempt": 0}, "step_in_rollout"),
    ({"rollout": 1, "step_in_rollout": 0, "global_step": "9", "samples_consumed": 0, "attempt": 0}, "global_step"),
])
def test_a_malformed_resume_point_is_refused_naming_the_field(tmp_path, doc, field):
    url = f"file://{tmp_path}/s"
    open_store(url).put_json(RESUME_KEY, doc)
    with pytest.raises(CorruptPayload, match=rf"store {url}: key trainer_resume: {field} (must be|is missing)"):
        ResumePoint.read(open_store(url))


# ------------------------------------------------------------------------------------------------ rollout state
def _group(gid: int, lengths: list[int]):
    import numpy as np

    from trainingrun.rollout.groups import SampleGroup

    n = len(lengths)
    return SampleGroup(group_id=gid, tokens=[np.arange(m, dtype=np.int32) for m in lengths],
                       loss_masks=[np.ones(m, np.uint8) for m in lengths], rewards=np.arange(n, dtype=np.float32),
                       sample_ids=np.arange(gid * n, (gid + 1) * n, dtype=np.int64))


def test_the_rollouts_state_reaches_the_launchers_data_account_through_the_record(tmp_path):
    """The rollout writes its state through `RolloutStateRecord`; the rollout on restart and the launcher's account
    read it back through the same record."""
    from trainingrun.rollout.loop import RolloutState

    store = open_store(f"file://{tmp_path}/s")
    assert RolloutStateRecord.read(store) is None and data_account(store) is None
    state = RolloutState(fingerprint="abc", next_rollout=3, source_index=5, step_offset=7, samples_offset=40,
                         carried=[_group(1, [3, 4]), _group(2, [5, 2, 2])], empty_streak=1,
                         totals={"produced": 60, "max_length": 4, "zero_variance": 8, "stale": 1}, finished=True,
                         stream={"next": 9})
    state.save(store)
    back = RolloutState.from_record(RolloutStateRecord.read(open_store(f"file://{tmp_path}/s")))
    assert back.to_record().to_json() | {"updated_at": 0} == state.to_record().to_json() | {"updated_at": 0}
    assert [g.lengths for g in back.carried] == [[3, 4], [5, 2, 2]]
    assert data_account(store).to_json() == {
        "finished": True, "rollouts_published": 3, "source_rollouts": 5, "steps_published": 7,
        "samples_published": 40, "samples_produced": 60,
        "samples_filtered": {"max_length": 4, "zero_variance": 8, "stale": 1},
        "leftover_groups": 2, "leftover_samples": 5}
    assert data_account(store).left_over


@pytest.mark.parametrize("change, field", [
    ({"version": 2}, "unknown state version 2"),
    ({"next_rollout": "3"}, "next_rollout must be"),
    ({"step_offset": -1}, "step_offset must be"),
    ({"finished": "yes"}, "finished must be"),
    ({"fingerprint": None}, "fingerprint must be"),
    ({"carried": [{"group_id": 1}]}, r"carried\[0\]\.offsets must be"),
    ({"staged": {}}, "staged must be a list"),
    ({"totals": {"produced": 1.5}}, "totals: produced must be"),
    ({"stream": [1]}, "stream must be a JSON object"),
])
def test_a_malformed_rollout_state_is_refused_naming_the_field(tmp_path, change, field):
    url = f"file://{tmp_path}/s"
    good = RolloutStateRecord(fingerprint="f", totals={"produced": 1}).to_json()
    assert RolloutStateRecord.from_json(good).totals == {"produced": 1}  # the unchanged record is read
    open_store(url).put_json(ROLLOUT_STATE_KEY, {**good, **change})
    with pytest.raises(CorruptPayload, match=rf"store {url}: key rollout_state: {field}"):
        RolloutStateRecord.read(open_store(url))


# ------------------------------------------------------------------------------------------------ the room itself
def test_the_contract_imports_nothing_above_it():
    """Both sides import the contracts, so `trainingrun.contract` may use only the standard library, numpy,
    `trainingrun.schedule` and itself (no store, no API, no program) — at module level and inside functions."""
    import ast
    import sys

    allowed = ("numpy", "trainingrun.contract", "trainingrun.schedule")
    found = []
    for path in sorted((ROOT / "trainingrun" / "contract").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and not any(name == a or name.startswith(a + ".")
                                                                   for a in allowed):
                    found.append(f"{path.name}: {name}")
    assert not found, found
