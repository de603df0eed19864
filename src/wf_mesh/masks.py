"""Attention masks as lists of (query range, key range, kind) pairs: block-causal frame chunks, packed clips,
chunk windows, without an ``S x S`` matrix.

A :class:`RangeMask` is the union of its ranges ``(q_start, q_end, k_start, k_end, kind)``: with ``kind``
``"full"`` every query of ``[q_start, q_end)`` sees every key of ``[k_start, k_end)``; with ``"causal"`` the
pair is aligned at its start: query ``q_start + i`` sees keys ``k_start .. k_start + i`` (within the key
range). Positions are global sequence positions. Boolean masks mean True = attend (SDPA's convention)::

    >>> m = RangeMask.block_causal([2, 2])      # chunk 1 sees chunks 0 and 1
    >>> m.ranges
    (Range(q_start=0, q_end=2, k_start=0, k_end=2, kind='full'), Range(q_start=2, q_end=4, k_start=0, k_end=4, kind='full'))
    >>> m.count((0, 4), (0, 4)), m.block(0, 2, 2, 4), m.block(2, 4, 0, 2)
    (12, 'none', 'full')

Everything but :meth:`RangeMask.dense` is integer arithmetic on the ranges (no torch): the mask is kept as
*pieces*, disjoint ranges each either full or an aligned causal square (``k_end - k_start == q_end - q_start``),
the form a blockwise kernel computes without a position mask (a full pair, or SDPA's causal mode). Pair counts
(:meth:`RangeMask.count`), block classes (:meth:`RangeMask.block`) and a block's pieces
(:meth:`RangeMask.block_pieces`) are sums and clips over them.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple

from wf_mesh.topology import as_int

if TYPE_CHECKING:
    import torch

__all__ = ["KINDS", "Range", "RangeMask", "frame_chunk_sizes"]

KINDS = ("full", "causal")
"""The kinds of a range."""

Kind = Literal["full", "causal"]
Interval = tuple[int, int]
BlockClass = Literal["none", "full", "partial"]


class Range(NamedTuple):
    """Queries ``[q_start, q_end)`` and keys ``[k_start, k_end)``, every pair (``"full"``) or aligned causal."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    kind: str


def _triangle(n: int) -> int:
    return n * (n + 1) // 2 if n > 0 else 0


def _causal_count(n: int, i0: int, i1: int, j0: int, j1: int) -> int:
    """Pairs ``j <= i`` of an ``n x n`` causal square with rows ``[i0, i1)`` and columns ``[j0, j1)``."""
    i0, i1, j0, j1 = max(i0, 0), min(i1, n), max(j0, 0), min(j1, n)
    if i0 >= i1 or j0 >= j1:
        return 0
    a, b = max(i0, j0), min(i1, j1)  # rows that see columns j0 .. i: 1, 2, ... keys
    rising = _triangle(b - j0) - _triangle(a - j0) if a < b else 0
    return rising + max(0, i1 - max(i0, j1)) * (j1 - j0)  # rows past the block's columns see all of them


def _clip(piece: Range, q0: int, q1: int, k0: int, k1: int) -> list[Range]:
    """``piece`` within queries ``[q0, q1)`` x keys ``[k0, k1)``, as full ranges and aligned causal squares."""
    if piece.kind == "full":
        qa, qb, ka, kb = max(piece.q_start, q0), min(piece.q_end, q1), max(piece.k_start, k0), min(piece.k_end, k1)
        return [Range(qa, qb, ka, kb, "full")] if qa < qb and ka < kb else []
    n, qs, ks = piece.q_end - piece.q_start, piece.q_start, piece.k_start
    i0, i1, j0, j1 = max(q0 - qs, 0), min(q1 - qs, n), max(k0 - ks, 0), min(k1 - ks, n)
    if i0 >= i1 or j0 >= j1:
        return []
    out = []
    r0, r1 = max(i0, j0), min(i1, j1)
    if r0 < r1:  # rows r0 .. r1-1 see columns j0 .. row: a full part left of the diagonal, and the diagonal
        if r0 > j0:
            out.append(Range(qs + r0, qs + r1, ks + j0, ks + r0, "full"))
        out.append(Range(qs + r0, qs + r1, ks + r0, ks + r1, "causal"))
    if max(i0, j1) < i1:  # rows below the block's last column see all its columns
        out.append(Range(qs + max(i0, j1), qs + i1, ks + j0, ks + j1, "full"))
    return out


