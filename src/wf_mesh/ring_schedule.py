"""The ring's schedule under a :class:`~wf_mesh.RangeMask`: which K/V blocks each ring rank needs, how far each
block travels, what that skips, and a block's mask pieces as few kernel calls. Pure arithmetic on the mask's
ranges (no torch), the same on every rank: no message decides it.

Block j starts at ring rank j and is at rank ``j + t`` at step t. It travels ``L_j`` hops, the last step at which
a rank needs it (:func:`ring_last_steps`); in backward its dK/dV follow the same ranks and go from rank
``j + L_j`` straight back to the owner (none when only the owner needs it). :class:`RingSkips` counts the blocks
not computed, the K/V hops not sent and the dK/dV messages not sent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from wf_mesh.masks import RangeMask

__all__ = ["Interval", "Piece", "RingSkips", "merge_full_pieces", "ring_last_steps", "ring_needs"]

Interval = tuple[int, int]
Piece = tuple[int, int, int, int, bool]
"""``(row start, row end, column start, column end, causal)`` of a local block: one kernel call."""


def merge_full_pieces(pieces: Sequence[Piece]) -> list[Piece]:
    """Join full pieces whose union is a rectangle (same columns and touching rows, or same rows and touching
    columns) until none is left to join: fewer, larger kernel calls. Causal pieces are kept as they are.

    Returns:
        The pieces, sorted (disjoint if the input pieces are).
    """
    full = [p for p in pieces if not p[4]]
    changed = True
    while changed and len(full) > 1:
        changed = False
        for key in (lambda p: (p[2], p[3], p[0]), lambda p: (p[0], p[1], p[2])):
            out: list[Piece] = []
            for p in sorted(full, key=key):
                last = out[-1] if out else None
                if last is not None and (last[2], last[3]) == (p[2], p[3]) and last[1] == p[0]:
                    out[-1] = (last[0], p[1], p[2], p[3], False)
                elif last is not None and (last[0], last[1]) == (p[0], p[1]) and last[3] == p[2]:
                    out[-1] = (p[0], p[1], last[2], p[3], False)
                else:
                    out.append(p)
                    continue
                changed = True
            full = out
    return sorted(full + [p for p in pieces if p[4]])


def ring_needs(mask: RangeMask, blocks: Sequence[Sequence[Interval]]) -> list[list[bool]]:
    """``needs[i][j]``: whether ring rank i's queries (the positions of its block ``blocks[i]``) see any key of
    block j under ``mask`` (pure arithmetic, the same on every rank).

    Returns:
        The ``R x R`` matrix.
    """
    return [[bool(q and kv) and mask.count(list(q), list(kv)) > 0 for kv in blocks] for q in blocks]


def ring_last_steps(needs: Sequence[Sequence[bool]]) -> tuple[int, ...]:
    """Per block j, the last ring step at which a rank needs it: block j is at ring rank ``j + t`` at step t, so
    it travels ``last_steps[j]`` hops (0: only its owner attends to it, it does not travel).

    Returns:
        The last step of every block.
    """
    n = len(needs)
    return tuple(max((t for t in range(n) if needs[(j + t) % n][j]), default=0) for j in range(n))


@dataclasses.dataclass(frozen=True)
class RingSkips:
    """What a ring over a mask skips, summed over all ring ranks (``*_skipped`` of ``*`` in all)."""

    blocks: int
    """(query rank, K/V block) pairs: ``R * R``."""
    blocks_skipped: int
    """Pairs with no unmasked (query, key) pair: not computed, forward or backward."""
    kv_hops: int
    """K/V block hops of a full ring: ``R * (R - 1)``."""
    kv_hops_skipped: int
    """Hops not sent: past the last ring rank that needs the block."""
    dkv_messages: int
    """dK/dV messages of a full ring's backward: ``R * R`` (each block's back to its owner included)."""
    dkv_messages_skipped: int
    """dK/dV messages not sent: a block's go from the last rank that needs it straight to its owner."""

    @classmethod
    def of(cls, needs: Sequence[Sequence[bool]]) -> RingSkips:
        """The counts of a ring with ``needs`` (:func:`ring_needs`).

        Returns:
            The counts.
        """
        n = len(needs)
        last = ring_last_steps(needs)
        sent = sum(x + 1 for x in last if x)
        skipped = sum(not x for row in needs for x in row)
        return cls(n * n, skipped, n * (n - 1), n * (n - 1) - sum(last), n * n, n * n - sent)
