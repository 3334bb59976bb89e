"""Per-step planning: pack one step's samples into micro-batches, then distribute them over data-parallel ranks.

"Pack first, distribute second", in four phases (all on one step's samples, identified by local positions):

1. **Count.** The aligned lower bound ``M`` on micro-batches (:func:`lower_bound_microbatches`): dynamic mode
   ``n_oversized + ceil(other tokens / cap)``, static mode ``ceil(n / micro_batch_size)``, rounded up to a multiple of
   ``q = dp_size × microbatch_multiple``. Every rank then runs ``M / dp_size`` micro-batches.
2. **Pack** into exactly ``M`` bins. Oversized samples (more tokens than the cap) each get a bin of their own. The rest
   go, by decreasing cost, into the least-loaded bin that fits (LPT: the bins end up level, so the distribution below
   has even pieces to work with). Near a fill ratio of 1 LPT can get stuck with a tail of small samples left; the tail
   is then placed best-fit (into the fullest bin it fits), and if that fails the whole step is packed
   best-fit-decreasing by tokens (tight, unbalanced: the refinement restores balance). Only when that fails too does
   ``M`` grow by ``q``. Static mode never fails: ``M`` bins of at most ``micro_batch_size`` samples hold the step.
3. **Distribute** the bins by decreasing cost, each to the least-loaded rank that still has room for a bin, so each
   rank gets exactly ``M / dp_size`` bins. A heavy bin (an oversized sample) makes its rank heavy, so that rank is
   skipped until the end and then receives the smallest bins.
4. **Refine** by local search between ranks: while the heaviest rank ``A`` is above the mean, find the sample move
   (from a bin of ``A`` holding at least two samples into the bin with most room of a light rank ``B``) or the sample
   swap between ``A`` and ``B`` whose cost difference ``d`` is closest to half the gap, with ``0 < d < gap`` and every
   bin still within its cap; apply it. Each such step strictly lowers the sum of squared rank loads, so the search
   ends; it is also bounded by an iteration budget. Moves and swaps keep every bin's sample count ≥ 1 and ≤ the
   static size, every bin within the token cap (or a lone sample), and every rank's bin count.

Finally each rank's micro-batches are ordered by decreasing tokens (the largest first, so a memory problem shows at
the first micro-batch), each micro-batch's samples by position.

Empty micro-batches: in dynamic mode, when the aligned count ``M`` exceeds the step's sample count ``n`` (only when
samples are few and each is close to the cap), ``M - n`` micro-batches are necessarily empty. They are spread so that
every rank still gets at least one sample (the caller guarantees ``n ≥ dp_size``); trainers run them as zero-loss
passes. Static mode instead raises ``ValueError`` (``micro_batch_size`` cannot be aligned for this step).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right, insort

import numpy as np

_NO_CAP = math.inf


def aligned(count: int, quantum: int) -> int:
    """``count`` rounded up to a multiple of ``quantum`` (at least one ``quantum``)."""
    count = max(int(count), 1)
    return -(-count // quantum) * quantum


def raw_lower_bound(tokens: np.ndarray, *, token_cap: int | None = None, count_cap: int | None = None) -> int:
    """Fewest micro-batches that can hold a step, before alignment.

    Dynamic (``token_cap``): each oversized sample needs a micro-batch of its own, the other tokens need
    ``ceil(tokens / cap)`` more. (Plain ``ceil(all tokens / cap)`` would overcount: an oversized sample fills one
    micro-batch with more than ``cap`` tokens.) Static (``count_cap``): ``ceil(n / micro_batch_size)``.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    if token_cap is not None:
        over = tokens > token_cap
        rest = int(tokens[~over].sum())
        return int(over.sum()) + -(-rest // token_cap)
    assert count_cap is not None
    return -(-len(tokens) // count_cap)


def lower_bound_microbatches(
    tokens: np.ndarray, *, dp_size: int, multiple: int = 1, token_cap: int | None = None, count_cap: int | None = None
) -> int:
    """Total micro-batches (all ranks) of a step at the aligned lower bound: :func:`raw_lower_bound` rounded up to a
    multiple of ``dp_size × multiple``."""
    return aligned(raw_lower_bound(tokens, token_cap=token_cap, count_cap=count_cap), dp_size * multiple)


# ----------------------------------------------------------------------------------------------------------- packing


def _pack_lpt(
    tok: list[int], cost: list[float], order: list[int], item_bin: list[int], btok: list[int], first_bin: int,
    n_bins: int, token_cap: float, count_cap: float, cost_is_tokens: bool,
) -> int:
    """Place ``order`` (decreasing cost) into bins ``first_bin..n_bins-1``, each into the least-cost bin that fits.

    Writes ``item_bin`` and the bins' tokens ``btok``; returns how many of ``order`` were placed (all, or up to the
    first sample that fits nowhere)."""
    heap = [(0.0, b) for b in range(first_bin, n_bins)]  # equal keys, increasing ids: already a heap
    bcnt = [0] * n_bins
    pop, push = heapq.heappop, heapq.heappush
    for placed, i in enumerate(order):
        t = tok[i]
        if not heap:
            return placed
        load, b = pop(heap)
        if btok[b] + t > token_cap:
            if cost_is_tokens:  # the least-loaded bin has the most room: nothing fits
                return placed
            aside = [(load, b)]
            found = False
            while heap:
                load, b = pop(heap)
                if btok[b] + t <= token_cap:
                    found = True
                    break
                aside.append((load, b))
            for entry in aside:
                push(heap, entry)
            if not found:
                return placed
        item_bin[i] = b
        btok[b] += t
        bcnt[b] += 1
        if bcnt[b] < count_cap:
            push(heap, (load + cost[i], b))
    return len(order)


def _pack_best_fit(
    tok: list[int], order: list[int], item_bin: list[int], btok: list[int], first_bin: int, n_bins: int, token_cap: int
) -> bool:
    """Best fit by tokens, in the order given, into bins ``first_bin..n_bins-1`` already holding ``btok`` tokens: each
    sample into the fullest bin it fits. Tighter than LPT near a fill ratio of 1, at the price of balance (the
    refinement restores it). Writes ``item_bin``; returns False if some sample fits nowhere."""
    # keys load·n_bins + bin: plain ints sort and bisect faster than (load, bin) tuples
    keys = sorted(btok[b] * n_bins + b for b in range(first_bin, n_bins))
    smallest = min((tok[i] for i in order), default=0)
    for i in order:
        t = tok[i]
        k = bisect_right(keys, (token_cap - t) * n_bins + n_bins - 1) - 1
        if k < 0:
            return False
        load, b = divmod(keys.pop(k), n_bins)
        item_bin[i] = b
        btok[b] = load + t
        if token_cap - btok[b] >= smallest:  # else no sample fits any more: drop the bin from the search
            insort(keys, btok[b] * n_bins + b)
    return True


def _fill_empty_bins(tok: np.ndarray, item_bin: np.ndarray, n_bins: int) -> None:
    """Give every empty bin one sample taken from a bin holding two or more (smallest such sample first)."""
    counts = np.bincount(item_bin, minlength=n_bins)
    empty = list(np.flatnonzero(counts == 0))
    if not empty:
        return
    for i in np.argsort(tok, kind="stable"):
        if not empty:
            break
        if counts[item_bin[i]] >= 2:
            counts[item_bin[i]] -= 1
            b = empty.pop()
            item_bin[i] = b
            counts[b] = 1


def _pack(
    tok: np.ndarray, cost: np.ndarray, n_bins: int, token_cap: int | None, count_cap: int | None, cost_is_tokens: bool
) -> np.ndarray | None:
    """Pack a step's samples into exactly ``n_bins`` bins; the bin of each sample, or None if they do not fit."""
    n = len(tok)
    tok_l = tok.tolist()
    cost_l = cost.tolist()
    item_bin = [0] * n
    tcap = _NO_CAP if token_cap is None else token_cap
    ccap = _NO_CAP if count_cap is None else count_cap
    if token_cap is not None:
        over = np.flatnonzero(tok > token_cap)
        if len(over) > n_bins:
            return None
        for b, i in enumerate(over.tolist()):
            item_bin[i] = b
        rest = np.flatnonzero(tok <= token_cap)
    else:
        over = np.empty(0, dtype=np.int64)
        rest = np.arange(n)
    first = len(over)
    order = rest[np.argsort(-cost[rest], kind="stable")].tolist()
    btok = [0] * n_bins
    placed = _pack_lpt(tok_l, cost_l, order, item_bin, btok, first, n_bins, tcap, ccap, cost_is_tokens)
    if placed < len(order):
        if token_cap is None:
            return None
        # LPT left its tail unplaced: best-fit the tail into the level bins; failing that, best-fit decreasing.
        tail = sorted(order[placed:], key=lambda j: -tok_l[j])
        if not _pack_best_fit(tok_l, tail, item_bin, btok, first, n_bins, token_cap):
            btok = [0] * n_bins
            by_tokens = sorted(order, key=lambda j: -tok_l[j])
            if not _pack_best_fit(tok_l, by_tokens, item_bin, btok, first, n_bins, token_cap):
                return None
    bins = np.asarray(item_bin, dtype=np.int64)
    _fill_empty_bins(tok, bins, n_bins)
    return bins


# ------------------------------------------------------------------------------------------------------ distribution


def _distribute(bin_cost: np.ndarray, dp_size: int, per_rank: int) -> np.ndarray:
    """Rank of each bin: by decreasing cost, to the least-loaded rank that has fewer than ``per_rank`` bins."""
    bin_rank = np.empty(len(bin_cost), dtype=np.int64)
    heap = [(0.0, r) for r in range(dp_size)]
    counts = [0] * dp_size
    costs = bin_cost.tolist()
    for b in np.argsort(-bin_cost, kind="stable").tolist():
        load, r = heapq.heappop(heap)
        bin_rank[b] = r
        counts[r] += 1
        if counts[r] < per_rank:
            heapq.heappush(heap, (load + costs[b], r))
    return bin_rank


# -------------------------------------------------------------------------------------------------------- refinement


class _Refiner:
    """Local search between ranks; see phase 4 in the module docstring. Mutates ``item_bin``."""

    def __init__(self, tok, cost, item_bin, bin_rank, dp_size, token_cap, count_cap):
        self.tok = tok.astype(np.float64)
        self.cost = cost
        self.item_bin = item_bin
        self.bin_rank = bin_rank
        n_bins = len(bin_rank)
        self.bin_tok = np.bincount(item_bin, weights=self.tok, minlength=n_bins)
        self.bin_cnt = np.bincount(item_bin, minlength=n_bins)
        self.bin_cost = np.bincount(item_bin, weights=cost, minlength=n_bins)
        self.rank_cost = np.bincount(bin_rank[item_bin], weights=cost, minlength=dp_size)
        self.tcap = _NO_CAP if token_cap is None else float(token_cap)
        self.ccap = _NO_CAP if count_cap is None else count_cap

    def _bin_ok(self, tokens: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """A bin is valid with ``tokens`` and ``counts`` if within the cap or a single sample."""
        return (tokens <= self.tcap) | (counts == 1)

    def _best_move(self, xs: np.ndarray, B: int, gap: float):
        bins_b = np.flatnonzero((self.bin_rank == B) & (self.bin_cnt < self.ccap))
        if len(bins_b) == 0:
            return None
        room = np.where(self.bin_cnt[bins_b] == 0, _NO_CAP, self.tcap - self.bin_tok[bins_b])
        k = int(np.argmax(room))
        xs = xs[(self.bin_cnt[self.item_bin[xs]] >= 2) & (self.tok[xs] <= room[k]) & (self.cost[xs] < gap)]
        if len(xs) == 0:
            return None
        score = np.abs(self.cost[xs] - gap / 2)
        j = int(np.argmin(score))
        return float(score[j]), ("move", int(xs[j]), int(bins_b[k]))

    def _best_bin_swap(self, A: int, B: int, gap: float):
        """Swap a whole micro-batch of ``A`` with one of ``B``: coarse, cheap, and no cap can break."""
        ba = np.flatnonzero(self.bin_rank == A)
        bb = np.flatnonzero(self.bin_rank == B)
        d = self.bin_cost[ba][:, None] - self.bin_cost[bb][None, :]
        score = np.where((d > 0) & (d < gap), np.abs(d - gap / 2), np.inf)
        flat = int(np.argmin(score))
        if not np.isfinite(score.flat[flat]):
            return None
        i, j = divmod(flat, len(bb))
        return float(score.flat[flat]), ("bins", int(ba[i]), int(bb[j]))

    def _best_swap(self, xs: np.ndarray, ys: np.ndarray, gap: float):
        if len(xs) == 0 or len(ys) == 0:
            return None
        ys = ys[np.argsort(self.cost[ys], kind="stable")]
        cy = self.cost[ys]
        cx = self.cost[xs]
        pos = np.searchsorted(cy, cx - gap / 2)
        cand = np.clip(pos[:, None] + np.array([-2, -1, 0, 1]), 0, len(ys) - 1)  # (|xs|, 4) positions into ys
        y = ys[cand]
        x = np.broadcast_to(xs[:, None], y.shape)
        d = self.cost[x] - self.cost[y]
        bx, by = self.item_bin[x], self.item_bin[y]
        tx, ty = self.tok[x], self.tok[y]
        ok = (d > 0) & (d < gap)
        ok &= self._bin_ok(self.bin_tok[bx] - tx + ty, self.bin_cnt[bx])
        ok &= self._bin_ok(self.bin_tok[by] - ty + tx, self.bin_cnt[by])
        if not ok.any():
            return None
        score = np.where(ok, np.abs(d - gap / 2), np.inf)
        flat = int(np.argmin(score))
        return float(score.flat[flat]), ("swap", int(x.flat[flat]), int(y.flat[flat]))

    def run(self, max_iter: int, tol: float = 5e-4, quick_tries: int = 4) -> None:
        """Improve until the heaviest rank is within ``tol`` of the mean, nothing improves, or ``max_iter`` steps.

        Partners ``B`` are tried lightest first; beyond the ``quick_tries`` lightest, all ranks' samples are grouped
        once per iteration rather than searched rank by rank."""
        dp = len(self.rank_cost)
        if dp < 2:
            return
        for _ in range(max_iter):
            A = int(np.argmax(self.rank_cost))
            top = self.rank_cost[A]
            if top <= self.rank_cost.mean() * (1 + tol):
                return
            item_rank = self.bin_rank[self.item_bin]
            xs = np.flatnonzero(item_rank == A)
            by_rank = None
            applied = False
            for j, B in enumerate(np.argsort(self.rank_cost, kind="stable")[: dp - 1].tolist()):
                gap = top - self.rank_cost[B]
                if gap <= 0:
                    break
                if j == quick_tries:
                    order = np.argsort(item_rank, kind="stable")
                    by_rank = np.split(order, np.cumsum(np.bincount(item_rank, minlength=dp))[:-1])
                ys = np.flatnonzero(item_rank == B) if by_rank is None else by_rank[B]
                options = [o for o in (self._best_bin_swap(A, B, gap), self._best_move(xs, B, gap),
                                       self._best_swap(xs, ys, gap)) if o]
                if options:
                    self._apply(min(options, key=lambda o: o[0])[1], A, B)
                    applied = True
                    break
            if not applied:
                return

    def _apply(self, op, A: int, B: int) -> None:
        kind, x, other = op
        if kind == "bins":
            self.bin_rank[x], self.bin_rank[other] = B, A
            d = self.bin_cost[x] - self.bin_cost[other]
        elif kind == "move":
            src = self.item_bin[x]
            self.item_bin[x] = other
            self._shift(src, other, self.tok[x], self.cost[x], 1)
            d = self.cost[x]
        else:
            y = other
            bx, by = self.item_bin[x], self.item_bin[y]
            self.item_bin[x], self.item_bin[y] = by, bx
            d = self.cost[x] - self.cost[y]
            self._shift(bx, by, self.tok[x] - self.tok[y], d, 0)
        self.rank_cost[A] -= d
        self.rank_cost[B] += d

    def _shift(self, src: int, dst: int, tokens: float, cost: float, count: int) -> None:
        """Account ``tokens``, ``cost`` and ``count`` samples moving from bin ``src`` to bin ``dst``."""
        self.bin_tok[src] -= tokens
        self.bin_tok[dst] += tokens
        self.bin_cost[src] -= cost
        self.bin_cost[dst] += cost
        self.bin_cnt[src] -= count
        self.bin_cnt[dst] += count


# -------------------------------------------------------------------------------------------------------------- plan


def plan_step(
    tokens: np.ndarray,
    costs: np.ndarray,
    *,
    dp_size: int,
    multiple: int = 1,
    token_cap: int | None = None,
    count_cap: int | None = None,
    cost_is_tokens: bool = True,
    refine: bool = True,
) -> list[tuple[np.ndarray, list[int]]]:
    """Plan one step. ``result[rank] = (positions, sizes)``: the local positions (into ``tokens``) of rank ``rank``'s
    samples in micro-batch order, and the size of each of its micro-batches (``sum(sizes) == len(positions)``).

    Exactly one of ``token_cap`` (dynamic) and ``count_cap`` (static) is given. Every rank gets the same number of
    micro-batches, a multiple of ``multiple``. Requires ``len(tokens) >= dp_size``. Raises ``ValueError`` (naming
    ``micro_batch_size``) when static mode cannot give each of the aligned micro-batches a sample.
    """
    tok = np.asarray(tokens, dtype=np.int64)
    cost = np.asarray(costs, dtype=np.float64)
    n = len(tok)
    quantum = dp_size * multiple
    n_bins = lower_bound_microbatches(tok, dp_size=dp_size, multiple=multiple, token_cap=token_cap, count_cap=count_cap)
    if count_cap is not None and n_bins > n:
        raise ValueError(
            f"micro_batch_size: {n} samples in micro-batches of at most {count_cap} need "
            f"{raw_lower_bound(tok, count_cap=count_cap)} micro-batches, aligned to a multiple of dp_size × "
            f"microbatch_multiple = {quantum} that is {n_bins}: more micro-batches than samples (each needs one); "
            f"static mode whose count cannot be aligned: use more samples per step, fewer ranks or a smaller "
            f"microbatch_multiple")
    while True:
        item_bin = _pack(tok, cost, n_bins, token_cap, count_cap, cost_is_tokens)
        if item_bin is not None:
            break
        n_bins += quantum
    per_rank = n_bins // dp_size
    bin_cost = np.bincount(item_bin, weights=cost, minlength=n_bins)
    bin_rank = _distribute(bin_cost, dp_size, per_rank)
    if refine:
        _Refiner(tok, cost, item_bin, bin_rank, dp_size, token_cap, count_cap).run(max_iter=64 + 4 * dp_size)
    return _layout(tok, item_bin, bin_rank, dp_size, per_rank)


def _layout(tok: np.ndarray, item_bin: np.ndarray, bin_rank: np.ndarray, dp_size: int, per_rank: int):
    """Per rank: its bins by decreasing tokens (ties: bin id), each bin's positions ascending; see :func:`plan_step`."""
    n_bins = len(bin_rank)
    bin_tok = np.bincount(item_bin, weights=tok.astype(np.float64), minlength=n_bins)
    bin_order = np.lexsort((np.arange(n_bins), -bin_tok, bin_rank))  # rank-major: per_rank bins per rank
    bin_pos = np.empty(n_bins, dtype=np.int64)
    bin_pos[bin_order] = np.arange(n_bins)
    items = np.lexsort((np.arange(len(item_bin)), bin_pos[item_bin]))
    sizes = np.bincount(item_bin, minlength=n_bins)[bin_order].reshape(dp_size, per_rank)
    rank_sizes = sizes.sum(axis=1)
    flat = np.split(items, np.cumsum(rank_sizes)[:-1])
    return [(flat[r], sizes[r].tolist()) for r in range(dp_size)]
