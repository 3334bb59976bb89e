"""The one strict manifest loader (trainingrun.api.manifest, decoding with trainingrun.api.yamlcodec): limits,
duplicate keys, no coercion, bounds, line numbers, and the same errors from every entry point (validate, run, rollout,
trainer, operator)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from trainingrun.api import ManifestError, load_trainingrun, parse_trainingrun
from trainingrun.api.crd import spec_schema, status_schema
from trainingrun.api.yamlcodec import Limits, dump_yaml, parse_yaml
from trainingrun.api.validate import validate_text

ROOT = Path(__file__).resolve().parents[2]
TINY = (ROOT / "examples/tiny.yaml").read_text()


def cli(*args: str, cwd: Path = ROOT, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainingrun", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def variant(old: str, new: str) -> str:
    assert old in TINY, old
    return TINY.replace(old, new, 1)


def alias_bomb(levels: int = 10) -> str:
    """A ~1 KB YAML whose aliases expand to 9^levels strings (a "billion laughs")."""
    lines = ['    l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"    l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]")
    return variant("metadata:\n", "metadata:\n  annotations:\n" + "\n".join(lines).replace("    ", "  ", 0) + "\n")


# ---------------------------------------------------------------------------------------------------------- limits
def test_alias_bomb_is_refused_at_once_everywhere(tmp_path):
    # Before: `validate` called it valid (aliases shared, metadata barely checked) and `run` grew without bound.
    text = alias_bomb()
    assert len(text.encode()) < len(TINY) + 1100
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    t0 = time.monotonic()
    lines = validate_text(text, "bomb.yaml")
    assert time.monotonic() - t0 < 2
    assert len(lines) == 1 and "expands to more than 100000 values" in lines[0], lines
    assert lines[0].startswith("bomb.yaml:") and lines[0].split(":")[1].isdigit()
    with pytest.raises(ManifestError) as info:
        load_trainingrun(path)
    assert info.value.lines == [lines[0].replace("bomb.yaml", str(path), 1)]


def test_modest_aliases_are_expanded():
    text = variant("  model:\n    preset: tiny\n", "  model: &m\n    preset: tiny\n") + "  x-unused: 1\n"
    (doc,) = parse_yaml("base: &b {a: 1, b: [1, 2]}\ncopy: *b\nmerged:\n  <<: *b\n  a: 2\n")
    assert doc.value == {"base": {"a": 1, "b": [1, 2]}, "copy": {"a": 1, "b": [1, 2]}, "merged": {"a": 2, "b": [1, 2]}}
    doc.value["copy"]["b"].append(3)  # aliases are copies, not shared objects (overrides must not leak)
    assert doc.value["base"]["b"] == [1, 2]
    assert any("x-unused" in line for line in validate_text(text, "f"))


@pytest.mark.parametrize("depth", [150, 5000])
def test_deep_nesting_is_one_error_line(tmp_path, depth):
    # Before: 5000-deep nesting gave a RecursionError traceback from `trainingrun validate`.
    text = TINY + "  podTemplate:\n    affinity:\n      x: " + "[" * depth + "]" * depth + "\n"
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    proc = cli("validate", str(path))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"{path}:") and "nest" in line, line


def test_size_limit_and_non_regular_files(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text(TINY + "#" * (4 * 1024 * 1024))
    proc = cli("validate", str(big))
    assert proc.returncode == 1 and "larger than the 3145728 bytes" in proc.stderr
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    proc = cli("validate", str(fifo), timeout=20)  # must not block waiting for a writer
    assert proc.returncode == 1 and "not a regular file" in proc.stderr
    binary = tmp_path / "latin1.yaml"
    binary.write_bytes(TINY.replace("tiny", "t\xe9ny").encode("latin-1"))
    proc = cli("validate", str(binary))
    assert proc.returncode == 1 and "not UTF-8" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(ManifestError, match="more than 3 documents"):
        parse_yaml("a: 1\n---\nb: 2\n---\nc: 3\n---\nd: 4\n", limits=Limits(max_documents=3))


def test_duplicate_keys_are_refused_naming_both_lines():
    # Before: the last value silently won.
    text = variant("spec:\n  seed: 1234\n", "spec:\n  seed: 1234\n  seed: 7\n")
    first = text.splitlines().index("  seed: 1234") + 1
    (line,) = validate_text(text, "dup.yaml")
    assert line.startswith(f"dup.yaml:{first + 1}:3: spec.seed: duplicate key 'seed' (first at line {first})")


@pytest.mark.parametrize("text, message", [
    ("a: !!python/object:os.system x\n", "is not allowed"),
    ("a: !!binary aGk=\n", "is not allowed"),
    ("a: !custom x\n", "is not allowed"),
    ("a: &a [*a]\n", "recursive alias"),
    ("a: *nope\n", "names no anchor"),
    ("a: .inf\n", "must be finite"),
    ("a: -.Inf\n", "must be finite"),
    ("a: .nan\n", "must be finite"),
    ("a: 1e309\n", "overflows to infinity"),
    ("a: 9223372036854775808\n", "out of range"),
    ("[1]: x\n", "key must be a scalar"),
    ("a: [1\n", "invalid YAML"),
])
def test_values_json_cannot_carry_are_refused(text, message):
    with pytest.raises(ManifestError, match=message) as info:
        parse_yaml(text, "f.yaml")
    (line,) = info.value.lines
    assert line.startswith(("f.yaml:1:", "f.yaml:2:"))


def test_scalars_resolve_as_the_api_server_decodes_them():
    (doc,) = parse_yaml(
        "a: 3e-4\nb: y\nc: 'y'\nd: 0x1F\ne: 0o17\nf: 017\ng: 1_000\nh: ~\ni: 2024-01-01\nj: off\nk: -2.5\n"
        "l: 9223372036854775807\nm: !!str 12\n1: one\ntrue: t\n")
    assert doc.value == {"a": 3e-4, "b": True, "c": "y", "d": 31, "e": 15, "f": 15, "g": 1000, "h": None,
                         "i": "2024-01-01", "j": False, "k": -2.5, "l": 2**63 - 1, "m": "12", "1": "one",
                         "true": "t"}


# --------------------------------------------------------------------------------------------------- no coercion
@pytest.mark.parametrize("old, new, field, message", [
    ("replicas: 2", "replicas: true", "spec.trainer.replicas", "a boolean, not integer"),
    ("replicas: 2", 'replicas: "2"', "spec.trainer.replicas", "a string, not integer"),
    ("replicas: 2", "replicas: 2.0", "spec.trainer.replicas", "a number, not integer"),
    ("clipGrad: 1.0", 'clipGrad: "1e309"', "spec.trainer.optimizer.clipGrad", "a string, not number"),
    ("clipGrad: 1.0", "clipGrad: 1e300", "spec.trainer.optimizer.clipGrad", "maximum"),
    ("seed: 1234", "seed: 1e29", "spec.seed", "a number, not integer"),
    ("seed: 1234", "seed: 100000000000000", "spec.seed", "maximum"),
    ("numRollouts: 32", "numRollouts: 9000000000000000000", "spec.rollout.numRollouts", "maximum"),
    ("zeroVariance: true", 'zeroVariance: "true"', "spec.rollout.filters.zeroVariance", "a string, not boolean"),
    ("task: reverse", "task: yes", "spec.rollout.source.synthetic.task", "quote it"),
])
def test_no_coercion_and_bounds_the_same_for_validate_and_run(tmp_path, old, new, field, message):
    # Before: `run` trained `replicas: true` on 1 rank and `"2"` on 2, clipped at infinity, and took seed 1e29.
    text = variant(old, new)
    path = tmp_path / "run.yaml"
    path.write_text(text)
    lines = validate_text(text, str(path))
    assert lines and all(f": {field}:" in line for line in lines), lines
    assert any(message in line for line in lines), lines
    row = text.splitlines().index(next(x for x in text.splitlines() if x.strip() == new.strip())) + 1
    assert lines[0].startswith(f"{path}:{row}:"), lines
    with pytest.raises(ManifestError) as info:
        load_trainingrun(path)
    assert info.value.lines == lines
    doc = yaml.safe_load(TINY)  # the operator's path: a decoded body, validated strictly by the same models
    node = doc["spec"]
    *parents, leaf = field.split(".")[1:]
    for p in parents:
        node = node[p]
    node[leaf] = parse_yaml(new)[0].value[new.split(":")[0].strip()]
    with pytest.raises(ValidationError):
        parse_trainingrun(doc)


def test_run_prints_the_same_lines_as_validate_and_starts_nothing(tmp_path):
    text = variant("replicas: 2", 'replicas: "2"').replace("seed: 1234", "seed: 1234\n  seed: 5")
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    validate = cli("validate", str(path))
    run = cli("run", str(path), "--out", str(tmp_path / "out"))
    assert validate.returncode == run.returncode == 1
    assert run.stderr.splitlines() == validate.stderr.splitlines() != []
    assert not (tmp_path / "out").exists()
    good = cli("validate", str(ROOT / "examples/tiny.yaml"))
    assert good.returncode == 0
    # --trainers is applied before validation and reported the same way
    bad_trainers = cli("run", str(ROOT / "examples/tiny.yaml"), "--trainers", "0", "--out", str(tmp_path / "o2"))
    assert bad_trainers.returncode == 1
    assert "spec.trainer.replicas: invalid value 0" in bad_trainers.stderr and "Traceback" not in bad_trainers.stderr


def test_pod_entrypoints_refuse_with_the_same_lines_and_exit_78(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(variant("replicas: 2", "replicas: true"))
    (expected,) = validate_text(path.read_text(), str(path))
    proc = cli("rollout", "--config", str(path), "--store", f"file://{tmp_path}/store")
    assert proc.returncode == 78 and expected in proc.stderr, proc.stderr
    proc = cli("trainer", "--config", str(path), "--store", f"file://{tmp_path}/store", env={"RANK": "0"})
    assert proc.returncode == 78 and expected in proc.stderr, proc.stderr


def test_validate_does_not_import_torch(tmp_path):
    code = ("import sys; from trainingrun.cli import main; rc = main(['validate', '-q', 'examples/tiny.yaml']); "
            "print(rc, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.stdout.split() == ["0", "False"], proc.stderr


# ---------------------------------------------------------------------------------------------------------- bounds
def _numbers(schema: dict, path: str = "spec"):
    if schema.get("type") in ("integer", "number"):
        yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _numbers(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from _numbers(schema[key], f"{path}[]")


def test_every_number_of_the_api_has_bounds():
    numbers = list(_numbers(spec_schema())) + list(_numbers(status_schema(), "status"))
    assert len(numbers) > 40
    unbounded = [p for p, s in numbers if "minimum" not in s or "maximum" not in s]
    assert unbounded == [], f"give these fields ge=/le= bounds in api/models.py: {unbounded}"
    for p, s in numbers:
        assert abs(s["maximum"]) <= 2**63 - 1 and math.isfinite(s["maximum"]), p


# --------------------------------------------------------------------------------------------------------- dumping
_tricky = st.sampled_from(["y", "n", "yes", "No", "on", "OFF", "true", "null", "~", "", "1e3", "3e-4", "0o17", "017",
                           "0x1F", "1_000", ".5", "09", "2024-01-01", "1:30", ".inf", "<<", "- a", "a: b", "#x", "'"])
_scalar = st.one_of(_tricky, st.text(max_size=8), st.integers(-(2**63), 2**63 - 1), st.booleans(), st.none(),
                    st.floats(allow_nan=False, allow_infinity=False))
_value = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.one_of(_tricky, st.text(min_size=1, max_size=6)), inner, max_size=4), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(_value)
def test_dump_yaml_round_trips_through_the_loader(value):
    """What the launcher and the operator write (run.yaml, the ConfigMap) reads back to the same values; PyYAML's
    own dumper leaves `y`, `1e3` or `0o17` unquoted, which this loader reads as a boolean or a number."""
    doc = {"v": value}
    (back,) = parse_yaml(dump_yaml(doc, sort_keys=False))
    assert json.dumps(back.value, sort_keys=True) == json.dumps(doc, sort_keys=True)


# ------------------------------------------------------------------------------------ what the launcher checked
def test_a_child_skips_the_checks_its_launcher_ran_on_exactly_these_bytes(tmp_path, monkeypatch):
    """TRAININGRUN_CONFIG_SHA256 (set by the local launcher for its children): a file with that digest is loaded by
    the strict models alone, to the same TrainingRun; a file changed since, or overrides, get every check again."""
    from trainingrun.api import manifest
    from trainingrun.contract.env import CONFIG_SHA256_ENV

    path = tmp_path / "run.yaml"
    path.write_text(TINY)
    full = load_trainingrun(path)
    calls = []
    real = manifest.problems
    monkeypatch.setattr(manifest, "problems", lambda doc: calls.append(doc) or real(doc))
    monkeypatch.setenv(CONFIG_SHA256_ENV, manifest.sha256_of(path.read_bytes()))
    assert load_trainingrun(path) == full and calls == []  # checked by the launcher: models only
    assert load_trainingrun(path, overrides={"spec.trainer.replicas": 1}).spec.trainer.replicas == 1
    assert len(calls) == 1  # overrides: every check
    path.write_text(variant("numRollouts: 32", "numRollouts: 0"))  # changed after the launcher checked it
    with pytest.raises(ManifestError, match="numRollouts"):
        load_trainingrun(path)
    assert len(calls) == 2
