"""Benchmark: trainingrun's DP scheduler beside today's best-practice baseline, on the same steps.

Baseline (written here, from the description in issue 3): first-fit packing in arrival order → split the largest
micro-batches until the count is a multiple of dp → Karmarkar–Karp largest differencing of micro-batches onto ranks by
token sum, with equal counts per rank.

Inputs (fixed seeds): RL-like lengths (prompt uniform 100–1500 + response lognormal(μ=7, σ=1) capped at 16k),
bimodal, uniform, and uniform with one huge outlier per step (2 × cap tokens); dp ∈ {8, 16, 64}; steps of 128–1024
samples; caps 16k–64k. Every case runs 8 steps; RL-like steps are groups of 8 samples (one prompt's responses).

Columns: imbalance = max/mean rank tokens per step (mean over the case's steps); "bound" = the best any schedule can
do, max(largest sample, mean rank load) / mean rank load; mb/rank = micro-batches per rank (mean); "@LB" = share of
steps at the aligned lower bound; "cpu o/b" = CPU time of ours over the baseline's on the case's steps (median of
the ratios of ``--case-repeats`` rounds, the two run in turn).

Timing: dp 64, cap 32k, RL-like lengths; 10k / 30k / 100k samples in steps of 1024 samples (and in one step), ours and
the baseline run in turn ``--repeats`` times; the figures are medians of CPU seconds and of the pairwise ratios.
The baseline's first fit is quadratic in the step size, so it is timed on one step of 10k samples only.

Usage: ``python benchmarks/schedule.py`` (about 10 s); ``--timing`` prints the timing only
(``--timing --repeats 15`` for a steadier figure on a busy machine).
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainingrun.schedule import build_dp_schedule, lower_bound_microbatches  # noqa: E402

STEPS_PER_CASE = 8

# ------------------------------------------------------------------------------------------------------- baseline


def baseline_step(lengths: np.ndarray, dp: int, cap: int) -> list[list[list[int]]]:
    """The baseline for one step: ``result[rank][k]`` = sample positions of rank's k-th micro-batch."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i, n_tok in enumerate(lengths.tolist()):  # first fit, arrival order; an oversized sample alone
        for b, load in enumerate(loads):
            if load + n_tok <= cap and n_tok <= cap:
                bins[b].append(i)
                loads[b] += n_tok
                break
        else:
            bins.append([i])
            loads.append(n_tok)
    while len(bins) % dp:  # split the largest splittable micro-batch in two halves by tokens
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            bins.append([])
            loads.append(0)
            continue
        b = max(splittable, key=lambda k: loads[k])
        items, half, acc, cut = bins[b], loads[b] / 2, 0, 1
        for k, i in enumerate(items[:-1]):
            acc += int(lengths[i])
            cut = k + 1
            if acc >= half:
                break
        first, second = items[:cut], items[cut:]
        bins[b], loads[b] = first, int(lengths[first].sum())
        bins.append(second)
        loads.append(int(lengths[second].sum()))
    return _karmarkar_karp(bins, loads, dp)


def _karmarkar_karp(bins: list[list[int]], loads: list[int], dp: int) -> list[list[list[int]]]:
    """Equal-cardinality largest differencing: chunks of dp micro-batches become partial partitions (one per rank);
    the two with the largest spread are merged, heaviest subset with lightest, until one remains."""
    order = sorted(range(len(bins)), key=lambda b: loads[b])
    heap = []
    for c in range(0, len(order), dp):
        subsets = sorted(((loads[b], [b]) for b in order[c:c + dp]), key=lambda x: x[0], reverse=True)
        heapq.heappush(heap, (-(subsets[0][0] - subsets[-1][0]), c, subsets))
    tie = len(order)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(((sa + sb, ba + bb) for (sa, ba), (sb, bb) in zip(a, reversed(b))),
                        key=lambda x: x[0], reverse=True)
        tie += 1
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
    _, _, final = heap[0]
    return [[bins[b] for b in subset] for _, subset in final]


