"""`.ci/services` (run by `make test` and .ci/run): installs redis-server/prometheus with apt-get when it can, and
otherwise fails naming the packages. The branches are driven with a PATH of stand-in programs (none is installed)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "services"


def fake_bin(tmp_path: Path, programs: dict[str, str]) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    for name, body in programs.items():
        p = d / name
        p.write_text(f"#!/bin/bash\n{body}\n")
        p.chmod(0o755)
    return d


def run(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/bash", str(SCRIPT)], env={"PATH": str(path), "HOME": os.environ.get("HOME", "/")},
                          capture_output=True, text=True, timeout=30)


def test_nothing_to_do_when_every_program_is_there(tmp_path):
    d = fake_bin(tmp_path, {"redis-server": "", "prometheus": "", "promtool": "", "apt-get": "exit 9"})
    proc = run(d)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""


def test_without_apt_get_it_names_the_packages(tmp_path):
    d = fake_bin(tmp_path, {"id": "echo 0", "prometheus": ""})  # promtool missing: the prometheus package
    proc = run(d)
    assert proc.returncode == 1
    assert "redis-server prometheus" in proc.stderr and "not a Debian/Ubuntu system" in proc.stderr


def test_not_root_and_no_sudo_names_the_apt_get_command(tmp_path):
    d = fake_bin(tmp_path, {"id": "echo 1000", "apt-get": "echo should-not-run; exit 9"})
    proc = run(d)
    assert proc.returncode == 1 and "should-not-run" not in proc.stdout
    assert "sudo apt-get install -y --no-install-recommends redis-server prometheus" in proc.stderr


def test_as_root_it_installs_with_apt_get(tmp_path):
    log = tmp_path / "apt.log"
    d = fake_bin(tmp_path, {"id": "echo 0", "redis-server": "", "apt-get": f'echo "$@" >> {log}'})
    proc = run(d)
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == ["update -qq", "install -y -qq --no-install-recommends prometheus"]


def test_ci_and_make_test_use_it():
    assert ".ci/services" in (ROOT / "Makefile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    test_rule = makefile.split("\ntest:", 1)[1].splitlines()[0]
    assert "services" in test_rule and "tools" in test_rule
    assert "make test" in (ROOT / ".ci" / "run").read_text()
