"""(sum, count) reduction of weighted metrics: a torch-free core and a one-all-reduce torch wrapper.

A per-sample (or per-token) metric travels as the pair (Σ values, number of values). Pairs from any set of ranks
combine by adding both parts, and the mean is Σsum / Σcount — the mean over all samples, whatever how many each rank
holds. (Averaging per-rank means would weight a rank with 3 samples like one with 300.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class Weighted:
    """A running (sum, count) pair."""

    sum: float = 0.0
    count: float = 0.0

    def observe(self, value: float) -> None:
        """One value."""
        self.sum += float(value)
        self.count += 1.0

    def add(self, total: float, count: float) -> None:
        """A pre-summed `total` over `count` values."""
        self.sum += float(total)
        self.count += float(count)

    def merge(self, other: Weighted) -> Weighted:
        return Weighted(self.sum + other.sum, self.count + other.count)

    @property
    def mean(self) -> float:
        """Σsum / Σcount; 0.0 when nothing was counted."""
        return self.sum / self.count if self.count else 0.0


@dataclass
class WeightedSet:
    """Named (sum, count) pairs, e.g. one rank's statistics for one step."""

    pairs: dict[str, Weighted] = field(default_factory=dict)

    @classmethod
    def from_values(cls, values: Mapping[str, Iterable[float]]) -> WeightedSet:
        """Each name's list of per-sample values becomes (sum, len)."""
        out = cls()
        for name, vals in values.items():
            vals = [float(v) for v in vals]
            out.pairs[name] = Weighted(sum(vals), float(len(vals)))
        return out

    def add_pair(self, name: str, total: float, count: float) -> None:
        self.pairs.setdefault(name, Weighted()).add(total, count)

    def merge(self, other: WeightedSet) -> WeightedSet:
        names = list(self.pairs) + [n for n in other.pairs if n not in self.pairs]
        return WeightedSet({n: self.pairs.get(n, Weighted()).merge(other.pairs.get(n, Weighted())) for n in names})

    def means(self) -> dict[str, float]:
        return {n: w.mean for n, w in self.pairs.items()}


def reduce_sets(sets: Iterable[WeightedSet]) -> WeightedSet:
    """What an all-reduce SUM over ranks computes, without torch: the merged pairs."""
    out = WeightedSet()
    for s in sets:
        out = out.merge(s)
    return out


def allreduce_pairs(pairs, group=None):
    """All-reduce (SUM) a float64 tensor [N, 2] of (sum, count) pairs over `group` in one collective; returns a new
    tensor. Without an initialised process group it returns a copy (single process)."""
    return _allreduce(pairs, group, "SUM")


def allreduce_max(values, group=None):
    """Element-wise maximum of a float64 tensor over `group` (a maximum statistic beside the pairs); a new tensor,
    a copy without an initialised process group."""
    return _allreduce(values, group, "MAX")


def _allreduce(values, group, op: str):
    import torch  # deferred: torch
    import torch.distributed as dist  # deferred: torch

    t = values.detach().to(torch.float64).clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        if dist.get_backend(group) == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
        t = t.cpu()
    return t


def pairs_to_set(names: Iterable[str], pairs) -> WeightedSet:
    """A [N, 2] tensor (or nested list) of pairs as a WeightedSet."""
    rows = pairs.tolist() if hasattr(pairs, "tolist") else pairs
    out = WeightedSet()
    for name, (s, c) in zip(names, rows, strict=True):
        out.add_pair(name, s, c)
    return out
