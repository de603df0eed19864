"""Pipeline point-to-point transfers on the mesh's pp axis, and a bridge to ``torch.distributed.pipelining``.

Which one to use:

- :class:`PipelineP2P` (native) and :class:`PPScheduler` (the legacy names, a subclass; process-wide instance
  via :func:`init_pp_scheduler` / :func:`pp_scheduler`): loops that move tensors between stages themselves.
  Inference and denoising loops (stage 0 pre-posts the receive of the next step's latent, every stage
  forwards its activations, the last stage sends back to stage 0), custom overlap, anything that is not a
  training microbatch schedule. You own the order and the shapes; ``checked=True`` turns a shape or dtype
  disagreement into a ValueError on the receiver instead of corrupt data or a gloo abort.
- :func:`build_pipeline_stage`: training with microbatches. It wraps this rank's stage module in a
  ``torch.distributed.pipelining.PipelineStage`` placed by the mesh (stage index = pp rank, stage count = pp
  size, group = the pp group); drive it with ``ScheduleGPipe``, ``Schedule1F1B`` or another torch schedule,
  which infer shapes, order sends and receives, run backward and scale gradients. Prefer it to hand-rolled
  GPipe/1F1B over the P2P scheduler.

The pp group is a ring: the last stage's ``next`` is stage 0 and stage 0's ``prev`` is the last stage.
Transfers are matched in order: the i-th send from stage a to stage b meets the i-th receive on b from a,
whatever the number in flight. Tensors live on the current CUDA device when the mesh is on CUDA (NCCL),
on CPU otherwise (gloo).

==================================  ============================  =============================================
call                                messages                      blocks until
==================================  ============================  =============================================
``send`` / ``isend_next``           1 (2 when checked)            never (returns the work handle)
``irecv`` / ``queue_irecv_prev``    1 (2 when checked)            never (checked: the previous receive's header)
``recv`` / ``recv_prev_data``       1 (2 when checked)            the data arrived
``exchange``                        1 batch (2 when checked)      everything in it completed
==================================  ============================  =============================================

Checked mode (``checked=True`` on BOTH ends of a link) is for development and debugging: every send is
preceded by a 128-byte header (shape, dtype); the receiver waits for the header, compares it with what it
expects and, on a mismatch, receives the payload into a scratch buffer (so the sender completes and the
link stays in step) and raises ValueError naming both. Unchecked, a payload larger than the receive buffer
aborts a gloo process (SIGABRT) and a smaller one silently leaves stale data in the buffer.

gloo drops a send whose work handle is garbage-collected before the peer receives it; the scheduler keeps
up to ``max_pending_sends`` send handles alive, so callers may drop them as the legacy code does. A send
still in flight when its group is destroyed is lost too: call ``wait_sends()`` before tearing down.
The handles returned (:class:`P2PWork`) may be waited any number of times; gloo's own work, waited a second
time, blocks until the timeout.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from wf_mesh.collectives import DTYPE_CODES, DTYPES
from wf_mesh.mesh import ParallelMesh, get_parallel_mesh, register_destroy_hook

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

__all__ = [
    "P2PWork",
    "PPScheduler",
    "PendingRecv",
    "PipelineP2P",
    "PipelineStateError",
    "build_pipeline_stage",
    "init_pp_scheduler",
    "pp_scheduler",
    "pp_scheduler_or_none",
]

Peer = Literal["next", "prev"]

# Checked-mode header: int64 [magic, dtype code, ndim, *shape (zero padded)]; fixed size on every link.
HEADER_MAGIC = 0x77666D657368  # b"wfmesh"
HEADER_LEN = 16
MAX_CHECKED_NDIM = HEADER_LEN - 3


class PipelineStateError(RuntimeError, AssertionError):
    """Misuse of the process-wide PP scheduler (initialized twice, used before initialization).

    Both a RuntimeError and an AssertionError: the original package raised AssertionError, so
    ``except AssertionError`` in existing callers keeps working.
    """


class P2PWork:
    """Handle of a send or receive: ``wait()`` may be called any number of times, also after the scheduler
    waited on it (a gloo point-to-point work waited twice blocks until the timeout). ``work`` is torch's."""

    __slots__ = ("work",)

    def __init__(self, work: dist.Work) -> None:
        self.work = work

    def wait(self) -> bool:
        _wait_once(self.work)
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


