"""Rank-aware logging on loguru.

Every record is bound with ``rank`` (global rank, or None without torch.distributed) and ``coords``
(``{"tp": .., "cp": .., "pp": .., "dp": ..}`` once a mesh exists), and its message is prefixed with a short tag
such as ``[rank 5 tp1 cp0 pp1 dp0]`` so plain terminal sinks show it too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist
from loguru import logger

if TYPE_CHECKING:
    from loguru import Logger, Record

from wf_mesh.mesh import parallel_mesh_or_none

__all__ = ["logger", "print_per_rank", "print_rank_0", "rank_logger", "rank_tag"]


def rank_tag() -> str:
    """``"[rank 5 tp1 cp0 pp1 dp0]"`` with a mesh, ``"[rank 5]"`` without one, ``""`` without distributed."""
    if not dist.is_initialized():
        return ""
    mesh = parallel_mesh_or_none()
    coords = "".join(f" {axis}{index}" for axis, index in mesh.coords().items()) if mesh else ""
    return f"[rank {dist.get_rank()}{coords}]"


def rank_logger() -> Logger:
    """The logger for this process, now: loguru's, records bound with ``rank`` and ``coords``, messages prefixed
    with :func:`rank_tag` (after loguru formatted them, so braces in the tag never meet ``str.format``).

    Returns:
        The bound (and patched, where there is a tag) loguru logger.
    """
    mesh = parallel_mesh_or_none()
    bound = logger.bind(rank=dist.get_rank() if dist.is_initialized() else None, coords=mesh.coords() if mesh else None)
    tag = rank_tag()
    if not tag:
        return bound

    def prefix(record: Record) -> None:
        record["message"] = f"{tag} {record['message']}"

    return bound.patch(prefix)


def _log(message: object) -> None:
    # depth=2: attribute the record to the caller of print_rank_0 / print_per_rank; "{}": message is not a format
    rank_logger().opt(depth=2).info("{}", message)


def print_rank_0(message: object) -> None:
    """Log ``message`` once: on global rank 0 when distributed is on, always otherwise."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        _log(message)


def print_per_rank(message: object) -> None:
    """Log ``message`` on every rank, tagged with the rank and its tp/cp/pp/dp coordinates."""
    _log(message)
