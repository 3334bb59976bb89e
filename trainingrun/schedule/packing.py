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
4. **Refine** by local search between ranks: while the heaviest rank ``A`` is above the mean (within a tolerance),
   find the swap of a whole micro-batch of ``A`` with one of a light rank ``B``, the sample move (from a bin of ``A``
   holding at least two samples into the bin with most room of ``B``) or the sample swap between ``A`` and ``B``
   whose cost difference ``d`` is closest to half the gap, with ``0 < d < gap`` and every bin still within its cap;
   apply it. Partners ``B`` are tried lightest first; ties go to the first candidate (micro-batch swaps, then moves,
   then sample swaps; by bin id or sample position). Each such step strictly lowers the sum of squared rank loads, so
   the search ends; it is also bounded by an iteration budget. Changes keep every bin's sample count ≥ 1 and ≤ the
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
from bisect import bisect_left, bisect_right, insort

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
    n_bins: int, token_cap: float, count_cap: float,
) -> int:
    """Place ``order`` (decreasing cost) into bins ``first_bin..n_bins-1``, each into the least-cost bin that fits.

    Writes ``item_bin`` and the bins' tokens ``btok``; returns how many of ``order`` were placed (all, or up to the
    first sample that fits nowhere). :func:`_pack_lpt_tokens` is the same for the common case."""
    heap = [(0.0, b) for b in range(first_bin, n_bins)]  # equal keys, increasing ids: already a heap
    bcnt = [0] * n_bins
    for placed, i in enumerate(order):
        t = tok[i]
        if not heap:
            return placed
        load, b = heap[0]
        popped = False
        if btok[b] + t > token_cap:
            found = _pop_fitting(heap, btok, t, token_cap)
            if found is None:
                return placed
            (load, b), popped = found, True
        item_bin[i] = b
        btok[b] += t
        bcnt[b] += 1
        if bcnt[b] < count_cap:  # back into the heap with its new load (bin ids are unique: no ties)
            (heapq.heappush if popped else heapq.heapreplace)(heap, (load + cost[i], b))
        elif not popped:
            heapq.heappop(heap)
    return len(order)


def _pack_lpt_tokens(
    tok: list[int], order: list[int], item_bin: list[int], btok: list[int], first_bin: int, n_bins: int, token_cap: int
) -> int:
    """:func:`_pack_lpt` when the cost is the tokens and there is no count cap (the same placement, faster).

    A bin's load is then its tokens, so the least-loaded bin is also the roomiest: if the sample does not fit there,
    it fits nowhere. The heap holds plain ints ``load·n_bins + bin``, which order like ``(load, bin)`` pairs and
    compare faster; adding ``t·n_bins`` adds ``t`` to the load and keeps the bin."""
    heap = list(range(first_bin, n_bins))  # load 0: sorted, so already a heap
    limit = (token_cap + 1) * n_bins  # key + t·n_bins < limit  <=>  load + t <= token_cap
    placed = len(order)
    for k, i in enumerate(order):
        if not heap:
            placed = k
            break
        key = heap[0] + tok[i] * n_bins
        if key >= limit:
            placed = k
            break
        item_bin[i] = key % n_bins
        heapq.heapreplace(heap, key)
    for key in heap:
        load, b = divmod(key, n_bins)
        btok[b] = load
    return placed


