"""Operator scale benchmark: N TrainingRuns created at once against the KMock emulator (tests/kube.py) with the real
operator as a subprocess. Prints, per N: seconds until every run has all its children (ConfigMap, 2 Services, store,
rollout and trainer pods), API requests per run made by the operator (kopf + its own client) during creation and
during a quiet period afterwards (no polling storms), and the operator's resident memory.

Targets (issue 6): 1 run → children within 1 s; 200 runs → within 60 s; bounded requests per run; < 200 MB at 200.
Usage: .venv/bin/python benchmarks/operator.py [N ...]   (default: 1 10 50 200)
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from tests.kube import Cluster  # noqa: E402
from tests.services import stop_process, wait_for  # noqa: E402

TINY = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
CHILD_PODS = 2 + TINY["spec"]["trainer"]["replicas"]  # store + rollout + trainers
QUIET_SECONDS = 15


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def operator_requests(cluster: Cluster) -> int:
    return sum(n for ua, n in cluster.emulator.clients.items() if ua in ("kopf", "trainingrun-operator"))


def bench(n: int) -> dict:
    with Cluster() as cluster:
        op = cluster.start_operator(interval=10.0)
        try:
            base = operator_requests(cluster)
            t0 = time.perf_counter()
            for i in range(n):
                doc = copy.deepcopy(TINY)
                doc["metadata"] = {"name": f"run-{i:04d}"}
                cluster.create(cluster.tr_path(), doc)

            def complete() -> bool:
                pods = cluster.items("/api/v1/namespaces/default/pods")
                cms = cluster.items("/api/v1/namespaces/default/configmaps")
                svcs = cluster.items("/api/v1/namespaces/default/services")
                return len(pods) >= n * CHILD_PODS and len(cms) >= n and len(svcs) >= 2 * n

            wait_for(complete, 300, f"children of {n} runs", interval=0.05 if n == 1 else 0.5)
            seconds = time.perf_counter() - t0
            created = operator_requests(cluster) - base
            time.sleep(QUIET_SECONDS)
            quiet = operator_requests(cluster) - base - created
            return {"n": n, "seconds": seconds, "req_create": created / n, "req_quiet": quiet / n,
                    "rss": rss_mb(op.pid)}
        finally:
            stop_process(op)


def main(argv: list[str]) -> int:
    sizes = [int(a) for a in argv] or [1, 10, 50, 200]
    print(f"{'runs':>5} {'children s':>11} {'req/run create':>15} {'req/run quiet ' + str(QUIET_SECONDS) + 's':>20} "
          f"{'operator RSS MB':>16}", flush=True)
    for n in sizes:
        r = bench(n)
        print(f"{r['n']:>5} {r['seconds']:>11.2f} {r['req_create']:>15.1f} {r['req_quiet']:>20.2f} {r['rss']:>16.1f}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