class PendingRecv:
    """A posted receive; ``wait()`` returns ``tensor`` once it is filled.

    In checked mode only the header receive is posted at first; the payload receive is posted when the
    header has arrived and matched (at ``wait()``, or earlier when the next receive from the same stage is
    posted). On a mismatch the payload goes to a scratch buffer and ``wait()`` raises ValueError.
    """

    __slots__ = ("_error", "_group_src", "_header", "_header_work", "_link", "tensor", "work")

    def __init__(
        self,
        tensor: torch.Tensor,
        work: dist.Work | None,
        *,
        link: PipelineP2P | None = None,
        header: torch.Tensor | None = None,
        header_work: dist.Work | None = None,
        group_src: int = -1,
    ) -> None:
        self.tensor = tensor
        self.work = work  # None until a checked receive's header is settled
        self._link, self._header, self._header_work, self._group_src = link, header, header_work, group_src
        self._error: str | None = None

    def wait(self) -> torch.Tensor:
        self._settle()
        _wait_once(self.work)
        if self._error is not None:
            raise ValueError(self._error)
        return self.tensor

    def _settle(self) -> None:
        if self.work is not None:
            return
        link = self._link
        self._header_work.wait()
        if link._unsettled.get(self._group_src) is self:
            del link._unsettled[self._group_src]
        target = self.tensor
        for _, drain, message in link._mismatches([(self._header, self.tensor, self._group_src)]):
            target, self._error = drain, message
        self.work = dist.irecv(target, group=link.group, group_src=self._group_src)


def _wait_once(work: dist.Work) -> None:
    # gloo: waiting a completed point-to-point work again blocks until the timeout
    if not work.is_completed():
        work.wait()


