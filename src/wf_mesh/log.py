"""Rank-aware logging on loguru.

Every record is bound with ``rank`` (global rank, or None without torch.distributed) and ``coords``
(``{"tp": .., "cp": .., "pp": .., "dp": ..}`` once a mesh exists), and its message is prefixed with a short tag
such as ``[rank 5 tp1 cp0 pp1 dp0]`` so plain terminal sinks show it too.
"""

from __future__ import annotations

import torch.distributed as dist
from loguru import logger

from wf_mesh.mesh import parallel_mesh_or_none

__all__ = ["logger", "print_per_rank", "print_rank_0", "rank_tag"]


def rank_tag() -> str:
    """``"[rank 5 tp1 cp0 pp1 dp0]"`` with a mesh, ``"[rank 5]"`` without one, ``""`` without distributed."""
    if not dist.is_initialized():
        return ""
    mesh = parallel_mesh_or_none()
    coords = "".join(f" {axis}{index}" for axis, index in mesh.coords().items()) if mesh else ""
    return f"[rank {dist.get_rank()}{coords}]"


def _log(message: object) -> None:
    mesh = parallel_mesh_or_none()
    rank = dist.get_rank() if dist.is_initialized() else None
    tag = rank_tag()
    # depth=2: attribute the record to the caller of print_rank_0 / print_per_rank.
    logger.bind(rank=rank, coords=mesh.coords() if mesh else None).opt(depth=2).info(
        "{}{}", f"{tag} " if tag else "", message
    )


def print_rank_0(message: object) -> None:
    """Log ``message`` once: on global rank 0 when distributed is on, always otherwise."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        _log(message)


def print_per_rank(message: object) -> None:
    """Log ``message`` on every rank, tagged with the rank and its tp/cp/pp/dp coordinates."""
    _log(message)
