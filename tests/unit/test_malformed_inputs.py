"""Malformed inputs outside the manifest and the store are clear errors, never an uncaught exception type: jsonl
rollout files (non-UTF-8 bytes, token ids beyond int64 or the vocabulary, absurd nesting, huge numbers, FIFOs) and
non-finite numbers on the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from trainingrun.contract.errors import ConfigError
from trainingrun.rollout.jsonl import load_jsonl

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"group": 1, "tokens": [3, 4, 5], "prompt_length": 1, "reward": 1.0}


def jsonl(tmp_path: Path, *lines: bytes) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def line(**changes) -> bytes:
    return json.dumps({**GOOD, **changes}).encode()


@pytest.mark.parametrize("bad, message", [
    (b'{"group": 1, "tokens": [3, 4], "prompt_length": 1, "reward": 1, "meta": "caf\xe9"}', "not UTF-8 text"),
    (line(tokens=[3, 2**64]), "ids must be in [0, 256)"),
    (line(tokens=[3, -(2**70)]), "ids must be in [0, 256)"),
    (line(tokens=[3, 999]), "ids must be in [0, 256)"),
    (b'{"group": 1, "meta": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (line(reward=10**400), "reward: must be a finite number"),
    (line(advantage=-(10**400)), "advantage: must be a finite number"),
    (json.dumps({**{k: v for k, v in GOOD.items() if k != "prompt_length"}, "loss_mask": [False, True, True]})
     .encode(), "loss_mask: must be a list of 0/1"),
])
def test_malformed_jsonl_lines_are_config_errors_naming_the_line(tmp_path, bad, message):
    # Before: UnicodeDecodeError, OverflowError or RecursionError tracebacks (or a bool accepted as a mask value).
    path = jsonl(tmp_path, line(), bad, line(group=2))
    with pytest.raises(ConfigError) as info:
        load_jsonl(path, vocab_size=256)
    assert f"{path}:2: " in str(info.value) and message in str(info.value), str(info.value)


def test_a_jsonl_line_too_long_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    from trainingrun.rollout import jsonl as sources

    monkeypatch.setattr(sources, "MAX_LINE_BYTES", 1000)
    path = jsonl(tmp_path, line(), line(meta="x" * 5000), line(group=2))
    with pytest.raises(ConfigError, match=rf"{path}:2: longer than 1000 bytes"):
        load_jsonl(path, vocab_size=256)


def test_a_fifo_as_the_jsonl_source_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    result: dict = {}
    reader = threading.Thread(target=lambda: result.update(error=_catch(lambda: load_jsonl(fifo, vocab_size=256))),
                              daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "blocked on the FIFO"
    assert isinstance(result["error"], ConfigError) and "not a regular file" in str(result["error"])


def _catch(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return exc
    return None


@pytest.mark.parametrize("argv", [
    ["run", "examples/tiny.yaml", "--grace-seconds", "nan"],
    ["run", "examples/tiny.yaml", "--progress-interval", "inf"],
    ["run", "examples/tiny.yaml", "--grace-seconds", "-1"],
    ["trainer", "--wait-timeout", "nan"],
    ["rollout", "--max-wait", "1e309"],
    ["operator", "--interval=-inf"],
])
def test_non_finite_numbers_on_the_command_line_are_refused(argv):
    # Before: accepted as floats (a NaN grace period, an infinite interval), failing much later or never.
    proc = subprocess.run([sys.executable, "-m", "trainingrun", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    (last,) = proc.stderr.strip().splitlines()[-1:]
    option = argv[-1].split("=")[0] if "=" in argv[-1] else argv[-2]
    assert f"argument {option}" in last and ("finite" in last or "out of range" in last), proc.stderr