def _pp_device(mesh: ParallelMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _describe(shape: Sequence[int], dtype: torch.dtype) -> str:
    return f"shape {tuple(shape)} dtype {dtype}"


class PipelineP2P:
    """Sends and receives between this rank's pipeline stage and its neighbours on the pp axis (a ring).

    Args:
        mesh: the mesh whose ``pp`` axis to use (default: the current one).
        checked: send a (shape, dtype) header before every payload and verify it on receipt (both ends of
            a link must agree on it; see the module docstring).
        max_pending_sends: send handles kept alive for callers that drop them (gloo loses a send whose
            handle dies before the peer receives it). With more than that many sends not yet waited for,
            a send first waits for the oldest one.

    Attributes: ``stage`` and ``num_stages`` (pp rank and size), ``next_rank`` / ``prev_rank`` (global
    ranks, wrapping), ``group`` (the pp ProcessGroup), ``device``, ``checked``.
    """

    def __init__(self, mesh: ParallelMesh | None = None, *, checked: bool = False, max_pending_sends: int = 64) -> None:
        if max_pending_sends < 1:
            raise ValueError(f"max_pending_sends={max_pending_sends} must be >= 1")
        self.mesh = mesh if mesh is not None else get_parallel_mesh()
        self.checked = checked
        self.group = self.mesh.group("pp")
        self.ranks: list[int] = self.mesh.ranks("pp")
        self.stage = self.mesh.rank("pp")
        self.num_stages = len(self.ranks)
        self._group_peer = {"next": (self.stage + 1) % self.num_stages, "prev": (self.stage - 1) % self.num_stages}
        self.next_rank = self.ranks[self._group_peer["next"]]
        self.prev_rank = self.ranks[self._group_peer["prev"]]
        self.device = _pp_device(self.mesh)
        self.max_pending_sends = max_pending_sends
        self._pending_sends: deque[dist.Work] = deque()
        self._unsettled: dict[int, PendingRecv] = {}  # checked receives whose header is not yet handled

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(stage={self.stage}/{self.num_stages}, prev_rank={self.prev_rank}, "
            f"next_rank={self.next_rank}, device={self.device}, checked={self.checked})"
        )

    # ---- sends --------------------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, *, peer: Peer = "next") -> P2PWork:
        """Start sending ``tensor`` to the ``"next"`` (default) or ``"prev"`` stage; returns its handle.

        No copy is made when ``tensor`` is contiguous: do not modify it until the handle's ``wait()`` returns
        (:meth:`PPScheduler.isend_next` sends a copy instead).
        """
        group_dst = self._peer(peer, "send")
        tensor = self._check_tensor(tensor, "send").contiguous()
        if self.checked:
            self._track(dist.isend(self._header(tensor), group=self.group, group_dst=group_dst))
        work = dist.isend(tensor, group=self.group, group_dst=group_dst)
        self._track(work)
        return P2PWork(work)

    def wait_sends(self) -> None:
        """Wait until every send this object still tracks has completed."""
        while self._pending_sends:
            _wait_once(self._pending_sends.popleft())

    # ---- receives -----------------------------------------------------------------------------------
    def irecv(self, shape: Sequence[int], dtype: torch.dtype, *, peer: Peer = "prev") -> PendingRecv:
        """Post a receive of a new ``(shape, dtype)`` tensor from the ``"prev"`` (default) or ``"next"`` stage.

        Several receives may be in flight; they are matched with the peer's sends in posting order. In
        checked mode, posting a receive first waits for the header of the previous one from the same stage
        (one receive per neighbour can be pre-posted ahead of its sender), and the returned
        :class:`PendingRecv` raises ValueError from ``wait()`` if the sender's shape or dtype differ.
        """
        return self.irecv_into(torch.empty(shape, dtype=dtype, device=self.device), peer=peer)

    def irecv_into(self, buffer: torch.Tensor, *, peer: Peer = "prev") -> PendingRecv:
        """Post a receive into ``buffer`` (contiguous, on :attr:`device`); see :meth:`irecv`."""
        group_src = self._peer(peer, "receive")
        buffer = self._check_tensor(buffer, "receive")
        if not buffer.is_contiguous():
            raise ValueError(
                f"receive buffer must be contiguous, got shape {tuple(buffer.shape)} stride {buffer.stride()}"
            )
        if not self.checked:
            return PendingRecv(buffer, dist.irecv(buffer, group=self.group, group_src=group_src))
        self._settle(group_src)  # the previous receive's payload must be posted before this header
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        pending = PendingRecv(
            buffer,
            None,
            link=self,
            header=header,
            header_work=dist.irecv(header, group=self.group, group_src=group_src),
            group_src=group_src,
        )
        self._unsettled[group_src] = pending
        return pending

    def recv(self, shape: Sequence[int], dtype: torch.dtype, *, peer: Peer = "prev") -> torch.Tensor:
        """Receive a new ``(shape, dtype)`` tensor from the ``"prev"`` (default) or ``"next"`` stage; blocks."""
        return self.irecv(shape, dtype, peer=peer).wait()

    # ---- both directions ----------------------------------------------------------------------------
    def exchange(
        self,
        *,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: tuple[Sequence[int], torch.dtype] | None = None,
        recv_next: tuple[Sequence[int], torch.dtype] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Send to and receive from both neighbours in one batch (``batch_isend_irecv``: no deadlock, also
        when pp=2 makes next and prev the same rank); blocks until all completed.

        ``recv_prev`` / ``recv_next`` are ``(shape, dtype)``. Returns ``(from_prev, from_next)`` (None where
        nothing was asked). Neighbours must make matching calls (a ``send_next`` meets a ``recv_prev``).
        On NCCL, the first batched call on the pp group must include every stage.

        Raises:
            ValueError (checked mode): a received shape or dtype differs (payloads are drained first).
        """
        sends = [(t, self._peer(p, "send")) for p, t in (("next", send_next), ("prev", send_prev)) if t is not None]
        recvs = [
            (torch.empty(spec[0], dtype=spec[1], device=self.device), self._peer(p, "receive"))
            for p, spec in (("prev", recv_prev), ("next", recv_next))
            if spec is not None
        ]
        if not sends and not recvs:
            raise ValueError("exchange: nothing to do; pass send_next/send_prev and/or recv_prev/recv_next")
        sends = [(self._check_tensor(t, "send").contiguous(), dst) for t, dst in sends]
        scratch: dict[int, torch.Tensor] = {}
        errors: list[str] = []
        if self.checked:
            for _, src in recvs:
                self._settle(src)
            headers = [torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device) for _ in recvs]
            self._batch(
                [dist.P2POp(dist.isend, self._header(t), group=self.group, group_peer=dst) for t, dst in sends]
                + [dist.P2POp(dist.irecv, h, group=self.group, group_peer=src) for h, (_, src) in zip(headers, recvs)]
            )
            for i, drain, message in self._mismatches([(h, buf, src) for h, (buf, src) in zip(headers, recvs)]):
                scratch[i] = drain
                errors.append(message)
        self._batch(
            [dist.P2POp(dist.isend, t, group=self.group, group_peer=dst) for t, dst in sends]
            + [dist.P2POp(dist.irecv, scratch.get(i, buf), group=self.group, group_peer=src)
               for i, (buf, src) in enumerate(recvs)]
        )  # fmt: skip
        if errors:
            raise ValueError("; ".join(errors))
        received = iter(buf for buf, _ in recvs)
        return (
            next(received) if recv_prev is not None else None,
            next(received) if recv_next is not None else None,
        )

    # ---- internals ----------------------------------------------------------------------------------
    def _peer(self, peer: str, what: str) -> int:
        if self.mesh.destroyed:
            raise RuntimeError(f"{type(self).__name__}: its mesh ({self.mesh.dims}) was destroyed; build a new one")
        if peer not in self._group_peer:
            raise ValueError(f"peer must be 'next' or 'prev', got {peer!r}")
        if self.num_stages == 1:
            raise RuntimeError(f"cannot {what}: the pp axis has a single stage (pp=1), so there is no neighbour")
        return self._group_peer[peer]

    def _settle(self, group_src: int) -> None:
        pending = self._unsettled.get(group_src)
        if pending is not None:
            pending._settle()

    def _check_tensor(self, tensor: Any, what: str) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != self.device.type:
            raise ValueError(f"{what}: tensor is on {tensor.device}, but the pp axis communicates on {self.device}")
        return tensor

    def _track(self, work: dist.Work) -> None:
        pending = self._pending_sends
        while pending and pending[0].is_completed():
            pending.popleft()
        pending.append(work)
        if len(pending) > self.max_pending_sends:
            _wait_once(pending.popleft())

    def _batch(self, ops: list[dist.P2POp]) -> None:
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def _header(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype not in DTYPE_CODES:
            raise ValueError(f"checked send: dtype {tensor.dtype} is not supported; supported: {list(DTYPES)}")
        if tensor.dim() > MAX_CHECKED_NDIM:
            raise ValueError(f"checked send: {tensor.dim()} dims, at most {MAX_CHECKED_NDIM} are supported")
        values = [HEADER_MAGIC, DTYPE_CODES[tensor.dtype], tensor.dim(), *tensor.shape]
        return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64, device=self.device)

    def _mismatches(
        self, received: list[tuple[torch.Tensor, torch.Tensor, int]]
    ) -> list[tuple[int, torch.Tensor, str]]:
        """Compare received ``(header, expected buffer, group_src)`` triples; for each mismatch return its
        position, a scratch buffer of the sender's shape/dtype to drain the payload into, and the message."""
        out = []
        for i, (header, buffer, group_src) in enumerate(received):
            magic, code, ndim, *dims = header.tolist()
            src = self.ranks[group_src]
            if magic != HEADER_MAGIC or not 0 <= code < len(DTYPES) or not 0 <= ndim <= MAX_CHECKED_NDIM:
                raise ValueError(
                    f"checked receive on pp stage {self.stage} from global rank {src}: what arrived is not a "
                    "checked-mode header; both ends of a link must use checked=True"
                )
            shape, dtype = tuple(dims[:ndim]), DTYPES[code]
            if (shape, dtype) != (tuple(buffer.shape), buffer.dtype):
                message = (
                    f"checked receive on pp stage {self.stage} from pp stage {group_src} (global rank {src}): "
                    f"expected {_describe(buffer.shape, buffer.dtype)}, received {_describe(shape, dtype)} "
                    "(the payload was drained; the link stays usable)"
                )
                out.append((i, torch.empty(shape, dtype=dtype, device=self.device), message))
        return out


class PPScheduler(PipelineP2P):
    """Legacy point-to-point scheduler for adjacent pipeline stages (drop-in for the original package).

    ``isend_next`` sends to the next stage (the last stage's reaches stage 0); the receives take from the
    previous stage. ``queue_irecv_prev`` posts receives ahead of time and ``queue_irecv_prev_data`` pops
    them oldest first. The native :class:`PipelineP2P` methods (``send``, ``recv``, ``exchange``, ...) work
    on it too. Use the process-wide instance: :func:`init_pp_scheduler`, :func:`pp_scheduler`.
    """

    def __init__(self, mesh: ParallelMesh | None = None, *, checked: bool = False, max_pending_sends: int = 64) -> None:
        super().__init__(mesh, checked=checked, max_pending_sends=max_pending_sends)
        self._recv_queue: deque[PendingRecv] = deque()

    def isend_next(self, tensor: torch.Tensor) -> P2PWork:
        """Send a contiguous copy of ``tensor`` to the next stage; returns the work handle.

        Thanks to the copy the caller may modify ``tensor`` at once; the handle may be dropped.
        """
        return self.send(self._check_tensor(tensor, "isend_next").detach().clone(memory_format=torch.contiguous_format))

    def irecv_prev(self, buffer: torch.Tensor) -> P2PWork:
        """Post a receive from the previous stage into ``buffer``; returns the work handle.

        In checked mode this first waits for the header (and raises ValueError on a mismatch).
        """
        pending = self.irecv_into(buffer)
        if self.checked:
            pending._settle()
            if pending._error is not None:
                pending.wait()  # drains the payload, then raises
        return P2PWork(pending.work)

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


# ---- process-wide instance ----------------------------------------------------------------------------
_scheduler: PPScheduler | None = None


def init_pp_scheduler() -> PPScheduler:
    """Create the process-wide :class:`PPScheduler` on the current mesh's pp axis and return it.

    Raises:
        PipelineStateError: it already exists (destroy_model_parallel() resets it).
        RuntimeError: model parallel is not initialized.
    """
    global _scheduler
    if _scheduler is not None:
        raise PipelineStateError(
            f"init_pp_scheduler: the PP scheduler is already initialized ({_scheduler!r}); "
            "call wf_mesh.destroy_model_parallel() before initializing again"
        )
    _scheduler = PPScheduler()
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


def _reset() -> None:
    global _scheduler
    _scheduler = None


register_destroy_hook(_reset)


# ---- bridge to torch.distributed.pipelining -----------------------------------------------------------
def build_pipeline_stage(
    module: torch.nn.Module,
    *,
    mesh: ParallelMesh | None = None,
    device: torch.device | None = None,
    **stage_kwargs: Any,
) -> PipelineStage:
    """This rank's ``torch.distributed.pipelining.PipelineStage``: stage index = pp rank, stage count = pp
    size, group = the pp group of ``mesh`` (default: the current mesh).

    ``module`` is this stage's part of the model, already on ``device`` (default: the mesh's device, the
    current CUDA device on NCCL). ``stage_kwargs`` go to ``PipelineStage`` (``input_args``, ``output_args``,
    ``dw_builder``, ...). Drive the stage with a torch schedule, e.g.::

        stage = build_pipeline_stage(my_stage_module)
        schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)   # or Schedule1F1B
        if stage.is_first: schedule.step(x)
        elif stage.is_last: schedule.step(target=y, losses=losses)
        else: schedule.step()
    """
    from torch.distributed.pipelining import PipelineStage

    mesh = mesh if mesh is not None else get_parallel_mesh()
    return PipelineStage(
        module,
        stage_index=mesh.rank("pp"),
        num_stages=mesh.size("pp"),
        device=device if device is not None else _pp_device(mesh),
        group=mesh.group("pp"),
        **stage_kwargs,
    )
