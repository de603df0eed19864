"""The legacy pipeline scheduler of ``worldfoundry.core.distributed``: ``PPScheduler`` and its process-wide
instance (``init_pp_scheduler`` / ``pp_scheduler``), on the native :class:`~wf_mesh.pipeline.PipelineP2P`.

It keeps the original protocol: one message per transfer, nothing verified (a mismatched receive is
undefined behaviour; see :mod:`wf_mesh.pipeline`). Set ``WF_MESH_PP_CHECKED=1`` in every rank's environment to
turn on checked mode for it too (a header before every payload, a ValueError on a mismatch); ``checked=``
overrides it per scheduler. All stages must use the same mode (the constructor checks it).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence

import torch

from wf_mesh.legacy.errors import PipelineStateError, asserting
from wf_mesh.legacy.model_parallel import current_mesh
from wf_mesh.mesh import ParallelMesh, register_extension
from wf_mesh.pipeline import P2PWork, PendingRecv, PipelineP2P

__all__ = ["PPScheduler", "init_pp_scheduler", "pp_scheduler", "pp_scheduler_or_none"]


def _checked_by_default() -> bool:
    return os.environ.get("WF_MESH_PP_CHECKED", "0") == "1"


class PPScheduler(PipelineP2P):
    """Legacy point-to-point scheduler for adjacent pipeline stages (drop-in for the original package).

    ``isend_next`` sends to the next stage (the last stage's reaches stage 0); the receives take from the
    previous stage. ``queue_irecv_prev`` posts receives ahead of time and ``queue_irecv_prev_data`` pops
    them oldest first. The native :class:`PipelineP2P` methods (``send``, ``recv``, ``exchange``, ...) work
    on it too. Unchecked unless ``checked=True`` or ``WF_MESH_PP_CHECKED=1``. Collective over the pp group.
    """

    def __init__(
        self, mesh: ParallelMesh | None = None, *, checked: bool | None = None, max_pending_sends: int = 64
    ) -> None:
        checked = _checked_by_default() if checked is None else checked
        super().__init__(mesh, checked=checked, max_pending_sends=max_pending_sends)
        self._recv_queue: deque[PendingRecv] = deque()

    def isend_next(self, tensor: torch.Tensor) -> P2PWork:
        """Send a contiguous copy of ``tensor`` to the next stage.

        Thanks to the copy the caller may modify ``tensor`` at once; the handle may be dropped.

        Returns:
            The send's work handle.
        """
        return self.send(self._check_tensor(tensor, "isend_next").detach().clone(memory_format=torch.contiguous_format))

    def irecv_prev(self, buffer: torch.Tensor) -> P2PWork:
        """Post a receive from the previous stage into ``buffer``.

        In checked mode this first waits for the header (and raises ValueError on a mismatch).

        Returns:
            The receive's work handle.
        """
        pending = self.irecv_into(buffer)
        pending.check()
        return P2PWork(pending.payload_work(), pending.group, pending.what)

    def recv_prev_data(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Receive a new ``(shape, dtype)`` tensor from the previous stage; blocks until it arrived."""
        return self.recv(shape, dtype)

    def queue_irecv_prev(self, shape: Sequence[int], dtype: torch.dtype) -> None:
        """Post a receive of a ``(shape, dtype)`` tensor from the previous stage and queue it (FIFO)."""
        self._recv_queue.append(self.irecv(shape, dtype))

    def queue_irecv_prev_data(self) -> torch.Tensor:
        """Pop the oldest queued receive, wait for it and return its tensor."""
        if not self._recv_queue:
            raise RuntimeError("queue_irecv_prev_data: no receive is queued; call queue_irecv_prev(shape, dtype) first")
        return self._recv_queue.popleft().wait()


_scheduler: PPScheduler | None = None


def init_pp_scheduler() -> PPScheduler:
    """Create the process-wide :class:`PPScheduler` on the current mesh's pp axis.

    Returns:
        The scheduler.

    Raises:
        PipelineStateError: (an AssertionError) it already exists (destroy_model_parallel() resets it).
        LegacyNotInitializedError: (an AssertionError) model parallel is not initialized.
    """
    global _scheduler
    if _scheduler is not None:
        raise PipelineStateError(
            f"init_pp_scheduler: the PP scheduler is already initialized ({_scheduler!r}); "
            "call wf_mesh.destroy_model_parallel() before initializing again"
        )
    mesh = current_mesh()
    with asserting():
        _scheduler = PPScheduler(mesh)
    return _scheduler


def pp_scheduler() -> PPScheduler:
    """The process-wide :class:`PPScheduler`; PipelineStateError if :func:`init_pp_scheduler` was not called."""
    if _scheduler is None:
        raise PipelineStateError(
            "pp_scheduler: the PP scheduler is not initialized; call wf_mesh.init_pp_scheduler() "
            "(wf_mesh.dist_init does it when pp_size > 1)"
        )
    return _scheduler


def pp_scheduler_or_none() -> PPScheduler | None:
    """The process-wide :class:`PPScheduler`, or None."""
    return _scheduler


def _reset(destroy_process_groups: bool) -> None:
    global _scheduler
    _scheduler = None  # it uses the mesh's pp group: nothing of its own to destroy


register_extension("legacy.pp_scheduler", _reset)
