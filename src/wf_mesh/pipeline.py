"""Pipeline point-to-point transfers on the mesh's pp axis, and a bridge to ``torch.distributed.pipelining``.

Which one to use:

- :class:`PipelineP2P`: loops that move tensors between stages themselves. Inference and denoising loops
  (stage 0 pre-posts the receive of the next step's latent, every stage forwards its activations, the last
  stage sends back to stage 0), custom overlap, anything that is not a training microbatch schedule. You own
  the order and the shapes.
- :func:`build_pipeline_stage`: training with microbatches. It wraps this rank's stage module in a
  ``torch.distributed.pipelining.PipelineStage`` placed by the mesh (stage index = pp rank, stage count = pp
  size, group = the pp group); drive it with ``ScheduleGPipe``, ``Schedule1F1B`` or another torch schedule,
  which infer shapes, order sends and receives, run backward and scale gradients.

The pp group is a ring: the last stage's ``next`` is stage 0 and stage 0's ``prev`` is the last stage.
Transfers are matched in order: the i-th send from stage a to stage b meets the i-th receive on b from a,
whatever the number in flight. Tensors live on the current CUDA device when the mesh is on CUDA (NCCL),
on CPU otherwise (gloo).

==================================  ============================  =============================================
call                                messages (checked)            blocks until
==================================  ============================  =============================================
``send``                            2 (header + payload)          never (returns the work handle)
``irecv`` / ``irecv_into``          2                             never (the previous receive's header)
``recv``                            2                             the data arrived
``exchange``                        2 batches                     everything in it completed
==================================  ============================  =============================================

**Checked mode** (the default): every payload is preceded by a small header (dtype, shape; the same wire
format as :mod:`wf_mesh.agreement`'s rows); the receiver compares it with what it expects and, on a
mismatch, receives the payload into a scratch buffer (so the sender completes and the link stays in step)
and raises ValueError naming both. **Unchecked** (``checked=False``, one message per transfer, for
latency-critical loops whose shapes are fixed): nothing is verified, and a mismatch is not an error but
undefined behaviour: a payload larger than the receive buffer aborts a gloo process (SIGABRT), a smaller one
leaves the rest of the buffer as it was (stale or uninitialised data). Every stage of the pp group must use
the same mode: the constructor is collective over the pp group and raises on every stage if they differ.

gloo drops a send whose work handle is garbage-collected before the peer receives it; the link keeps up to
``max_pending_sends`` send handles alive, so callers may drop them. A send still in flight when its group is
destroyed is lost too: call ``wait_sends()`` before tearing down. The handles returned (:class:`P2PWork`)
may be waited any number of times; gloo's own work, waited a second time, blocks until the timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from wf_mesh import agreement, p2p, waits
from wf_mesh.faults import FaultSequence
from wf_mesh.mesh import ParallelMesh, get_parallel_mesh
from wf_mesh.topology import as_int

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

__all__ = ["P2PWork", "PendingRecv", "PipelineP2P", "build_pipeline_stage"]

Peer = Literal["next", "prev"]
_HEADER = "pipeline payload"  # the header's call name: a row of any other origin is not a header
_FAILED = "pipeline failed step"  # sent instead of a header and payload by a stage whose contained step failed


@dataclasses.dataclass(frozen=True)
class _PayloadHeader(agreement.Facts):
    """What checked mode sends before every payload."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"shape {self.shape} dtype {self.dtype}"


@dataclasses.dataclass(frozen=True)
class _FailedStep(agreement.Facts):
    """A stage upstream failed in a contained sequence: no payload follows."""


@dataclasses.dataclass(frozen=True)
class _LinkFacts(agreement.Facts):
    checked: bool


