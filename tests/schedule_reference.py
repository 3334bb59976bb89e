"""The scheduler's packing heap and refinement as they were before they were made faster (issue 19).

Kept as an oracle: tests/unit/test_schedule.py puts these in place of ``trainingrun.schedule.packing``'s own and
asserts that the schedules are exactly the same. ``pack_lpt`` is the LPT placement with a heap of ``(load, bin)``
pairs, popped and pushed back; ``ReferenceRefiner`` the local search on numpy arrays, one vectorised search per kind
of change."""

from __future__ import annotations

import heapq
import math

import numpy as np

_NO_CAP = math.inf


def pack_lpt(
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


class ReferenceRefiner:
    """Local search between ranks (phase 4 of trainingrun/schedule/packing.py), numpy version. Mutates ``item_bin``
    and ``bin_rank``."""

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
