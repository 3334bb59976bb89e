"""Offline validation: the invalid corpus, the examples, and the CLI's exit codes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainingrun.api import load_trainingrun
from trainingrun.api.validate import validate_text

ROOT = Path(__file__).resolve().parents[2]
CORPUS = sorted((ROOT / "tests/data/invalid").glob("*.yaml"))
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def expected_field(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name} lacks its '# expect: FIELD' header"
    return first.removeprefix("# expect: ")


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 30


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_invalid_manifest_is_rejected_naming_the_field(path: Path):
    lines = validate_text(path.read_text(), path.name)
    assert lines, f"{path.name} was accepted"
    field = expected_field(path)
    assert any(field in line for line in lines), f"no error names {field!r}: {lines}"
    assert all(line.startswith(path.name) for line in lines)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_are_valid(path: Path):
    assert validate_text(path.read_text(), path.name) == []
    load_trainingrun(path)  # and the models accept them


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainingrun", "validate", *args],
        capture_output=True, text=True, input=stdin, cwd=ROOT, timeout=60,
    )


def test_cli_exit_codes_and_no_traceback():
    bad = run_cli(*map(str, CORPUS))
    assert bad.returncode == 1
    assert "Traceback" not in bad.stderr
    # one line per error, each naming its file; every corpus file is reported
    reported = {line.split(":")[0].split("#")[0] for line in bad.stderr.splitlines()}
    assert reported == {str(p) for p in CORPUS}

    good = run_cli(str(ROOT / "examples/tiny.yaml"))
    assert good.returncode == 0, good.stderr
    assert "valid" in good.stdout


def test_cli_reads_stdin_and_reports_missing_files(tmp_path):
    text = (ROOT / "examples/tiny.yaml").read_text()
    assert run_cli("-", stdin=text).returncode == 0
    missing = run_cli(str(tmp_path / "nope.yaml"))
    assert missing.returncode == 1
    assert "nope.yaml: cannot read" in missing.stderr


def test_multi_document_stream_reports_each_document():
    good = (ROOT / "examples/tiny.yaml").read_text()
    doc = yaml.safe_load(good)
    doc["spec"]["trainer"]["replicas"] = 0
    second = yaml.safe_dump(doc, sort_keys=False)
    lines = validate_text(good + "---\n" + second, "runs.yaml")
    # the line and column of the field in the second document
    line_no = len(good.splitlines()) + 1 + second.splitlines().index("    replicas: 0") + 1
    assert lines and all(line.startswith(f"runs.yaml:{line_no}:5: spec.trainer.replicas:") for line in lines), lines


def test_message_says_what_is_allowed():
    text = (ROOT / "tests/data/invalid/bad-loss-type.yaml").read_text()
    (line,) = validate_text(text, "f")
    assert "'sft'" in line and "'policy_gradient'" in line and "'ppo'" in line and "'dpo'" in line


# Mistakes the trainer or the rollout used to find only at run time, minutes after the API server and `validate` had
# admitted the spec: each is a CEL rule (with its Python twin) now. (rule name, changes to examples/tiny.yaml's spec,
# the field the error names, what it says is allowed.)
GENERATED_VLLM = {"model": {"hf": "/models/smollm2"}, "weightSync": {"type": "disk"},
                  "rollout": {"source": {"type": "generate", "generate": {}}, "engine": {"type": "vllm"}}}
MOE = {"architecture": "llama", "numLayers": 2, "hiddenSize": 32, "numAttentionHeads": 4, "vocabSize": 64,
       "seqLength": 64, "moe": {"numExperts": 6, "topK": 2, "ffnHiddenSize": 16}}
FORMER_RUN_TIME_CHECKS = {
    "kl-penalty-not-pipelined": (
        {**GENERATED_VLLM, "trainer": {"pipelineParallelSize": 2, "lossType": "ppo", "policyLoss": {"klCoef": 0.1}}},
        "spec.trainer.policyLoss.klCoef", "allowed: klCoef 0, or pipelineParallelSize 1"),
    "trainer-old-logprobs-not-pipelined": (
        {**GENERATED_VLLM, "trainer": {"pipelineParallelSize": 2, "lossType": "policy_gradient",
                                       "policyLoss": {"oldLogprobs": "trainer"}}},
        "spec.trainer.policyLoss.oldLogprobs", "allowed: oldLogprobs engine, or pipelineParallelSize 1"),
    "trainer-old-logprobs-not-expert-parallel": (
        {"model": MOE, "rollout": {"source": {"type": "generate", "generate": {}}},
         "trainer": {"expertParallelSize": 2, "lossType": "policy_gradient", "policyLoss": {"oldLogprobs": "trainer"}}},
        "spec.trainer.policyLoss.oldLogprobs", "allowed: oldLogprobs engine, or expertParallelSize 1"),
    "store-sync-single-stage": (
        {"rollout": {"source": {"type": "generate", "generate": {}}}, "trainer": {"pipelineParallelSize": 2}},
        "spec.weightSync.type", "allowed: pipelineParallelSize 1 with store, or the vllm engine"),
    "zero-variance-needs-groups": (
        {"rollout": {"groupSize": 1}},
        "spec.rollout.filters.zeroVariance", "allowed: groupSize >= 2, or filters.zeroVariance false"),
    "fixed-steps-fill-the-ranks": (
        {"rollout": {"steps": {"policy": "fixed", "globalBatchSize": 1}}, "trainer": {"replicas": 8}},
        "spec.rollout.steps.globalBatchSize", "allowed: globalBatchSize × groupSize >= the data-parallel ranks"),
}


REPLACED = ("model", "source")  # taken whole from the changes, not merged into tiny's


def tiny_with(changes: dict) -> dict:
    """examples/tiny.yaml with `changes` merged into its spec (mappings merged, except REPLACED; other values
    replaced)."""
    def merge(base: dict, extra: dict) -> dict:
        out = dict(base)
        for key, value in extra.items():
            nested = isinstance(value, dict) and isinstance(base.get(key), dict) and key not in REPLACED
            out[key] = merge(base[key], value) if nested else value
        return out

    doc = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    doc["spec"] = merge(doc["spec"], changes)
    return doc


@pytest.mark.parametrize("name", sorted(FORMER_RUN_TIME_CHECKS))
def test_former_run_time_checks_are_refused_by_validate_naming_the_field(name, tmp_path):
    changes, field, allowed = FORMER_RUN_TIME_CHECKS[name]
    doc = tiny_with(changes)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    (line,) = validate_text(path.read_text(), str(path))  # exactly this mistake, nothing else
    assert f": {field}: " in line and allowed in line, line
    assert line.startswith(f"{path}:")
    # the loaders without the CEL engine (the Python twin) refuse it too, with the same message
    from trainingrun.api import parse_trainingrun
    from trainingrun.api.models import ALL_MODELS

    (rule,) = [r for m in ALL_MODELS for r in m.CEL_RULES if r.name == name]
    with pytest.raises(ValueError, match=re.escape(rule.message)):
        parse_trainingrun(doc)


def test_validate_cli_refuses_each_former_run_time_check(tmp_path):
    paths = []
    for name, (changes, _, _) in sorted(FORMER_RUN_TIME_CHECKS.items()):
        paths.append(tmp_path / f"{name}.yaml")
        paths[-1].write_text(yaml.safe_dump(tiny_with(changes), sort_keys=False))
    proc = run_cli(*map(str, paths))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    for path, (_, field, _) in zip(paths, (FORMER_RUN_TIME_CHECKS[n] for n in sorted(FORMER_RUN_TIME_CHECKS))):
        assert any(line.startswith(f"{path}:") and f": {field}: " in line for line in proc.stderr.splitlines()), (
            path, proc.stderr)


def test_run_refuses_too_many_trainers_for_fixed_steps_before_starting_anything(tmp_path):
    """`--trainers` is applied before validation: fixed steps of 2 synthetic groups of 4 samples fill 2 ranks, not 16;
    `trainingrun run` refuses at once (exit 1, the line `validate` prints for the same spec), starting nothing."""
    doc = tiny_with({"rollout": {"steps": {"policy": "fixed", "globalBatchSize": 2}}})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert validate_text(path.read_text(), str(path)) == []
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "trainingrun", "run", str(path), "--trainers", "16", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert ": spec.rollout.steps.globalBatchSize: " in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists()


def _hf_dir(tmp_path: Path, hidden: int, heads: int) -> Path:
    import json

    d = tmp_path / f"model-{hidden}-{heads}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_attention_heads": heads, "num_key_value_heads": heads,
        "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0}))
    return d


@pytest.mark.parametrize("hidden,heads,gpus,url,refused", [
    (64, 4, 0, None, True),  # head_dim 16: vLLM's CPU attention refuses it at the first request
    (128, 4, 0, None, False),  # head_dim 32
    (64, 4, 1, None, False),  # the engine has GPUs
    (64, 4, 0, "http://vllm:8000", False),  # the user's servers: their hardware is not the spec's to know
])
def test_validate_refuses_a_head_dim_the_run_s_own_cpu_engines_cannot_run(tmp_path, hidden, heads, gpus, url,
                                                                         refused):
    engine = {"type": "vllm", "vllm": {"gpus": gpus}, **({"url": url} if url else {})}
    doc = tiny_with({"model": {"hf": str(_hf_dir(tmp_path, hidden, heads)), "seqLength": 64},
                     "trainer": {"lossType": "ppo"},
                     "rollout": {"source": {"type": "generate", "generate": {
                         "prompts": {"type": "synthetic"}, "reward": {"type": "token_match"}}},
                         "engine": engine},
                     "weightSync": {"type": "disk"}})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    lines = validate_text(path.read_text(), str(path))
    if not refused:
        assert lines == []
        return
    (line,) = lines
    assert ": spec.model.hf: head dimension 16" in line and "32, 64, 80" in line and "rollout.engine.vllm.gpus" in line


def test_an_agent_run_evaluates_only_with_its_own_eval_reward():
    """An agent run has no reward of its own (source.generate.reward is none): rollout.eval needs eval.reward there
    (rule eval-needs-generate), else the evaluation would have nothing to score with."""
    import yaml

    from trainingrun.api.models import parse_trainingrun

    doc = yaml.safe_load((ROOT / "examples" / "agent-gateway.yaml").read_text())
    doc["spec"]["rollout"]["eval"] = {"intervalRollouts": 4, "prompts": doc["spec"]["rollout"]["source"]["generate"]
                                      ["prompts"]}
    with pytest.raises(ValueError, match="with an agent its own eval.reward"):
        parse_trainingrun(doc)
    doc["spec"]["rollout"]["eval"]["reward"] = {"type": "exact_match"}
    assert parse_trainingrun(doc).spec.rollout.eval.reward.type == "exact_match"
