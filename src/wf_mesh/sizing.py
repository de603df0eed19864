"""How a length is cut into shards: ``torch.chunk`` sizing, the rule wf_mesh (and DTensor) uses for tensors,
and ``torch.tensor_split`` sizing, used for Python lists (the legacy object-list split).

The first shards get ``ceil(length / parts)`` elements; trailing shards may get fewer, or none. Pure
arithmetic (no torch import), shared by the CP helpers, CP attention and the placement views.

    >>> chunk_sizes(7, 4), chunk_sizes(3, 4)
    ([2, 2, 2, 1], [1, 1, 1, 0])
    >>> chunk_range(7, 4, 3)
    (6, 7)
"""

from __future__ import annotations

__all__ = ["chunk_range", "chunk_sizes", "split_range"]


def chunk_sizes(length: int, parts: int) -> list[int]:
    """Per-shard lengths of ``torch.chunk(range(length), parts)``, padded with zeros to ``parts`` entries."""
    chunk = -(-length // parts) if length else 0
    return [max(0, min(chunk, length - i * chunk)) for i in range(parts)]


def chunk_range(length: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of shard ``index`` in :func:`chunk_sizes` sizing."""
    chunk = -(-length // parts) if length else 0
    start = min(index * chunk, length)
    return start, min(start + chunk, length)


def split_range(length: int, parts: int, index: int) -> tuple[int, int]:
    """Where block ``index`` lies in ``torch.tensor_split`` sizing: blocks whose sizes differ by at most one,
    the larger ones first (the first ``length % parts`` blocks get one more item).

    Returns:
        ``(start, stop)`` of the block.

    >>> [split_range(7, 3, i) for i in range(3)]
    [(0, 3), (3, 5), (5, 7)]
    """
    base, extra = divmod(length, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)