class P2PWork:
    """Handle of a send or receive: ``wait()`` may be called any number of times, also after the link
    waited on it (a gloo point-to-point work waited twice blocks until the timeout). ``work`` is torch's;
    ``group`` and ``what`` (the op and its peer) name a wait that times out (:mod:`wf_mesh.waits`)."""

    __slots__ = ("group", "what", "work")

    def __init__(self, work: p2p.Work, group: dist.ProcessGroup | None = None, what: str = "pipeline P2P") -> None:
        self.work = work
        self.group = group
        self.what = what

    def wait(self) -> bool:
        """Block until the op completed.

        Returns:
            True (torch's ``Work.wait`` contract).

        Raises:
            CollectiveTimeoutError: the peer did not answer within the pp group's timeout.
        """
        _wait_once(self.work, self.group, self.what)
        return True

    def is_completed(self) -> bool:
        """Whether the op completed (does not block)."""
        return self.work.is_completed()


def _posted(work: p2p.Work | None) -> p2p.Work:
    """The handle torch returned for a point-to-point op (None only for a rank outside the group: never a link)."""
    if work is None:
        raise RuntimeError("a point-to-point op on the pp group returned no work: this rank is not in the group")
    return work


def _wait_once(work: p2p.Work, group: dist.ProcessGroup | None, what: str) -> None:
    # gloo: waiting a completed point-to-point work again blocks until the timeout
    if not work.is_completed():
        with waits.bounded(group, what):
            work.wait()


class PendingRecv:
    """A posted receive; ``wait()`` returns ``tensor`` once it is filled.

    Checked mode posts only the header receive at first; :meth:`check` (called by ``wait()``, or when the
    next receive from the same stage is posted) waits for the header, posts the payload receive, and on a
    mismatch drains the payload into a scratch buffer and raises ValueError.
    """

    __slots__ = ("_error", "_header", "_header_work", "_headers", "_src", "group", "tensor", "what", "work")

    def __init__(
        self,
        tensor: torch.Tensor,
        work: p2p.Work | None,
        headers: _Headers | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        what: str = "pipeline receive",
    ) -> None:
        self.tensor = tensor
        self.work = work  # checked: None until the header is settled
        self.group = group  # with ``what``, names a wait that times out
        self.what = what
        self._headers = headers
        self._header: torch.Tensor | None = None
        self._header_work: p2p.Work | None = None
        self._src = -1
        self._error: str | None = None

    def check(self) -> None:
        """Checked mode: wait for the header; on a mismatch, drain the payload and raise ValueError.

        Raises:
            ValueError: the sender's shape or dtype differ from the buffer's.
        """
        work = self.payload_work()
        if self._error is not None:
            _wait_once(work, self.group, self.what)
            raise ValueError(self._error)

    def payload_work(self) -> p2p.Work:
        """The handle torch returned for the payload receive (checked mode: posted once the header is settled)."""
        if self.work is None and self._headers is not None:
            self._headers.settle(self)
        return _posted(self.work)

    def wait(self) -> torch.Tensor:
        """Wait until ``tensor`` is filled.

        Returns:
            ``tensor``.

        Raises:
            ValueError: (checked mode) the sender's shape or dtype differ, see :meth:`check`.
            CollectiveTimeoutError: the peer did not send within the pp group's timeout.
        """
        self.check()
        _wait_once(self.payload_work(), self.group, self.what)
        return self.tensor