# ---------------------------------------------------------------------------------------------------------- inputs


def rl_like(rng, n):
    return rng.integers(100, 1501, n) + np.minimum(rng.lognormal(7.0, 1.0, n), 16_000).astype(np.int64)


def bimodal(rng, n):
    short = rng.normal(600, 150, n)
    long = rng.normal(9_000, 1_500, n)
    return np.clip(np.where(rng.random(n) < 0.75, short, long), 16, None).astype(np.int64)


def uniform(rng, n):
    return rng.integers(100, 8_001, n)


def outlier(cap):
    def make(rng, n):
        lens = rng.integers(200, 3_001, n)
        lens[rng.integers(n)] = 2 * cap
        return lens
    return make


# dp, samples per step, cap
GRID = [(8, 128, 16_384), (8, 256, 32_768), (8, 1024, 65_536), (16, 256, 16_384), (16, 512, 32_768),
        (16, 1024, 65_536), (64, 1024, 16_384), (64, 1024, 32_768)]


def cases():
    for name in ("rl", "bimodal", "uniform", "outlier"):
        for dp, n, cap in GRID:
            gen = {"rl": rl_like, "bimodal": bimodal, "uniform": uniform}.get(name) or outlier(cap)
            yield name, dp, n, cap, gen


# ---------------------------------------------------------------------------------------------------------- metrics


def rank_tokens(plan, lens):
    return np.array([sum(int(lens[mb].sum()) for mb in rank if mb) for rank in plan], dtype=np.float64)


