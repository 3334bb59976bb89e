"""Store throughput: publish + fetch of a realistic rollout through each backend, beside the raw ceiling.

Rollout: 1024 samples with lengths uniform in [256, 16384] tokens (~8.5 M tokens, ~43 MB of arrays), scheduled
over 8 data-parallel ranks with the real scheduler. For each backend:
  publish   `publish_rollout` (encode + CRC + write payloads, schedule, commit marker; file: fsync + rename)
  fetch     `read_payload` of all 8 ranks (read + CRC check + decode)
and, in the same run, the raw ceiling on the same bytes:
  file      plain write of each rank's bytes to a file (with fsync when the store fsyncs) / plain read back
  redis     plain SET / GET of each rank's bytes (redis-py, same server)
Each store operation is timed in turn with its raw counterpart on the same bytes (store, raw, store, raw, ...: a
shared machine's drift hits both alike); MB/s counts the payload array bytes (the same for every row) over the
median time, and the ratio is the median of the pairs' store / raw speed (target >= 0.5).
Also: bytes a one-rank fetch reads (file: /proc/self/io rchar + bytes memory-mapped; redis: the server's
total_net_output_bytes), against that rank's payload and the whole rollout. Starts its own redis-server on a random
127.0.0.1 port and stops it.

Usage: .venv/bin/python benchmarks/store.py [--samples 1024] [--max-len 16384] [--dp 8] [--repeat 7]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainingrun.schedule import build_dp_schedule  # noqa: E402
from trainingrun.store import open_store  # noqa: E402
from trainingrun.store.wire import encode_payload, payload_nbytes  # noqa: E402


def make_rollout(n: int, max_len: int, dp: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(256, max_len + 1, size=n)
    groups = np.repeat(np.arange(n // 8), 8)[:n]
    sched = build_dp_schedule(lengths, dp_size=dp, group_ids=groups, max_tokens_per_gpu=max_len)
    payloads = {}
    for r, part in enumerate(sched.partitions):
        idx = np.asarray(part)
        offsets = np.r_[0, np.cumsum(lengths[idx])].astype(np.int64)
        total = int(offsets[-1])
        payloads[r] = {
            "tokens": rng.integers(0, 128000, size=total, dtype=np.int32),
            "offsets": offsets,
            "loss_mask": (rng.random(total) < 0.7).astype(np.uint8),
            "advantages": rng.standard_normal(len(idx)).astype(np.float32),
            "rewards": rng.random(len(idx)).astype(np.float32),
            "sample_ids": idx.astype(np.int64),
        }
    schedule = {"dp_size": dp, "schedule": sched.to_dict(), "global_batch_sizes": sched.global_batch_sizes}
    return payloads, schedule


def paired(store_op, raw_op, repeat: int) -> tuple[float, float, float]:
    """Time the store's operation and the raw one on the same bytes in turn (store i, raw i, store i+1, ...), so a
    shared machine's drift hits both alike: (median store seconds, median raw seconds, median of the per-pair ratios
    raw / store)."""
    pairs = [(store_op(i), raw_op(i)) for i in range(repeat)]
    return (statistics.median(t for t, _ in pairs), statistics.median(r for _, r in pairs),
            statistics.median(r / t for t, r in pairs))


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()

    t0 = time.perf_counter()
    payloads, schedule = make_rollout(args.samples, args.max_len, args.dp)
    encoded = {r: encode_payload(p) for r, p in payloads.items()}
    nbytes = sum(payload_nbytes(p) for p in payloads.values())
    mb = nbytes / 1e6
    tokens = sum(len(p["tokens"]) for p in payloads.values())
    print(f"rollout: {args.samples} samples, {tokens / 1e6:.2f} M tokens, {mb:.1f} MB of arrays, dp {args.dp} "
          f"(built in {time.perf_counter() - t0:.1f}s); medians of {args.repeat} interleaved store/raw pairs")
    rows = []
    workdir = Path(tempfile.mkdtemp(prefix="trainingrun-bench-"))
    try:
        # ------------------------------------------------------------------ file
        for fsync in (True, False):
            url = f"file://{workdir}/store-{int(fsync)}" + ("" if fsync else "?fsync=0")
            store = open_store(url)

            def pub(i: int) -> float:
                s = time.perf_counter()
                store.publish_rollout(i, payloads, {**schedule, "rollout": i})
                return time.perf_counter() - s

            def fetch(i: int) -> float:
                s = time.perf_counter()
                for r in range(args.dp):
                    store.read_payload(i, r)
                return time.perf_counter() - s

            raw_dir = workdir / f"raw-{int(fsync)}"
            raw_dir.mkdir()

            def raw_write(i: int) -> float:
                s = time.perf_counter()
                for r, data in encoded.items():
                    with open(raw_dir / f"{i}-{r}", "wb") as f:
                        f.write(data)
                        if fsync:
                            f.flush()
                            os.fsync(f.fileno())
                return time.perf_counter() - s

            def raw_read(i: int) -> float:
                s = time.perf_counter()
                for r in range(args.dp):
                    (raw_dir / f"{i}-{r}").read_bytes()
                return time.perf_counter() - s

            name = "file (fsync)" if fsync else "file (no fsync)"
            rows.append((name, "publish", *paired(pub, raw_write, args.repeat)))
            rows.append((name, "fetch", *paired(fetch, raw_read, args.repeat)))
            if fsync:
                # bytes brought in: read() calls (rchar) plus the payload files memory-mapped by the file store
                mapped = []
                original = mmap.mmap

                def counting(*args, **kwargs):
                    m = original(*args, **kwargs)
                    mapped.append(len(m))
                    return m

                mmap.mmap = counting
                try:
                    before = rchar()
                    store.read_payload(0, 3)
                    file_rank_bytes = rchar() - before + sum(mapped)
                finally:
                    mmap.mmap = original
        # ------------------------------------------------------------------ redis
        from tests.services import redis_server

        with redis_server() as server:
            store = open_store(server.url)
            client = store.client

            def rpub(i: int) -> float:
                s = time.perf_counter()
                store.publish_rollout(i, payloads, {**schedule, "rollout": i})
                return time.perf_counter() - s

            def rfetch(i: int) -> float:
                s = time.perf_counter()
                for r in range(args.dp):
                    store.read_payload(i, r)
                return time.perf_counter() - s

            def rraw_set(i: int) -> float:
                s = time.perf_counter()
                for r, data in encoded.items():
                    client.set(f"raw:{i}:{r}", data)
                return time.perf_counter() - s

            def rraw_get(i: int) -> float:
                s = time.perf_counter()
                for r in range(args.dp):
                    client.get(f"raw:{i}:{r}")
                return time.perf_counter() - s

            rows.append(("redis", "publish", *paired(rpub, rraw_set, args.repeat)))
            rows.append(("redis", "fetch", *paired(rfetch, rraw_get, args.repeat)))
            out0 = int(client.info("stats")["total_net_output_bytes"])
            store.read_payload(0, 3)
            redis_rank_bytes = int(client.info("stats")["total_net_output_bytes"]) - out0
            store.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"{'backend':<17}{'op':<9}{'store MB/s':>11}{'raw MB/s':>10}{'ratio':>7}  target >= 0.50")
    worst = 1e9
    for backend, op, t_store, t_raw, ratio in rows:
        worst = min(worst, ratio)
        print(f"{backend:<17}{op:<9}{mb / t_store:>11.0f}{mb / t_raw:>10.0f}{ratio:>7.2f}  {'ok' if ratio >= 0.5 else 'BELOW'}")
    whole = sum(len(d) for d in encoded.values())
    print(f"one-rank fetch (rank 3): rank payload {len(encoded[3]) / 1e6:.2f} MB of a {whole / 1e6:.1f} MB rollout; "
          f"file read {file_rank_bytes / 1e6:.2f} MB, redis sent {redis_rank_bytes / 1e6:.2f} MB")
    print(f"worst ratio {worst:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