class _Headers:
    """Checked mode of one link: a (dtype, shape) header before every payload, verified on receipt."""

    def __init__(self, link: PipelineP2P) -> None:
        self.link = link
        self.unsettled: dict[int, PendingRecv] = {}  # per peer: the receive whose header is not handled yet

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return agreement.header_row(_HEADER, _PayloadHeader(tensor.dtype, tuple(tensor.shape)), self.link.device)

    def empty(self) -> torch.Tensor:
        return torch.empty(agreement.ROW, dtype=torch.int64, device=self.link.device)

    def post(self, buffer: torch.Tensor, src: int) -> PendingRecv:
        self.settle_from(src)  # the previous receive's payload must be posted before this header
        pending = PendingRecv(buffer, None, self, group=self.link.group, what=self.link._what("receive from", src))
        pending._header, pending._src = self.empty(), src
        pending._header_work = p2p.irecv(pending._header, group=self.link.group, group_src=src)
        self.unsettled[src] = pending
        return pending

    def settle_from(self, src: int) -> None:
        pending = self.unsettled.get(src)
        if pending is not None:
            self.settle(pending)

    def settle(self, pending: PendingRecv) -> None:
        header, header_work = pending._header, pending._header_work
        if header is None or header_work is None:
            raise RuntimeError("a checked receive is settled before its header receive was posted")
        with waits.bounded(self.link.group, pending.what):
            header_work.wait()
        if self.unsettled.get(pending._src) is pending:
            del self.unsettled[pending._src]
        if agreement.read_header(header, _FAILED) is not None:  # no payload follows; the buffer stays unfilled
            self.link._peer_failed(pending._src)
            pending.work = header_work
            return
        target, pending._error = self.verify(header, pending.tensor, pending._src)
        pending.work = p2p.irecv(target, group=self.link.group, group_src=pending._src)

    def verify(self, header: torch.Tensor, buffer: torch.Tensor, src: int) -> tuple[torch.Tensor, str | None]:
        """Where the payload of ``header`` goes, and what is wrong with it.

        Returns:
            ``(buffer, None)`` if the header matches ``buffer``, else a scratch buffer of the sender's dtype and
            shape (the payload is drained so the link stays in step) and the error message.

        Raises:
            ValueError: what arrived is not a checked-mode header.
        """
        link = self.link
        sent = agreement.read_header(header, _HEADER, _PayloadHeader)
        if sent is None:
            raise ValueError(
                f"checked receive on pp stage {link.stage} from global rank {link.ranks[src]}: what arrived is not "
                "a checked-mode header (the sender does not use checked mode on this link)"
            )
        expected = _PayloadHeader(buffer.dtype, tuple(buffer.shape))
        if sent == expected:
            return buffer, None
        message = (
            f"checked receive on pp stage {link.stage} from pp stage {src} (global rank {link.ranks[src]}): "
            f"expected {expected}, received {sent} (the payload was drained; the link stays usable)"
        )
        return torch.empty(sent.shape, dtype=sent.dtype, device=link.device), message