def _intervals(value: Interval | Sequence[Interval], what: str) -> list[Interval]:
    """A position set given as one ``(start, end)`` or a list of them: sorted, overlaps merged."""
    items: Sequence[object]
    if isinstance(value, tuple) and len(value) == 2 and not isinstance(value[0], (tuple, list)):
        items = [value]
    elif isinstance(value, (tuple, list)):
        items = value
    else:
        raise TypeError(f"{what} must be (start, end) or a list of them, got {type(value).__name__} {value!r}")
    spans = []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(f"{what}: each interval must be (start, end), got {item!r}")
        start, end = as_int(f"{what} start", item[0], minimum=0), as_int(f"{what} end", item[1], minimum=0)
        if end < start:
            raise ValueError(f"{what}: interval ({start}, {end}) ends before it starts")
        if start < end:
            spans.append((start, end))
    merged: list[Interval] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _sizes(chunk_sizes: Iterable[object], what: str) -> list[int]:
    if isinstance(chunk_sizes, (str, bytes)) or not isinstance(chunk_sizes, Iterable):
        raise TypeError(f"{what} must be a list of ints, got {type(chunk_sizes).__name__} {chunk_sizes!r}")
    sizes = [as_int(f"{what}[{i}]", s, minimum=1) for i, s in enumerate(chunk_sizes)]
    if not sizes:
        raise ValueError(f"{what} is empty: give at least one chunk")
    return sizes


def _starts(sizes: Sequence[int]) -> list[int]:
    out, total = [], 0
    for size in sizes:
        out.append(total)
        total += size
    return out


def frame_chunk_sizes(frames: int, chunk_frames: int, tokens_per_frame: int) -> list[int]:
    """Token counts of frame chunks in frames-first token order ``(t h w)``.

    Args:
        frames: latent frames (T).
        chunk_frames: frames per chunk; the last chunk takes what is left.
        tokens_per_frame: tokens of one frame (``H * W`` patches).

    Returns:
        The chunk sizes, for :meth:`RangeMask.block_causal` or :meth:`RangeMask.chunk_window`.

    >>> frame_chunk_sizes(5, 2, 4)
    [8, 8, 4]
    """
    frames = as_int("frames", frames, minimum=1)
    chunk_frames = as_int("chunk_frames", chunk_frames, minimum=1)
    tokens_per_frame = as_int("tokens_per_frame", tokens_per_frame, minimum=1)
    return [min(chunk_frames, frames - f) * tokens_per_frame for f in range(0, frames, chunk_frames)]


