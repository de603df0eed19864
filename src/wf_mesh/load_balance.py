"""Which tokens each cp rank holds under a :class:`~wf_mesh.masks.RangeMask`, so that every rank computes
about the same number of unmasked (query, key) pairs.

A rank's work is the pairs its queries attend to (:meth:`RangeMask.row_work` over its intervals); the
imbalance is ``max / mean`` over ranks (1.0 when nothing attends). Contiguous ``torch.chunk`` shards of a
block-causal sequence of 16 equal chunks at cp 4 hold ``10, 26, 42, 58`` chunk-pairs: imbalance 1.71.

The rule (:func:`balance_by_work`), pure integer arithmetic, so every rank computes the same result:

0. Contiguous ``torch.chunk`` shards, if they are within the target already (one interval per rank, the
   order of a plan without a mask).
1. Otherwise units are the mask's chunks: the intervals between its :meth:`RangeMask.boundaries` (frame chunks of a
   block-causal mask, clips of a packed one), each kept contiguous.
2. Greedy longest-processing-time (LPT): units by decreasing work (ties: earlier first) each go to the rank
   with the least work so far (ties: fewer tokens, then the lower rank).
3. While the imbalance exceeds the target (1.10), the heaviest unit is cut in two of equal work (rows'
   work is linear inside a unit, so the cut is exact arithmetic) and LPT runs again; the best assignment
   seen is kept. Graham's bound (``max <= mean + the heaviest unit``) makes this converge once units weigh
   under a tenth of the mean; a unit of one token is never cut (the mask then allows no better).

Why this rule: whole chunks when they suffice (a rank holds whole frame chunks, a KV cache grows by chunks,
few intervals per rank, so few kernel calls and one permutation), cuts only where the work needs them; LPT
is deterministic, ``O(U log U)``, and within 4/3 of the optimum before any cut. A rank's intervals are kept in
increasing position order (the plan order).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Sequence

from wf_mesh.masks import RangeMask
from wf_mesh.sizing import chunk_sizes
from wf_mesh.topology import as_int

__all__ = ["TARGET", "balance_by_work", "coalesce", "contiguous_segments", "imbalance", "rank_work"]

TARGET = 1.10
"""The imbalance :func:`balance_by_work` stops at (max / mean work)."""

Interval = tuple[int, int]


def imbalance(work: Sequence[int]) -> float:
    """``max / mean`` of the ranks' work (1.0 when the mean is 0).

    Returns:
        The imbalance.
    """
    total = sum(work)
    return 1.0 if total == 0 else max(work) * len(work) / total


def rank_work(mask: RangeMask, segments: Sequence[Sequence[Interval]]) -> list[int]:
    """Each rank's unmasked (query, key) pairs: its query intervals against every key.

    Returns:
        The work per rank.
    """
    return [mask.count(list(segs), (0, mask.seq_len)) if segs else 0 for segs in segments]


def contiguous_segments(seq_len: int, parts: int) -> list[list[Interval]]:
    """Each rank's interval of ``torch.chunk`` shards (none for an empty shard).

    Returns:
        Per rank, its intervals.
    """
    out, start = [], 0
    for size in chunk_sizes(seq_len, parts):
        out.append([(start, start + size)] if size else [])
        start += size
    return out


def coalesce(intervals: Sequence[Interval]) -> list[Interval]:
    """``intervals`` sorted, empty ones dropped, touching ones joined.

    Returns:
        The intervals.
    """
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


@dataclasses.dataclass(frozen=True, order=True)
class _Unit:
    """Rows ``[start, end)`` whose row ``q`` attends to ``alpha + beta * q`` keys."""

    start: int
    end: int
    alpha: int
    beta: int

    @property
    def work(self) -> int:
        return self.work_to(self.end)

    def work_to(self, stop: int) -> int:
        n = stop - self.start
        return self.alpha * n + self.beta * (self.start + stop - 1) * n // 2

    def halves(self) -> tuple[_Unit, _Unit]:
        """The unit cut where the two sides' work is closest (each side non-empty)."""
        total, lo, hi = self.work, self.start + 1, self.end - 1
        while lo < hi:  # the first cut whose left side holds at least half
            mid = (lo + hi) // 2
            if 2 * self.work_to(mid) >= total:
                hi = mid
            else:
                lo = mid + 1
        cut = lo
        if cut > self.start + 1 and abs(total - 2 * self.work_to(cut - 1)) <= abs(2 * self.work_to(cut) - total):
            cut -= 1
        return dataclasses.replace(self, end=cut), dataclasses.replace(self, start=cut)


def _units(mask: RangeMask) -> list[_Unit]:
    """The mask's chunks, each with its rows' work as ``alpha + beta * q`` (every piece spans whole units)."""
    cuts = mask.boundaries()
    alpha, beta = [0] * (len(cuts) - 1), [0] * (len(cuts) - 1)
    index = {c: i for i, c in enumerate(cuts)}
    for p in mask.pieces:
        for u in range(index[p.q_start], index[p.q_end]):
            if p.kind == "full":
                alpha[u] += p.k_end - p.k_start
            else:  # row q sees q - q_start + 1 keys
                alpha[u] += 1 - p.q_start
                beta[u] += 1
    return [_Unit(a, b, alpha[i], beta[i]) for i, (a, b) in enumerate(itertools.pairwise(cuts))]


def _lpt(units: Sequence[_Unit], parts: int) -> tuple[list[list[_Unit]], list[int]]:
    bins: list[list[_Unit]] = [[] for _ in range(parts)]
    loads = [0] * parts
    heap = [(0, 0, r) for r in range(parts)]  # (work, tokens, rank)
    for unit in sorted(units, key=lambda u: (-u.work, u.start)):
        work, tokens, rank = heapq.heappop(heap)
        bins[rank].append(unit)
        loads[rank] = work + unit.work
        heapq.heappush(heap, (loads[rank], tokens + unit.end - unit.start, rank))
    return bins, loads


def balance_by_work(mask: RangeMask, parts: int, target: float = TARGET) -> list[list[Interval]]:
    """Each rank's intervals under ``mask`` by the module's rule: whole chunks by LPT, cut where needed.

    Args:
        mask: the mask.
        parts: the cp size.
        target: stop once the imbalance is at most this (>= 1).

    Returns:
        Per rank, its intervals of global positions in increasing order (ranks may hold none when there are
        fewer tokens than ranks).

    Raises:
        TypeError: ``mask`` is not a RangeMask.
        ValueError: ``parts`` < 1 or ``target`` < 1.
    """
    if not isinstance(mask, RangeMask):
        raise TypeError(f"mask must be a wf_mesh.RangeMask, got {type(mask).__name__}")
    parts = as_int("parts", parts, minimum=1)
    if not target >= 1.0:
        raise ValueError(f"target={target!r} must be >= 1")
    contiguous = contiguous_segments(mask.seq_len, parts)
    if imbalance(rank_work(mask, contiguous)) <= target:
        return contiguous
    units = _units(mask)
    limit = len(units) + 64 * parts  # cuts are few in practice; this bounds pathological masks
    best: tuple[float, list[list[_Unit]]] | None = None
    while True:
        bins, loads = _lpt(units, parts)
        score = imbalance(loads)
        if best is None or score < best[0]:
            best = (score, bins)
        if score <= target or len(units) >= limit:
            break
        heaviest = max(units, key=lambda u: (u.work, u.end - u.start, -u.start))
        if heaviest.end - heaviest.start < 2:
            break
        units = sorted([u for u in units if u is not heaviest] + list(heaviest.halves()))
    return [coalesce([(u.start, u.end) for u in b]) for b in best[1]]