def _pop_fitting(heap: list[tuple[float, int]], btok: list[int], t: int, token_cap: float):
    """Pop the least-cost entry of ``heap`` whose bin still has room for ``t`` tokens; the entries popped on the way
    go back. None (and ``heap`` as it was) if no bin has room."""
    aside = []
    found = None
    while heap:
        entry = heapq.heappop(heap)
        if btok[entry[1]] + t <= token_cap:
            found = entry
            break
        aside.append(entry)
    for entry in aside:
        heapq.heappush(heap, entry)
    return found


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
    if cost_is_tokens and count_cap is None:
        placed = _pack_lpt_tokens(tok_l, order, item_bin, btok, first, n_bins, tcap)
    else:
        placed = _pack_lpt(tok_l, cost_l, order, item_bin, btok, first, n_bins, tcap, ccap)
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
    """Local search between ranks; see phase 4 in the module docstring. Mutates ``item_bin`` and ``bin_rank``.

    The state is kept in plain lists, not numpy arrays: a search looks at two ranks' few bins and samples (16 samples
    per rank for 1024 samples over 64 ranks), where numpy's overhead per call costs more than the work itself.
    Candidates are visited in a fixed order (bins of ``A`` by id, then bins of ``B`` by id; samples of ``A`` by
    position; for a swap, ``B``'s samples by cost, ties by position). A candidate replaces the best one only if its
    score is strictly lower, so ties go to the first one met. A candidate that cannot beat the best is not checked
    against the cap. All costs are integer-valued floats (tokens, or ``a·L + L²`` with an integer ``a``), so every sum
    below is exact, whatever the order of the additions.
    """

    def __init__(self, tok, cost, item_bin, bin_rank, dp_size, token_cap, count_cap):
        self._tok_in, self._cost_in = tok, cost
        self._item_bin_out, self._bin_rank_out = item_bin, bin_rank
        self.rank_cost = np.bincount(bin_rank[item_bin], weights=cost, minlength=dp_size).tolist()
        self.tcap = _NO_CAP if token_cap is None else float(token_cap)
        self.ccap = _NO_CAP if count_cap is None else count_cap

    def _load_state(self) -> None:
        """The per-sample and per-bin lists; built only once a step needs refining."""
        item_bin, bin_rank = self._item_bin_out, self._bin_rank_out
        n_bins = len(bin_rank)
        tok = self._tok_in.astype(np.float64)
        self.tok = tok.tolist()
        self.cost = self._cost_in.tolist()
        self.item_bin = item_bin.tolist()
        self.bin_rank = bin_rank.tolist()
        counts = np.bincount(item_bin, minlength=n_bins)
        self.bin_cnt = counts.tolist()
        self.bin_tok = np.bincount(item_bin, weights=tok, minlength=n_bins).tolist()
        self.bin_cost = np.bincount(item_bin, weights=self._cost_in, minlength=n_bins).tolist()
        self.bin_items = _groups(np.argsort(item_bin, kind="stable").tolist(), counts.tolist())
        self.rank_bins = _groups(np.argsort(bin_rank, kind="stable").tolist(),
                                 np.bincount(bin_rank, minlength=len(self.rank_cost)).tolist())

    def run(self, max_iter: int, tol: float = 5e-4) -> None:
        """Improve until the heaviest rank is within ``tol`` of the mean, nothing improves, or ``max_iter`` steps.

        Partners ``B`` are tried lightest first (ties: lower rank first)."""
        rc = self.rank_cost
        dp = len(rc)
        limit = sum(rc) / dp * (1 + tol)  # changes keep the total: the mean is fixed
        if dp < 2 or max(rc) <= limit:
            return
        self._load_state()
        for _ in range(max_iter):
            top = max(rc)
            if top <= limit or not self._improve(rc.index(top), top):
                break
        self._item_bin_out[:] = self.item_bin
        self._bin_rank_out[:] = self.bin_rank

    def _improve(self, A: int, top: float) -> bool:
        """Apply the best change between the heaviest rank ``A`` and the lightest partner that has one; False if no
        partner below ``top`` has one."""
        rc = self.rank_cost
        xs = self._samples(A)
        partners = [rc.index(min(rc))]  # the lightest; all of them, sorted, only when it has no change
        for j in range(len(rc) - 1):
            if j == 1:
                partners = sorted(range(len(rc)), key=rc.__getitem__)  # stable: ties by rank
            B = partners[j]
            gap = top - rc[B]
            if gap <= 0:
                return False
            op = self._best_change(A, B, xs, gap)
            if op is not None:
                self._apply(op, A, B)
                return True
        return False

    def _samples(self, rank: int) -> list[int]:
        """The samples of ``rank``, by position."""
        out: list[int] = []
        for b in self.rank_bins[rank]:
            out += self.bin_items[b]
        out.sort()
        return out

    def _best_change(self, A: int, B: int, xs: list[int], gap: float):
        """The change between ``A`` and ``B`` whose cost difference ``d`` is closest to ``gap / 2`` with
        ``0 < d < gap`` and every bin within its cap: ``("bins", a, b)``, ``("move", x, bin)`` or ``("swap", x, y)``;
        None if there is none. Kinds are tried in that order; a later one wins only with a strictly lower score."""
        half = gap / 2
        best, op = self._best_bin_swap(A, B, gap, half)
        best, op = self._best_move(xs, B, gap, half, best, op)
        return self._best_swap(xs, self._samples(B), gap, half, best, op)

    def _best_bin_swap(self, A: int, B: int, gap: float, half: float):
        """Swap a whole micro-batch of ``A`` with one of ``B``: coarse, cheap, and no cap can break."""
        bin_cost = self.bin_cost
        best, op = _NO_CAP, None
        for a in self.rank_bins[A]:
            ca = bin_cost[a]
            for b in self.rank_bins[B]:
                d = ca - bin_cost[b]
                if 0 < d < gap and abs(d - half) < best:
                    best, op = abs(d - half), ("bins", a, b)
        return best, op

    def _best_move(self, xs: list[int], B: int, gap: float, half: float, best: float, op):
        """Move a sample of ``A`` from a bin holding at least two into ``B``'s roomiest bin (the first of equals)."""
        bin_cnt, bin_tok = self.bin_cnt, self.bin_tok
        dest, room = -1, 0.0
        for b in self.rank_bins[B]:
            if bin_cnt[b] < self.ccap:
                r = _NO_CAP if bin_cnt[b] == 0 else self.tcap - bin_tok[b]
                if dest < 0 or r > room:
                    dest, room = b, r
        if dest < 0:
            return best, op
        cost, tok, item_bin = self.cost, self.tok, self.item_bin
        for x in xs:
            cx = cost[x]
            if cx < gap and abs(cx - half) < best and tok[x] <= room and bin_cnt[item_bin[x]] >= 2:
                best, op = abs(cx - half), ("move", x, dest)
        return best, op

    def _best_swap(self, xs: list[int], ys: list[int], gap: float, half: float, best: float, op):
        """Swap a sample ``x`` of ``A`` with a sample ``y`` of ``B``. For each ``x`` only the four samples of ``B``
        nearest in cost to ``cost[x] - gap / 2`` are candidates (two below, two from there up)."""
        if not xs or not ys:
            return op
        cost, tok, item_bin, tcap = self.cost, self.tok, self.item_bin, self.tcap
        bin_tok, bin_cnt = self.bin_tok, self.bin_cnt
        ys.sort(key=cost.__getitem__)  # stable: ties stay by position
        cy = [cost[y] for y in ys]
        last = len(ys) - 1
        for x in xs:
            cx = cost[x]
            p = bisect_left(cy, cx - half)
            # the candidates' scores grow away from p - 1 (below) and p (from there up): skip x if neither beats best
            if ((p == 0 or abs(cx - cy[p - 1] - half) >= best)
                    and (p > last or abs(cx - cy[p] - half) >= best)):
                continue
            tx, bx = tok[x], item_bin[x]
            prev = -1
            for c in (p - 2, p - 1, p, p + 1):
                c = 0 if c < 0 else last if c > last else c
                if c == prev:  # clipped at an end: the same candidate again
                    continue
                prev = c
                d = cx - cy[c]
                if not 0 < d < gap or abs(d - half) >= best:
                    continue
                y = ys[c]
                by, ty = item_bin[y], tok[y]
                if ((bin_tok[bx] - tx + ty <= tcap or bin_cnt[bx] == 1)
                        and (bin_tok[by] - ty + tx <= tcap or bin_cnt[by] == 1)):
                    best, op = abs(d - half), ("swap", x, y)
        return op

    def _apply(self, op, A: int, B: int) -> None:
        kind, x, other = op
        if kind == "bins":
            self.bin_rank[x], self.bin_rank[other] = B, A
            _replace_sorted(self.rank_bins[A], x, other)  # by id: the order the micro-batch swaps are tried in
            _replace_sorted(self.rank_bins[B], other, x)
            d = self.bin_cost[x] - self.bin_cost[other]
        elif kind == "move":
            src = self.item_bin[x]
            self.item_bin[x] = other
            self.bin_items[src].remove(x)
            self.bin_items[other].append(x)
            self._shift(src, other, self.tok[x], self.cost[x], 1)
            d = self.cost[x]
        else:
            y = other
            bx, by = self.item_bin[x], self.item_bin[y]
            self.item_bin[x], self.item_bin[y] = by, bx
            lx, ly = self.bin_items[bx], self.bin_items[by]  # in no particular order (see _samples)
            lx[lx.index(x)] = y
            ly[ly.index(y)] = x
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


def _groups(order: list[int], counts: list[int]) -> list[list[int]]:
    """``order`` cut into consecutive lists of ``counts[k]`` entries."""
    out, start = [], 0
    for c in counts:
        out.append(order[start:start + c])
        start += c
    return out


def _replace_sorted(items: list[int], old: int, new: int) -> None:
    """Replace ``old`` by ``new`` in the sorted list ``items``, keeping it sorted."""
    items.remove(old)
    insort(items, new)


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
) -> tuple[np.ndarray, list[list[int]]]:
    """Plan one step. Returns ``(positions, sizes)``: ``sizes[rank][k]`` is the sample count of rank ``rank``'s
    ``k``-th micro-batch, and ``positions`` the local positions (into ``tokens``) of all samples, rank by rank, each
    rank's in micro-batch order (rank ``r``'s are the next ``sum(sizes[r])``).

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
    positions = np.argsort(bin_pos[item_bin], kind="stable")  # by bin position, then by sample position
    sizes = np.bincount(item_bin, minlength=n_bins)[bin_order].reshape(dp_size, per_rank)
    return positions, sizes.tolist()