class RangeMask:
    """An attention mask as the union of ranges ``(q_start, q_end, k_start, k_end, kind)`` (module docstring).

    Args:
        ranges: the ranges; ``kind`` is ``"full"`` or ``"causal"``. Ranges may overlap (their union counts).
        seq_len: the sequence length (default: the largest end of any range); queries outside every range
            see no key.

    Raises:
        TypeError: ranges that are not 5-tuples of ints and a kind, or a non-int ``seq_len``.
        ValueError: an empty or reversed range, an unknown kind, a range past ``seq_len``, no ranges and no
            ``seq_len``.
    """

    def __init__(self, ranges: Iterable[Sequence[object]], seq_len: int | None = None) -> None:
        if isinstance(ranges, (str, bytes)) or not isinstance(ranges, Iterable):
            raise TypeError(f"ranges must be a list of (q_start, q_end, k_start, k_end, kind), got {ranges!r}")
        checked = [self._check_range(i, r) for i, r in enumerate(ranges)]
        longest = max((max(r.q_end, r.k_end) for r in checked), default=0)
        if seq_len is None:
            if not checked:
                raise ValueError("RangeMask: no ranges and no seq_len; give seq_len for a mask where nothing attends")
            length = longest
        else:
            length = as_int("seq_len", seq_len, minimum=1)
            for i, r in enumerate(checked):
                if max(r.q_end, r.k_end) > length:
                    raise ValueError(f"RangeMask: range {i} {tuple(r)} ends past seq_len={length}")
        self._ranges = tuple(checked)
        self._seq_len = length
        self._pieces = _canonical(self._ranges)
        self._digest: int | None = None

    @staticmethod
    def _check_range(index: int, value: object) -> Range:
        if not isinstance(value, (tuple, list)) or len(value) != 5:
            raise TypeError(f"RangeMask: range {index} must be (q_start, q_end, k_start, k_end, kind), got {value!r}")
        *bounds, kind = value
        names = ("q_start", "q_end", "k_start", "k_end")
        qs, qe, ks, ke = (as_int(f"range {index} {n}", b, minimum=0) for n, b in zip(names, bounds))
        if kind not in KINDS:
            raise ValueError(f"RangeMask: range {index} {tuple(value)} has kind {kind!r}; use one of {list(KINDS)}")
        if qe <= qs or ke <= ks:
            raise ValueError(
                f"RangeMask: range {index} {tuple(value)} is empty or reversed: it needs q_start < q_end and "
                "k_start < k_end"
            )
        return Range(qs, qe, ks, ke, str(kind))

    # ---- constructors ------------------------------------------------------------------------------------
    @classmethod
    def block_causal(cls, chunk_sizes: Sequence[int]) -> RangeMask:
        """Chunk ``c`` (``chunk_sizes[c]`` consecutive tokens) sees every token of chunks ``<= c``.

        Returns:
            The mask.
        """
        return cls.chunk_window(chunk_sizes, window=None)

    @classmethod
    def chunk_window(cls, chunk_sizes: Sequence[int], window: int | None) -> RangeMask:
        """Chunk ``c`` sees every token of chunks ``c - window .. c`` (``window=None``: all chunks ``<= c``).

        Returns:
            The mask.
        """
        sizes = _sizes(chunk_sizes, "chunk_sizes")
        reach = len(sizes) if window is None else as_int("window", window, minimum=0)
        starts = _starts(sizes)
        ends = [s + n for s, n in zip(starts, sizes)]
        return cls([(starts[c], ends[c], starts[max(0, c - reach)], ends[c], "full") for c in range(len(sizes))])

    @classmethod
    def packed(
        cls, lengths: Sequence[int], causal: bool | Literal["block"] = False, chunk_size: int | None = None
    ) -> RangeMask:
        """Clips of ``lengths`` tokens packed into one sequence: a token sees only tokens of its own clip.

        Args:
            lengths: each clip's token count, in sequence order.
            causal: False (every token of the clip), True (token-causal inside the clip) or ``"block"``
                (block-causal inside the clip: chunks of ``chunk_size`` tokens, the clip's last chunk taking
                what is left).
            chunk_size: the chunk length of ``causal="block"`` (e.g. frames per chunk x tokens per frame).

        Returns:
            The mask.

        Raises:
            ValueError: ``causal="block"`` without ``chunk_size``, or ``chunk_size`` with another ``causal``.
        """
        sizes = _sizes(lengths, "lengths")
        if causal not in (False, True, "block"):
            raise ValueError(f"packed: causal={causal!r}: use False, True or 'block'")
        if (causal == "block") != (chunk_size is not None):
            raise ValueError(f"packed: chunk_size={chunk_size!r} goes with causal='block' (got causal={causal!r})")
        ranges: list[tuple[int, int, int, int, str]] = []
        for start, size in zip(_starts(sizes), sizes):
            if causal == "block":
                step = as_int("chunk_size", chunk_size, minimum=1)
                for a in range(start, start + size, step):
                    ranges.append((a, min(a + step, start + size), start, min(a + step, start + size), "full"))
            else:
                ranges.append((start, start + size, start, start + size, "causal" if causal else "full"))
        return cls(ranges)

    # ---- what it is --------------------------------------------------------------------------------------
    @property
    def ranges(self) -> tuple[Range, ...]:
        """The ranges as given (validated)."""
        return self._ranges

    @property
    def seq_len(self) -> int:
        """The sequence length."""
        return self._seq_len

    @property
    def pieces(self) -> tuple[Range, ...]:
        """The mask as disjoint ranges, each full or an aligned causal square, sorted by (q_start, k_start)."""
        return self._pieces

    def boundaries(self) -> tuple[int, ...]:
        """Query positions where the rows' pattern may change (0, the pieces' query bounds, ``seq_len``): the
        mask's chunks are the intervals between consecutive ones.

        Returns:
            Sorted positions, from 0 to ``seq_len``.
        """
        cuts = {0, self._seq_len}
        for p in self._pieces:
            cuts.update((p.q_start, p.q_end))
        return tuple(sorted(cuts))

    def digest(self) -> int:
        """A 63-bit digest of ``seq_len`` and the pieces (what ranks compare to agree on a mask).

        Returns:
            The digest, equal for equal masks in every process.
        """
        if self._digest is None:
            text = repr((self._seq_len, [tuple(p) for p in self._pieces])).encode()
            self._digest = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 1
        return self._digest

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RangeMask):
            return NotImplemented
        return self._seq_len == other._seq_len and self._pieces == other._pieces

    def __hash__(self) -> int:
        return self.digest()

    def __repr__(self) -> str:
        shown = ", ".join(repr(tuple(r)) for r in self._ranges[:4])
        more = f", ... ({len(self._ranges)} ranges)" if len(self._ranges) > 4 else ""
        return f"RangeMask([{shown}{more}], seq_len={self._seq_len})"

    # ---- questions -----------------------------------------------------------------------------------------
    def count(self, queries: Interval | Sequence[Interval], keys: Interval | Sequence[Interval]) -> int:
        """Unmasked (query, key) pairs between two position sets, without building the dense matrix.

        Args:
            queries: query positions as ``(start, end)`` or a list of them (overlaps count once).
            keys: key positions, the same way.

        Returns:
            The number of pairs the mask lets attend.
        """
        qs, ks = _intervals(queries, "queries"), _intervals(keys, "keys")
        total = 0
        for p in self._pieces:
            for q0, q1 in qs:
                if q1 <= p.q_start or q0 >= p.q_end:
                    continue
                for k0, k1 in ks:
                    if p.kind == "full":
                        rows = min(q1, p.q_end) - max(q0, p.q_start)
                        total += rows * max(0, min(k1, p.k_end) - max(k0, p.k_start))
                    else:
                        n = p.q_end - p.q_start
                        total += _causal_count(n, q0 - p.q_start, q1 - p.q_start, k0 - p.k_start, k1 - p.k_start)
        return total

    def row_work(self, start: int, end: int) -> int:
        """Unmasked pairs of the queries ``[start, end)`` with every key (a shard's attention work).

        Returns:
            The pair count.
        """
        return self.count((start, end), (0, self._seq_len))

    def block(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> BlockClass:
        """Whether queries ``[q_lo, q_hi)`` x keys ``[k_lo, k_hi)`` are all masked, all visible, or mixed.

        Returns:
            ``"none"`` (no pair attends: skip the block), ``"full"`` (every pair does) or ``"partial"``.
        """
        seen = self.count((q_lo, q_hi), (k_lo, k_hi))
        if seen == 0:
            return "none"
        return "full" if seen == (q_hi - q_lo) * (k_hi - k_lo) else "partial"

    def block_pieces(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> list[Range]:
        """The block's visible pairs as disjoint full ranges and aligned causal squares (global positions).

        Returns:
            The pieces, in (q_start, k_start) order: each one is a kernel call with no position mask.
        """
        out = [c for p in self._pieces for c in _clip(p, q_lo, q_hi, k_lo, k_hi)]
        return sorted(out)

    def dense(self) -> torch.Tensor:
        """The bool ``(S, S)`` matrix, True = attend (SDPA's ``attn_mask`` convention): for tests and small
        cases only (nothing on the hot path builds it).

        Returns:
            A CPU bool tensor.
        """
        import torch

        out = torch.zeros(self._seq_len, self._seq_len, dtype=torch.bool)
        for p in self._pieces:
            if p.kind == "full":
                out[p.q_start : p.q_end, p.k_start : p.k_end] = True
            else:
                n = p.q_end - p.q_start
                out[p.q_start : p.q_end, p.k_start : p.k_end] |= torch.ones(n, n, dtype=torch.bool).tril()
        return out


# ---- the canonical pieces --------------------------------------------------------------------------------
def _canonical(ranges: Sequence[Range]) -> tuple[Range, ...]:
    """The union of ``ranges`` as disjoint full ranges and aligned causal squares.

    Rows are swept in intervals where every active range's visible keys are ``[a, b)`` with ``b`` fixed
    (full, or causal past the end of its keys) or ``b = q + c`` (causal, growing one key per row). Within
    each interval the order of all these ends and starts is cut to stay fixed (at ``q = a - c + 1`` and
    ``q = b - c + 1``), so the union's structure read at its first row holds for all its rows; a growing
    interval ``[x, q + c)`` is a full part ``[x, d)`` and an aligned causal square from ``d = q0 + c - 1``.
    Full pieces that continue row-wise are merged.

    Returns:
        The pieces, sorted by (q_start, k_start).
    """
    cuts: set[int] = set()
    for r in ranges:
        cuts.update((r.q_start, r.q_end))
        if r.kind == "causal" and r.q_start + (r.k_end - r.k_start) < r.q_end:
            cuts.add(r.q_start + (r.k_end - r.k_start))  # from here on the causal range sees all its keys
    bounds = sorted(cuts)
    order = sorted(ranges, key=lambda r: r.q_start)
    pieces: list[Range] = []
    open_full: dict[tuple[int, int], int] = {}  # (k_start, k_end) -> index of a piece ending at this row
    active: list[Range] = []
    nxt = 0
    for e0, e1 in itertools.pairwise(bounds):
        while nxt < len(order) and order[nxt].q_start <= e0:
            active.append(order[nxt])
            nxt += 1
        active = [r for r in active if r.q_end > e0]
        if not active:
            continue
        # (a, fixed end or None, c): keys [a, end) or [a, q + c)
        spans: list[tuple[int, int | None, int]] = []
        for r in active:
            if r.kind == "causal" and e0 < r.q_start + (r.k_end - r.k_start):
                spans.append((r.k_start, None, r.k_start - r.q_start + 1))
            else:
                spans.append((r.k_start, r.k_end, 0))
        events = {e0, e1}
        for _, end, c in spans:
            if end is None:
                for a2, b2, _ in spans:
                    events.add(a2 - c + 1)
                    if b2 is not None:
                        events.add(b2 - c + 1)
        subs = sorted(x for x in events if e0 <= x <= e1)
        for s, t in itertools.pairwise(subs):
            for piece in _row_pieces(spans, s, t):
                _add(pieces, open_full, piece, s)
    return tuple(sorted(pieces))


def _row_pieces(spans: list[tuple[int, int | None, int]], s: int, t: int) -> list[Range]:
    """The union of ``spans`` on rows ``[s, t)`` (structure fixed there) as pieces."""

    def end_at(end: int | None, c: int) -> int:
        return s + c if end is None else end

    merged: list[tuple[int, int | None, int]] = []  # (x, fixed end or None, c)
    for a, end, c in sorted(spans, key=lambda sp: (sp[0], end_at(sp[1], sp[2]))):
        if merged:
            x, last_end, last_c = merged[-1]
            there = end_at(last_end, last_c)
            if a < there:
                here = end_at(end, c)
                if here > there or (here == there and end is not None):
                    merged[-1] = (x, end, c)
                continue
        merged.append((a, end, c))
    out = []
    for x, end, c in merged:
        if end is not None:
            out.append(Range(s, t, x, end, "full"))
            continue
        d = s + c - 1  # the newest key row s sees
        if d > x:
            out.append(Range(s, t, x, d, "full"))
        out.append(Range(s, t, d, d + (t - s), "causal"))
    return out


def _add(pieces: list[Range], open_full: dict[tuple[int, int], int], p: Range, row: int) -> None:
    """Append ``p`` (starting at ``row``), merged into the full piece above it when it continues it.

    Causal squares are never merged: two squares on one diagonal are not one square (the larger one's
    triangle also holds the rectangle below the first).
    """
    index = open_full.get((p.k_start, p.k_end)) if p.kind == "full" else None
    if index is not None and pieces[index].q_end == row:
        above = pieces[index]
        pieces[index] = Range(above.q_start, p.q_end, above.k_start, above.k_end, "full")
        return
    if p.kind == "full":
        open_full[(p.k_start, p.k_end)] = len(pieces)
    pieces.append(p)
