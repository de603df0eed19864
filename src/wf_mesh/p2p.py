"""Point-to-point transfers that work on every backend: wf_mesh's sends and receives (ring hops forward and
backward, pipeline transfers) go through here.

gloo moves CUDA tensors in its collectives (all-gather, all-to-all, all-reduce stage through the host), but its
``send`` and ``recv`` hand the tensor's data pointer to TCP with no device check, so a CUDA tensor cannot travel
point-to-point over a gloo group as it is. That is the case of several processes sharing one GPU (NCCL wants a
device per rank): such transfers are *staged*, the sent tensor copied to host memory first, the received one
landing in a host buffer that is copied into the device tensor when its work is waited on. :func:`staged` is the
choice, a pure function of the backend that serves the tensor's device and of the tensor's device type: NCCL (and
any other backend) stages nothing, nor does gloo with CPU tensors. :func:`forced_staging` stages every transfer of
a block of code, so the staged path runs, and is compared, on a CPU-only machine.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "StagedWork",
    "Work",
    "batch_isend_irecv",
    "forced_staging",
    "irecv",
    "isend",
    "serving_backend",
    "staged",
]

_forced = threading.local()

Op = tuple[Callable[..., Any], torch.Tensor, int]
"""``(dist.isend or dist.irecv, tensor, peer's rank in the group)``: one op of a batch."""


def serving_backend(backend: str, device_type: str) -> str:
    """The backend that serves ``device_type`` tensors in a group whose ``dist.get_backend`` is ``backend``
    (``"gloo"``, or per device: ``"cpu:gloo,cuda:nccl"``).

    Returns:
        The backend's name; ``backend`` itself when it does not name one per device.
    """
    if ":" not in backend:
        return backend
    per_device = dict(part.split(":", 1) for part in backend.split(","))
    return per_device.get(device_type, backend)


def staged(backend: str, device_type: str, *, forced: bool = False) -> bool:
    """Whether a point-to-point transfer of a ``device_type`` tensor over a group of ``backend`` stages through
    host memory: only gloo with a non-CPU tensor, or ``forced``.

    Returns:
        True to stage.
    """
    return forced or (serving_backend(backend, device_type) == "gloo" and device_type != "cpu")


@contextlib.contextmanager
def forced_staging() -> Iterator[None]:
    """Stage every point-to-point transfer this thread starts inside the block (the staged path on CPU)."""
    before = getattr(_forced, "on", False)
    _forced.on = True
    try:
        yield
    finally:
        _forced.on = before


def _stages(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    return staged(dist.get_backend(group), tensor.device.type, forced=getattr(_forced, "on", False))


class StagedWork:
    """The work of a staged transfer: ``wait()`` waits for torch's works once, then copies received host
    buffers into their device tensors; ``is_completed()`` is true only after that (a receive's data is not in
    place before)."""

    __slots__ = ("_copies", "_done", "_works")

    def __init__(self, works: Sequence[dist.Work], copies: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
        self._works = list(works)
        self._copies = list(copies)  # (device tensor, host buffer) of each receive
        self._done = False

    def is_completed(self) -> bool:
        """Whether the transfer and its copy-in are done."""
        return self._done or (not self._copies and all(w.is_completed() for w in self._works))

    def wait(self) -> bool:
        """Block until the transfer is done and received data is in its device tensor (torch's works are waited
        on once: gloo blocks on a second wait of a point-to-point work).

        Returns:
            True (torch's ``Work.wait`` contract).
        """
        if not self._done:
            for work in self._works:
                work.wait()
            for target, host in self._copies:
                target.copy_(host)
            self._done, self._works, self._copies = True, [], []
        return True


Work = dist.Work | StagedWork
"""What a transfer returns: torch's work, or the staged one (both have ``wait()`` and ``is_completed()``)."""


def _host(tensor: torch.Tensor, send: bool) -> torch.Tensor:
    if send:
        return tensor.detach().to("cpu", copy=True)
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")


def isend(tensor: torch.Tensor, *, group: dist.ProcessGroup, group_dst: int) -> Work | None:
    """``dist.isend`` of ``tensor`` to the group's rank ``group_dst``, staged where :func:`staged` says.

    Returns:
        The work (None for a rank outside the group, as torch's).
    """
    if not _stages(tensor, group):
        return dist.isend(tensor, group=group, group_dst=group_dst)
    work = dist.isend(_host(tensor, True), group=group, group_dst=group_dst)
    return None if work is None else StagedWork([work])


def irecv(tensor: torch.Tensor, *, group: dist.ProcessGroup, group_src: int) -> Work | None:
    """``dist.irecv`` into ``tensor`` from the group's rank ``group_src``, staged where :func:`staged` says
    (``tensor`` is then filled when the work is waited on).

    Returns:
        The work (None for a rank outside the group, as torch's).
    """
    if not _stages(tensor, group):
        return dist.irecv(tensor, group=group, group_src=group_src)
    host = _host(tensor, False)
    work = dist.irecv(host, group=group, group_src=group_src)
    return None if work is None else StagedWork([work], [(tensor, host)])


def batch_isend_irecv(ops: Sequence[Op], group: dist.ProcessGroup) -> list[Any]:
    """``dist.batch_isend_irecv`` of ``ops`` over ``group``, each op staged where :func:`staged` says.

    Returns:
        The works to wait on (receives land in their tensors once waited).
    """
    plan = [(op, tensor, peer, _stages(tensor, group)) for op, tensor, peer in ops]
    sent = [(op, _host(tensor, op is dist.isend) if stage else tensor, peer, stage) for op, tensor, peer, stage in plan]
    works = dist.batch_isend_irecv([dist.P2POp(op, t, group=group, group_peer=peer) for op, t, peer, _ in sent])
    copies = [(tensor, s[1]) for (op, tensor, _, stage), s in zip(plan, sent) if stage and op is dist.irecv]
    if not copies:
        return list(works)
    if len(works) == len(plan):  # one work per op: each receive copies in when its own work is waited on
        return [
            StagedWork([work], [(tensor, s[1])] if stage and op is dist.irecv else [])
            for work, (op, tensor, _, stage), s in zip(works, plan, sent)
        ]
    return [StagedWork(works, copies)]  # coalesced works: waited together, then every receive is copied in
