"""How `make test` spreads the suite over its pytest-xdist workers (tests/conftest.py): a module's tests on one
worker, the vLLM modules in one scope. Regression: with pytest 9.2, xdist's --dist loadgroup never saw our groups
(its node-id suffix is lost), so the tests of one module ran on both workers and both started vLLM servers."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tests.conftest import SHARED_SCOPES, scope_of

ROOT = Path(__file__).resolve().parents[2]


def test_each_module_runs_on_one_worker():
    modules = ["tests/unit/test_logprob_check.py", "tests/unit/test_local_report.py"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadscope", "-v", "-p",
                          "no:cacheprovider", *modules], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}).stdout
    workers = defaultdict(set)
    for worker, module in re.findall(r"^\[(gw\d)\] .*?PASSED (tests/[^:]+)::", out, re.M):
        workers[module].add(worker)
    assert sorted(workers) == sorted(modules), out[-3000:]
    assert all(len(w) == 1 for w in workers.values()), dict(workers)


def test_the_vllm_modules_share_one_scope_and_others_are_their_module():
    assert {scope_of(f"{m}::test_x[a]") for m in SHARED_SCOPES} == {"vllm"}
    # every module that starts a real vLLM server shares the one scope (two CPU servers at once are slow here)
    vllm_modules = {str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "integration").glob("test_vllm*.py")}
    assert set(SHARED_SCOPES) == vllm_modules
    assert scope_of("tests/unit/test_wire.py::test_y") == "tests/unit/test_wire.py"
