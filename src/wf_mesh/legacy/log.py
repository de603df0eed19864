"""The rank-aware ``log`` object of ``worldfoundry.core.distributed.logging``, on wf_mesh's loguru records.

``log.info("step {}", 3, rank0_only=True)`` formats like loguru and, with ``rank0_only=True``, logs on global
rank 0 only (always without torch.distributed). Every record carries the rank like
:func:`~wf_mesh.log.print_rank_0`'s: ``extra["rank"]``, ``extra["coords"]`` and the ``[rank r tp.. cp..]`` tag
in front of the message, and is attributed to the caller.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from loguru import logger

from wf_mesh.log import rank_logger

__all__ = ["RankAwareLog", "log"]


class RankAwareLog:
    """loguru's level methods plus ``rank0_only`` (see the module docstring); ``logger`` is loguru's logger."""

    logger = logger

    def _write(self, level: str, message: object, args: tuple, kwargs: dict, rank0_only: bool) -> None:
        if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
            return
        # depth=2: the record names the caller of log.info (not _write / info); loguru's "{}" formatting of
        # args applies to the message alone (the rank tag is added after it).
        getattr(rank_logger().opt(depth=2), level)(message, *args, **kwargs)

    def debug(self, message: object, *args: Any, rank0_only: bool = False, **kwargs: Any) -> None:
        """Log at DEBUG (``rank0_only``: on global rank 0 only)."""
        self._write("debug", message, args, kwargs, rank0_only)

    def info(self, message: object, *args: Any, rank0_only: bool = False, **kwargs: Any) -> None:
        """Log at INFO (``rank0_only``: on global rank 0 only)."""
        self._write("info", message, args, kwargs, rank0_only)

    def success(self, message: object, *args: Any, rank0_only: bool = False, **kwargs: Any) -> None:
        """Log at SUCCESS (``rank0_only``: on global rank 0 only)."""
        self._write("success", message, args, kwargs, rank0_only)

    def warning(self, message: object, *args: Any, rank0_only: bool = False, **kwargs: Any) -> None:
        """Log at WARNING (``rank0_only``: on global rank 0 only)."""
        self._write("warning", message, args, kwargs, rank0_only)

    warn = warning

    def error(self, message: object, *args: Any, rank0_only: bool = False, **kwargs: Any) -> None:
        """Log at ERROR (``rank0_only``: on global rank 0 only)."""
        self._write("error", message, args, kwargs, rank0_only)

    def critical(self, message: object, *args: Any, rank0_only: bool = False, **kwargs: Any) -> None:
        """Log at CRITICAL (``rank0_only``: on global rank 0 only)."""
        self._write("critical", message, args, kwargs, rank0_only)


log = RankAwareLog()