class PipelineP2P:
    """Sends and receives between this rank's pipeline stage and its neighbours on the pp axis (a ring).

    Collective over the pp group: every stage constructs its link with the same ``checked``.

    Args:
        mesh: the mesh whose ``pp`` axis to use (default: the current one).
        checked: send a (dtype, shape) header before every payload and verify it on receipt (default; see the
            module docstring for what unchecked links do on a mismatch).
        max_pending_sends: send handles kept alive for callers that drop them (gloo loses a send whose
            handle dies before the peer receives it). With more than that many sends not yet waited for,
            a send first waits for the oldest one.

    Attributes: ``stage`` and ``num_stages`` (pp rank and size), ``next_rank`` / ``prev_rank`` (global
    ranks, wrapping), ``group`` (the pp ProcessGroup), ``device``, ``checked``.
    """

    def __init__(self, mesh: ParallelMesh | None = None, *, checked: bool = True, max_pending_sends: int = 64) -> None:
        self.max_pending_sends = as_int("max_pending_sends", max_pending_sends, minimum=1)
        self.mesh = mesh if mesh is not None else get_parallel_mesh()
        self.checked = bool(checked)
        self.group = self.mesh.group("pp")
        self.ranks: list[int] = self.mesh.ranks("pp")
        self.stage = self.mesh.rank("pp")
        self.num_stages = len(self.ranks)
        self._group_peer = {"next": (self.stage + 1) % self.num_stages, "prev": (self.stage - 1) % self.num_stages}
        self.next_rank = self.ranks[self._group_peer["next"]]
        self.prev_rank = self.ranks[self._group_peer["prev"]]
        self.device = self.mesh.device
        self._pending_sends: deque[P2PWork] = deque()
        self._headers = _Headers(self) if self.checked else None
        self._sequence: FaultSequence | None = None
        if self.num_stages > 1:  # both ends of every link must speak the same protocol
            agreed = agreement.agree(
                self.group, lambda: _LinkFacts(self.checked), what=type(self).__name__, required=True
            )
            agreed.require_same("checked", hint="; every stage must use the same mode")

    @property
    def is_first(self) -> bool:
        """Whether this rank is the first pipeline stage."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank is the last pipeline stage."""
        return self.stage == self.num_stages - 1

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(stage={self.stage}/{self.num_stages}, prev_rank={self.prev_rank}, "
            f"next_rank={self.next_rank}, device={self.device}, checked={self.checked})"
        )

    # ---- sends --------------------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor | None, *, peer: Peer = "next") -> P2PWork:
        """Start sending ``tensor`` to the ``"next"`` (default) or ``"prev"`` stage.

        No copy is made when ``tensor`` is contiguous: do not modify it until the handle's ``wait()`` returns.
        None only inside :meth:`contained` after a failed or skipped step: a failed-step header goes instead.

        Returns:
            The send's handle (it may be dropped: the link keeps the work alive).
        """
        group_dst = self._peer(peer, "send")
        seq = self._sequence
        if tensor is None and seq is not None and (seq.failed or seq.skipping) and self._headers is not None:
            failed = agreement.header_row(_FAILED, _FailedStep(), self.device)  # instead of header and payload
            return self._track(_posted(p2p.isend(failed, group=self.group, group_dst=group_dst)), group_dst)
        tensor = self._check_tensor(tensor, "send").contiguous()
        if self._headers is not None:
            self._track(_posted(p2p.isend(self._headers.of(tensor), group=self.group, group_dst=group_dst)), group_dst)
        return self._track(_posted(p2p.isend(tensor, group=self.group, group_dst=group_dst)), group_dst)

    @contextlib.contextmanager
    def contained(self, what: str = "pipeline step") -> Iterator[FaultSequence]:
        """A contained sequence of this link's transfers and local steps (one microbatch's pass, say).

        With containment on (:mod:`wf_mesh.faults`), a stage whose step fails (run it as ``seq.step((name, i, n),
        fn, *args)``; it returns None then) sends a failed-step header instead of its output (``send(None)``),
        stages receiving it skip their steps and pass it on, and at the end of the block every stage raises
        the failing stage's error; the link stays usable. Needs a checked link::

            with link.contained("microbatch") as seq:
                x = inputs if link.is_first else link.recv(shape, dtype)
                y = seq.step(("stage", link.stage + 1, link.num_stages), stage, x)
                if not link.is_last:
                    link.send(y)

        Yields:
            The sequence's :class:`~wf_mesh.faults.FaultSequence`.

        Raises:
            ValueError: an unchecked link (no header can say that a stage failed).
            RuntimeError: a sequence is already open on this link.
        """
        if self._headers is None:
            raise ValueError(f"{type(self).__name__}.contained needs a checked link (checked=True)")
        if self._sequence is not None:
            raise RuntimeError(f"{type(self).__name__}.contained: a contained sequence is already open on this link")
        seq = self._sequence = FaultSequence(self.group, what)
        try:
            try:
                yield seq
            except Exception as exc:  # outside a step: still told to every stage at the close
                if not seq.active:
                    raise
                seq.record(exc, (what, self.stage + 1, self.num_stages))
        finally:
            self._sequence = None
        seq.close()

    def _peer_failed(self, src: int) -> None:
        if self._sequence is None or not self._sequence.active:
            raise RuntimeError(
                f"pp stage {self.stage}: pp stage {src} (global rank {self.ranks[src]}) failed in a contained "
                "sequence but this stage is not in one: every stage must use PipelineP2P.contained alike"
            )
        self._sequence.skip()

    def wait_sends(self) -> None:
        """Wait until every send this object still tracks has completed.

        Raises:
            CollectiveTimeoutError: a peer did not receive within the pp group's timeout.
        """
        while self._pending_sends:
            self._pending_sends.popleft().wait()

    # ---- receives -----------------------------------------------------------------------------------
    def irecv(self, shape: Sequence[int], dtype: torch.dtype, *, peer: Peer = "prev") -> PendingRecv:
        """Post a receive of a new ``(shape, dtype)`` tensor from the ``"prev"`` (default) or ``"next"`` stage.

        Several receives may be in flight; they are matched with the peer's sends in posting order. In
        checked mode, posting a receive first waits for the header of the previous one from the same stage
        (one receive per neighbour can be pre-posted ahead of its sender), and the returned
        :class:`PendingRecv` raises ValueError from ``wait()`` if the sender's shape or dtype differ.

        Returns:
            The posted receive; its ``wait()`` returns the tensor.
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
        if self._headers is not None:
            return self._headers.post(buffer, group_src)
        work = p2p.irecv(buffer, group=self.group, group_src=group_src)
        return PendingRecv(buffer, work, group=self.group, what=self._what("receive from", group_src))

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

        ``recv_prev`` / ``recv_next`` are ``(shape, dtype)``. Neighbours must make matching calls (a
        ``send_next`` meets a ``recv_prev``). On NCCL, the first batched call on the pp group must include
        every stage.

        Returns:
            ``(from_prev, from_next)``, None where nothing was asked.

        Raises:
            ValueError: (checked mode) a received shape or dtype differs (payloads are drained first), or
                nothing was asked.
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
        targets, errors = [buf for buf, _ in recvs], []
        if self._headers is not None:
            for _, src in recvs:
                self._headers.settle_from(src)
            headers = [self._headers.empty() for _ in recvs]
            self._batch(
                [(dist.isend, self._headers.of(t), dst) for t, dst in sends]
                + [(dist.irecv, h, src) for h, (_, src) in zip(headers, recvs)],
            )
            for i, (header, (buf, src)) in enumerate(zip(headers, recvs)):
                targets[i], error = self._headers.verify(header, buf, src)
                errors += [error] if error else []
        self._batch(
            [(dist.isend, t, dst) for t, dst in sends] + [(dist.irecv, t, src) for t, (_, src) in zip(targets, recvs)]
        )
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

    def _check_tensor(self, tensor: Any, what: str) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != self.device.type:
            raise ValueError(f"{what}: tensor is on {tensor.device}, but the pp axis communicates on {self.device}")
        return tensor

    def _what(self, op: str, peer: int) -> str:
        """How a timed-out wait names the op and its peer: "pipeline receive from pp stage 1 (global rank 3)"."""
        return f"pipeline {op} pp stage {peer} (global rank {self.ranks[peer]})"

    def _track(self, work: p2p.Work, group_dst: int) -> P2PWork:
        pending = self._pending_sends
        while pending and pending[0].is_completed():
            pending.popleft()
        handle = P2PWork(work, self.group, self._what("send to", group_dst))
        pending.append(handle)
        if len(pending) > self.max_pending_sends:
            pending.popleft().wait()
        return handle

    def _batch(self, ops: list[tuple[Any, torch.Tensor, int]]) -> None:
        stages = sorted({peer for _, _, peer in ops})
        peers = ", ".join(f"pp stage {p} (global rank {self.ranks[p]})" for p in stages)
        with waits.bounded(self.group, f"pipeline exchange with {peers}"):
            for work in p2p.batch_isend_irecv(ops, self.group):
                work.wait()


# ---- bridge to torch.distributed.pipelining -----------------------------------------------------------
def build_pipeline_stage(
    module: torch.nn.Module,
    *,
    mesh: ParallelMesh | None = None,
    device: torch.device | None = None,
    **stage_kwargs: Any,
) -> PipelineStage:
    """Build this rank's ``torch.distributed.pipelining.PipelineStage``: stage index = pp rank, stage count =
    pp size, group = the pp group of ``mesh`` (default: the current mesh).

    ``module`` is this stage's part of the model, already on ``device`` (default: the mesh's device, the
    current CUDA device on NCCL). ``stage_kwargs`` go to ``PipelineStage`` (``input_args``, ``output_args``,
    ``dw_builder``, ...). Drive the stage with a torch schedule, e.g.::

        stage = build_pipeline_stage(my_stage_module)
        schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)   # or Schedule1F1B
        if stage.is_first: schedule.step(x)
        elif stage.is_last: schedule.step(target=y, losses=losses)
        else: schedule.step()

    Returns:
        The stage, for a torch schedule.
    """
    from torch.distributed.pipelining import PipelineStage

    mesh = mesh if mesh is not None else get_parallel_mesh()
    return PipelineStage(
        module,
        stage_index=mesh.rank("pp"),
        num_stages=mesh.size("pp"),
        device=device if device is not None else mesh.device,
        group=mesh.group("pp"),
        **stage_kwargs,
    )
