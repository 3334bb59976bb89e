"""`trainingrun schedule`: the table matches schedule_stats; bad input is one line on stderr and exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainingrun.cli import main
from trainingrun.schedule import build_dp_schedule, schedule_stats

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainingrun", "schedule", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def parse_table(stdout: str) -> list[dict[str, str]]:
    lines = stdout.splitlines()
    header = lines[0].split("  ")
    header = [h.strip() for h in header if h.strip()]
    rows = []
    for line in lines[2:]:
        if not line.strip() or not line.strip()[0].isdigit() or "steps," in line:
            continue
        rows.append(dict(zip(header, line.split())))
    return rows


def test_table_matches_schedule_stats(tmp_path):
    rng = np.random.default_rng(5)
    lengths = (rng.integers(100, 1500, 120) + np.minimum(rng.lognormal(7, 1, 120), 16000)).astype(int).tolist()
    groups = [i // 4 for i in range(120)]
    (tmp_path / "lengths.json").write_text(json.dumps(lengths))
    (tmp_path / "groups.jsonl").write_text("\n".join(map(str, groups)))
    proc = run_cli(str(tmp_path / "lengths.json"), "--dp", "4", "--max-tokens", "16384", "--global-batch-size", "8",
                   "--groups", str(tmp_path / "groups.jsonl"))
    assert proc.returncode == 0, proc.stderr
    expected = schedule_stats(build_dp_schedule(lengths, dp_size=4, max_tokens_per_gpu=16384, global_batch_size=8,
                                                group_ids=groups), lengths)
    rows = parse_table(proc.stdout)
    assert len(rows) == len(expected) == 3
    for row, exp in zip(rows, expected):
        assert int(row["step"]) == exp["step"]
        assert int(row["gbs"]) == exp["global_batch_size"] == 32
        assert int(row["mb/rank"]) == exp["microbatches_per_rank"]
        assert int(row["lower bd"]) == exp["lower_bound_microbatches"]
        assert int(row["max rank tok"]) == exp["max_rank_tokens"]
        assert float(row["mean rank tok"]) == pytest.approx(exp["mean_rank_tokens"], abs=0.05)
        assert float(row["tok imb"]) == pytest.approx(exp["token_imbalance"], abs=5e-5)
        assert float(row["flops imb"]) == pytest.approx(exp["flops_imbalance"], abs=5e-5)
        assert float(row["fill"]) == pytest.approx(exp["fill_ratio"], abs=5e-5)
    assert "3 steps, 96 samples scheduled, 24 leftover, dp 4" in proc.stdout


@pytest.mark.parametrize(
    ("content", "args", "needle"),
    [
        ("100 200 -5 300", ["--max-tokens", "1000"], "LENGTHS: must be positive"),
        ("100 abc 300", ["--max-tokens", "1000"], "LENGTHS: every value must be an integer"),
        ('{"x": 1}', ["--max-tokens", "1000"], "LENGTHS: expected numbers"),
        ("100 200 300", [], "--max-tokens: give one of"),
        ("100 200 300", ["--dp", "4", "--max-tokens", "1000"], "LENGTHS: step 0 has 3 samples"),
        ("100 200 300", ["--dp", "0", "--max-tokens", "1000"], "argument --dp: must be a positive integer"),
        ("100 200 300", ["--max-tokens", "10", "--micro-batch-size", "1"], "not allowed with argument"),
        ("100 200 300", ["--dp", "2", "--micro-batch-size", "1"], "--micro-batch-size: 3 samples"),
        ("100 200 300", ["--max-tokens", "9", "--cost", "watts"], "argument --cost: invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, content, args, needle):
    path = tmp_path / "lengths.txt"
    path.write_text(content)
    with pytest.raises(SystemExit) if "argument" in needle else _nothing():
        rc = main(["schedule", str(path), *args])
        assert rc == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_bad_input_subprocess(tmp_path):
    proc = run_cli(str(tmp_path / "missing.json"), "--max-tokens", "100")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"trainingrun schedule: error: LENGTHS: cannot read {tmp_path / 'missing.json'}: " \
                                  "No such file or directory"
    assert proc.stdout == ""


def test_text_and_static_mode(tmp_path, capsys):
    path = tmp_path / "l.txt"
    path.write_text("100, 200\n300 400\n")
    assert main(["schedule", str(path), "--dp", "2", "--micro-batch-size", "1", "--cost", "flops"]) == 0
    rows = parse_table(capsys.readouterr().out)
    assert rows[0]["gbs"] == "4" and rows[0]["mb/rank"] == "2" and rows[0]["fill"] == "-"


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_json_from_stdin_matches_the_schedule_and_warns_about_samples_over_the_cap():
    lengths = [100, 5000, 300, 200, 80, 7000, 60, 90]
    proc = subprocess.run([sys.executable, "-m", "trainingrun", "schedule", "-", "--dp", "2", "--max-tokens", "1024",
                           "--json"], input=json.dumps(lengths), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    sched = build_dp_schedule(lengths, dp_size=2, max_tokens_per_gpu=1024)
    assert out["steps"] == json.loads(json.dumps(schedule_stats(sched, lengths)))
    assert out["schedule"]["partitions"] == [[int(i) for i in p] for p in sched.partitions]
    assert out["schedule"]["num_microbatches"] == list(sched.num_microbatches)
    assert out["num_steps"] == 1 and out["samples_scheduled"] == 8 and out["dp_size"] == 2
    warning = "2 of 8 samples are longer than --max-tokens 1024 (longest 7000)"
    assert out["warnings"] and warning in out["warnings"][0]
    assert warning in proc.stderr and proc.stderr.startswith("trainingrun schedule: warning:")
    # plain text on stdin, no sample over the cap: no warning
    ok = subprocess.run([sys.executable, "-m", "trainingrun", "schedule", "-", "--max-tokens", "8192"],
                        input="100 200\n300", cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stderr == "" and "3 samples scheduled" in ok.stdout


def test_help_explains_every_column():
    from trainingrun.schedule.cli import _COLUMNS

    proc = run_cli("--help")
    assert proc.returncode == 0
    explained = proc.stdout.split("columns of the table", 1)[1]
    for title, _, _ in _COLUMNS:
        assert f"\n  {title} " in explained, title
