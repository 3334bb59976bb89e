"""The trainer's check that the engine generated with its weights (`weightSync.logprobTolerance`,
`weightSync.onLogprobMismatch`): on-policy steps only, the tolerance by engine dtype unless set, warn or fail."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainingrun.api import parse_trainingrun
from trainingrun.contract.errors import ConfigError
from trainingrun.trainer.report import LOGPROB_TOLERANCE, engine_logprob_mismatch
from trainingrun.trainer.trainer import Trainer

ON_POLICY = {"rollout": 7, "weight_version": 7, "policy_lag": 0, "step_in_rollout": 0}


@pytest.mark.parametrize("record", [
    {**ON_POLICY, "logprob_abs_diff": 0.01},  # at the tolerance: fine
    {**ON_POLICY, "logprob_abs_diff": 5.0, "policy_lag": 1},  # off-policy: the engine held older weights
    {**ON_POLICY, "logprob_abs_diff": 5.0, "step_in_rollout": 1},  # the trainer has updated since
    dict(ON_POLICY),  # no engine logprobs (replayed samples)
])
def test_no_message_when_the_engine_may_differ_or_agrees(record):
    assert engine_logprob_mismatch(record, 0.01) is None


def test_the_message_names_the_rollout_the_version_the_value_and_the_field():
    message = engine_logprob_mismatch({**ON_POLICY, "logprob_abs_diff": 0.0234}, 0.01)
    assert message is not None
    assert message.startswith("rollout 7: logprob_abs_diff 0.0234 (engine vs trainer on weight version 7)")
    assert "weightSync.logprobTolerance 0.01" in message


def _trainer(engine: dict, weight_sync: dict, rank: int = 0):
    """What check_engine_logprobs reads of a Trainer: its spec (parsed from a manifest) and rank."""
    doc = {"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "c"},
           "spec": {"model": {"preset": "tiny"}, "trainer": {"replicas": 1, "lossType": "ppo", "maxTokensPerGPU": 256},
                    "weightSync": weight_sync,
                    "rollout": {"source": {"type": "generate", "generate": {
                        "prompts": {"synthetic": {"task": "copy"}}, "reward": {"type": "token_match"}}},
                        "engine": engine, "samplesPerRollout": 8, "groupSize": 4}}}
    return SimpleNamespace(spec=parse_trainingrun(doc).spec, rank=rank)


def _bf16_vllm_trainer(rank: int = 0):
    """A vLLM engine serving bfloat16 weights, weightSync defaults (a vLLM spec needs a Hugging Face directory:
    only the fields the check reads)."""
    defaults = _trainer({"type": "megatron"}, {}).spec.weight_sync  # logprobTolerance unset, onLogprobMismatch warn
    spec = SimpleNamespace(weight_sync=defaults, rollout=SimpleNamespace(
        engine=SimpleNamespace(type="vllm", vllm=SimpleNamespace(dtype="bfloat16"))))
    return SimpleNamespace(spec=spec, rank=rank)


def test_a_bf16_engine_is_held_to_its_dtype_tolerance_and_warns_by_default(capsys):
    t = _bf16_vllm_trainer()
    Trainer.check_engine_logprobs(t, {**ON_POLICY, "logprob_abs_diff": LOGPROB_TOLERANCE["bfloat16"] * 0.9})
    assert capsys.readouterr().err == ""
    Trainer.check_engine_logprobs(t, {**ON_POLICY, "logprob_abs_diff": 0.5})
    err = capsys.readouterr().err
    assert err.startswith("[trainer 0] warning: rollout 7: logprob_abs_diff 0.5") and "0.3" in err
    Trainer.check_engine_logprobs(_bf16_vllm_trainer(rank=1),
                                  {**ON_POLICY, "logprob_abs_diff": 0.5})
    assert capsys.readouterr().err == "", "one line per run, from rank 0"


def test_a_set_tolerance_and_fail_end_the_run_with_a_configuration_error(capsys):
    t = _trainer({"type": "megatron"}, {"type": "store", "logprobTolerance": 0.001, "onLogprobMismatch": "fail"})
    Trainer.check_engine_logprobs(t, {**ON_POLICY, "logprob_abs_diff": 0.0009})
    with pytest.raises(ConfigError, match=r"weightSync.logprobTolerance 0.001.*failing the run "
                                          r"\(weightSync.onLogprobMismatch: fail\)"):
        Trainer.check_engine_logprobs(t, {**ON_POLICY, "logprob_abs_diff": 0.002})
    with pytest.raises(ConfigError, match=r"weightSync.logprobTolerance 0.001"):
        Trainer.check_engine_logprobs(_trainer({"type": "megatron"}, {"type": "store", "logprobTolerance": 0.001,
                                                                      "onLogprobMismatch": "fail"}, rank=1),
                                      {**ON_POLICY, "logprob_abs_diff": 0.002})  # every rank: all of them stop


@pytest.mark.parametrize("weight_sync,field", [({"logprobTolerance": 0}, "logprobTolerance"),
                                               ({"onLogprobMismatch": "ignore"}, "onLogprobMismatch")])
def test_bad_values_are_refused_naming_the_field(weight_sync, field):
    import pydantic

    with pytest.raises(pydantic.ValidationError, match=field):
        _trainer({"type": "megatron"}, {"type": "store", **weight_sync})