def run_case(name, dp, n, cap, gen, seed, repeats):
    """The case's steps: balance figures per step, and the median CPU ratio ours / baseline over the steps."""
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(STEPS_PER_CASE):
        lens = np.asarray(gen(rng, n), dtype=np.int64)
        steps.append((lens, np.repeat(np.arange(n // 8), 8) if name == "rl" else None))

    def ours_all():
        return [build_dp_schedule(lens, dp_size=dp, max_tokens_per_gpu=cap, group_ids=groups) for lens, groups in steps]

    def base_all():
        return [baseline_step(lens, dp, cap) for lens, _ in steps]

    timing = paired_cpu(ours_all, base_all, repeats)
    rows = []
    for (lens, _), sched, base in zip(steps, timing.result_a, timing.result_b):
        ours = [sched.step_microbatches(r, 0) for r in range(dp)]
        assert len({len(r) for r in base}) == 1
        ours_t, base_t = rank_tokens(ours, lens), rank_tokens(base, lens)
        mean = ours_t.mean()
        rows.append({
            "ours_imb": ours_t.max() / mean, "base_imb": base_t.max() / base_t.mean(),
            "bound": max(float(lens.max()), mean) / mean,
            "ours_mb": len(ours[0]), "base_mb": len(base[0]),
            "lb": lower_bound_microbatches(lens, dp_size=dp, token_cap=cap) // dp,
        })
    return rows, timing.ratio


# ---------------------------------------------------------------------------------------------------------- timing


class Paired:
    """Median CPU seconds of A and of B, the median of the ratios A/B taken round by round, and their spread."""

    def __init__(self, cpu_a, cpu_b, result_a, result_b):
        ratios = [a / b for a, b in zip(cpu_a, cpu_b)]
        self.a, self.b = statistics.median(cpu_a), statistics.median(cpu_b)
        self.ratio, self.low, self.high = statistics.median(ratios), min(ratios), max(ratios)
        self.result_a, self.result_b = result_a, result_b


def cpu_seconds(fn):
    """(CPU seconds of one call of ``fn``, its result)."""
    start = time.process_time()
    result = fn()
    return time.process_time() - start, result


def paired_cpu(fn_a, fn_b, repeats: int) -> Paired:
    """Run A and B in turn ``repeats`` times (A first in even rounds, B first in odd ones, so a drift of the
    machine's speed falls on both) after one untimed warm-up each."""
    result_a, result_b = fn_a(), fn_b()
    cpu_a, cpu_b = [], []
    for k in range(repeats):
        if k % 2:
            tb, _ = cpu_seconds(fn_b)
            ta, _ = cpu_seconds(fn_a)
        else:
            ta, _ = cpu_seconds(fn_a)
            tb, _ = cpu_seconds(fn_b)
        cpu_a.append(ta)
        cpu_b.append(tb)
    return Paired(cpu_a, cpu_b, result_a, result_b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timing", action="store_true", help="print the timing section only")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the timing section (default 5)")
    parser.add_argument("--case-repeats", type=int, default=3, help="timed rounds per balance case (default 3)")
    args = parser.parse_args()
    if args.repeats < 1 or args.case_repeats < 1:
        parser.error("--repeats and --case-repeats must be at least 1")
    t0 = time.perf_counter()
    if not args.timing:
        _balance(args.case_repeats)
        _flops_line()
    _timing(args.repeats)
    print(f"\ntotal benchmark time {time.perf_counter() - t0:.1f} s")


def _balance(repeats: int) -> None:
    header = (f"{'case':<8} {'dp':>3} {'n':>5} {'cap':>6} | {'imb ours':>8} {'base':>7} {'bound':>6} | "
              f"{'mb ours':>7} {'base':>5} {'LB':>5} | {'@LB ours':>8} {'base':>5} | {'cpu o/b':>7}")
    print(header)
    print("-" * len(header))
    all_rows, worse, ratios = [], [], []
    for seed, (name, dp, n, cap, gen) in enumerate(cases()):
        rows, ratio = run_case(name, dp, n, cap, gen, seed, repeats)
        all_rows.append((name, rows))
        ratios.append((ratio, f"{name}/dp{dp}/n{n}/cap{cap // 1024}k"))
        mean = lambda k: statistics.fmean(r[k] for r in rows)  # noqa: E731
        at_lb = lambda k: 100 * statistics.fmean(r[k] == r["lb"] for r in rows)  # noqa: E731
        print(f"{name:<8} {dp:>3} {n:>5} {cap // 1024:>5}k | {mean('ours_imb'):>8.4f} {mean('base_imb'):>7.4f} "
              f"{mean('bound'):>6.3f} | {mean('ours_mb'):>7.2f} {mean('base_mb'):>5.2f} {mean('lb'):>5.2f} | "
              f"{at_lb('ours_mb'):>7.0f}% {at_lb('base_mb'):>4.0f}% | {ratio:>7.2f}")
        if any(r["ours_imb"] > r["base_imb"] + 1e-12 or r["ours_mb"] > r["base_mb"] for r in rows):
            worse.append(f"{name}/dp{dp}/n{n}/cap{cap // 1024}k")
    _summary(all_rows, worse)
    top, where = max(ratios)
    print(f"  CPU time ours / baseline per case (median of {repeats} rounds): median "
          f"{statistics.median(r for r, _ in ratios):.2f}, largest {top:.2f} ({where})")


def _summary(all_rows, worse) -> None:
    steps = [r for _, rows in all_rows for r in rows]
    tight = [r for r in steps if r["bound"] <= 1.0 + 1e-9]
    print("\nsummary (per step, over all cases)")
    print(f"  {'':<44} {'ours':>8} {'baseline':>9}")
    print(f"  {'mean token imbalance, all steps':<44} {statistics.fmean(r['ours_imb'] for r in steps):>8.4f} "
          f"{statistics.fmean(r['base_imb'] for r in steps):>9.4f}")
    print(f"  {'mean token imbalance, steps with bound = 1':<44} {statistics.fmean(r['ours_imb'] for r in tight):>8.4f} "
          f"{statistics.fmean(r['base_imb'] for r in tight):>9.4f}   ({len(tight)} of {len(steps)} steps)")
    print(f"  {'mean imbalance / bound, all steps':<44} "
          f"{statistics.fmean(r['ours_imb'] / r['bound'] for r in steps):>8.4f} "
          f"{statistics.fmean(r['base_imb'] / r['bound'] for r in steps):>9.4f}")
    print(f"  {'worst step imbalance / bound':<44} {max(r['ours_imb'] / r['bound'] for r in steps):>8.4f} "
          f"{max(r['base_imb'] / r['bound'] for r in steps):>9.4f}")
    print(f"  {'steps at the aligned lower bound':<44} "
          f"{100 * statistics.fmean(r['ours_mb'] == r['lb'] for r in steps):>7.1f}% "
          f"{100 * statistics.fmean(r['base_mb'] == r['lb'] for r in steps):>8.1f}%")
    print(f"  {'mean micro-batches per rank':<44} {statistics.fmean(r['ours_mb'] for r in steps):>8.2f} "
          f"{statistics.fmean(r['base_mb'] for r in steps):>9.2f}")
    print(f"  {'steps where ours is worse (imb or count)':<44} "
          f"{sum(r['ours_imb'] > r['base_imb'] + 1e-12 or r['ours_mb'] > r['base_mb'] for r in steps):>8d}")
    print(f"  cases where ours is worse on some step: {', '.join(worse) if worse else 'none'}")


def _timing(repeats: int) -> None:
    print(f"\ntiming: dp 64, cap 32k, RL-like lengths; CPU seconds, medians of {repeats} rounds (ours and the baseline "
          f"in turn); ratio = ours / baseline, median (min-max) of the rounds' ratios")
    print(f"  {'samples':>8} {'steps':<14} {'ours':>8} {'baseline':>9} {'ratio':>6} {'(min-max)':>12} "
          f"{'µs/sample':>10}")
    for n in (10_000, 30_000, 100_000):
        lens = rl_like(np.random.default_rng(n), n)
        for label, step in (("of 1024", 1024), ("one step", None)):
            def ours(lens=lens, step=step):
                return build_dp_schedule(lens, dp_size=64, max_tokens_per_gpu=32_768, global_batch_size=step)
            if step is None and n > 10_000:  # the baseline's first fit is quadratic in the step: minutes
                cpu = statistics.median(cpu_seconds(ours)[0] for _ in range(repeats))
                print(f"  {n:>8,} {label:<14} {cpu:>8.3f} {'-':>9} {'':>6} {'':>12} {1e6 * cpu / n:>10.2f}")
                continue

            def base(lens=lens, step=step or n):
                return [baseline_step(lens[a:a + step], 64, 32_768) for a in range(0, n - step + 1, step)]
            got = paired_cpu(ours, base, repeats)
            print(f"  {n:>8,} {label:<14} {got.a:>8.3f} {got.b:>9.3f} {got.ratio:>6.2f} "
                  f"{f'({got.low:.2f}-{got.high:.2f})':>12} {1e6 * got.a / n:>10.2f}")


def _flops_line() -> None:
    print("\ncost model, RL-like, dp 16, 512 samples, cap 32k (8 steps): FLOPs-proxy imbalance (a·L + L², a = 6·4096)")
    rng = np.random.default_rng(99)
    got = {"tokens": [], "flops": [], "baseline": []}
    for _ in range(STEPS_PER_CASE):
        lens = rl_like(rng, 512)
        flops = 6.0 * 4096 * lens + lens.astype(np.float64) ** 2
        for cost in ("tokens", "flops"):
            sched = build_dp_schedule(lens, dp_size=16, max_tokens_per_gpu=32_768, cost=cost)
            loads = np.array([sum(flops[mb].sum() for mb in sched.step_microbatches(r, 0)) for r in range(16)])
            got[cost].append(loads.max() / loads.mean())
        base = baseline_step(lens, 16, 32_768)
        loads = np.array([sum(flops[mb].sum() for mb in rank if mb) for rank in base])
        got["baseline"].append(loads.max() / loads.mean())
    print("  " + "   ".join(f"{k}: {statistics.fmean(v):.4f}" for k, v in got.items()))


if __name__ == "__main__":
    main()
