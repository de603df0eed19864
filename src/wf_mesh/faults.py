"""Fault containment: a rank whose own step fails part-way through a sequence of collectives does not leave its
peers waiting, and every rank of the group raises that rank's error (opt-in, see below).

A sequence (a ring's hops, a state broadcast's buckets, a pipeline send/receive pair) is a fixed pattern of
messages every rank computes from agreed facts. When one rank's local step raises there (an out-of-memory
error in the block kernel at ring hop 2), raising at once would leave the messages its peers still expect
unmatched: they wait until the timeout, and posted gloo / NCCL operations cannot be cancelled, so what is left
behind meets the next call on the group. Containment instead:

1. catches the exception at the local step (:meth:`FaultSequence.step`), records it, and skips every
   later local step of the sequence;
2. keeps issuing the sequence's messages with buffers it already holds (the received blocks, the zeroed
   accumulators): control flow stays identical on every rank, so nothing is left unmatched;
3. closes the sequence with one verdict exchange over the group (:meth:`FaultSequence.close`,
   :func:`wf_mesh.agreement.verdict`: a one-word all-reduce; the full agreement row only on failure): if
   any rank failed, every rank raises that rank's exception type
   with a message naming the rank, where it failed and its error, all at the same point, so the callers stay
   in step and the next call on the group is exact.

Why a closing exchange, and why opt-in. In a ring, what rank f knows after a failure at hop h reaches at most
one more rank per remaining hop, so a status riding on the existing messages cannot reach every rank before
the call returns (a failure in the last block kernel reaches nobody): only a message every rank waits for
after the last step can. That is one all-reduce of one int64 word per contained sequence (and a host
sync on NCCL), which a call that succeeds would pay too, and the success path comes first: containment is off
unless asked for, with ``init_parallel(contain_faults=True)`` (the ranks agree on it when the mesh is built)
or ``WF_MESH_CONTAIN_FAULTS=1`` in every rank's environment. Servers, notebooks and training loops that catch
a failed batch turn it on; a job whose launcher ends every rank on the first exception does not need it.
With containment off a failing local step raises at once on its rank, as before, and its peers' waits end
after the group's timeout.

What is not contained (the launcher's job): a killed process (gloo peers see the closed connection within
about a second), a device error that breaks the communicator (NCCL aborts it), a rank stuck inside a kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from wf_mesh import _compat, agreement

__all__ = ["FaultSequence", "containment_enabled", "injected_fault", "set_containment"]

_contain: bool | None = None  # set while a mesh built with an explicit choice is alive
_injected: dict[tuple[str, int], Exception] = {}  # (step name, 1-based place) -> what that step raises here


@contextlib.contextmanager
def injected_fault(where: str, at: int, exc: Exception) -> Iterator[None]:
    """Within the block, this process's local step ``(where, at)`` of any contained sequence raises ``exc``
    instead of running (e.g. ``injected_fault("ring hop", 2, MemoryError("simulated"))`` on one rank): for
    testing how a server or a training loop handles a failure, as the tests do.

    Args:
        where: the step's name, as the messages say it ("ring hop", "ring backward hop", "bucket", ...).
        at: its 1-based place in the sequence.
        exc: the exception to raise there.
    """
    _injected[(where, at)] = exc
    try:
        yield
    finally:
        _injected.pop((where, at), None)


def containment_enabled() -> bool:
    """Whether multi-step sequences contain local failures.

    Returns:
        The mesh's ``contain_faults``, else ``WF_MESH_CONTAIN_FAULTS`` (off unless ``"1"``).
    """
    if _contain is not None:
        return _contain
    return os.environ.get("WF_MESH_CONTAIN_FAULTS", "0") == "1"


def set_containment(value: bool | None) -> None:
    """Set this process's containment (None: back to the environment). :func:`~wf_mesh.init_parallel` calls
    it once the ranks agreed; anything else calling it must do so on every rank alike (a rank that skips the
    closing exchange its peers run leaves them waiting)."""
    global _contain
    _contain = value


@dataclasses.dataclass(frozen=True)
class _Verdict(agreement.Facts):
    """A rank that completed its sequence (a failed one raises from ``facts()`` instead)."""


class FaultSequence:
    """One contained sequence of collectives on ``group`` (see the module docstring): a ProcessGroup, a
    group's name, or None (the default group).

    Use: ``seq = FaultSequence(group, "cp_attention")``; run each local step as
    ``seq.step(("ring hop", t, n), fn, *args)``; issue the messages as usual; finish with ``seq.close()``.
    With containment off, ``step`` just calls ``fn`` and ``close`` does nothing.
    """

    __slots__ = ("active", "fault", "group", "skipping", "what")

    def __init__(self, group: dist.ProcessGroup | str | None, what: str) -> None:
        self.group = group
        self.what = what
        self.active = containment_enabled()
        self.fault: tuple[Exception, tuple[str, int, int]] | None = None
        self.skipping = False  # another rank failed and told this one (a pipeline's failed header)

    @property
    def failed(self) -> bool:
        """Whether a local step of this rank failed (its later steps are skipped)."""
        return self.fault is not None

    def step(self, where: tuple[str, int, int], fn: Callable[..., Any], *args: Any) -> Any:
        """Run one local step; with containment on, its exception is recorded, not raised.

        Args:
            where: ``(what, i, n)``: the step's name and place, e.g. ``("ring hop", 2, 4)`` (1-based).
            fn: the step.
            *args: its arguments.

        Returns:
            ``fn(*args)``; None when this or an earlier step failed.
        """
        if self.fault is not None or self.skipping:
            return None
        if _injected and (where[0], where[1]) in _injected:
            fn, args = _raise, (_injected[where[0], where[1]],)
        if not self.active:
            return fn(*args)
        try:
            return fn(*args)
        except Exception as exc:
            self.fault = (exc, where)
            return None

    def skip(self) -> None:
        """Skip this rank's later local steps because a peer failed (its verdict comes at :meth:`close`)."""
        self.skipping = True

    def record(self, exc: Exception, where: tuple[str, int, int]) -> None:
        """Record ``exc`` as this rank's failure at ``where`` (for an exception raised outside :meth:`step`)."""
        if self.fault is None:
            self.fault = (exc, where)

    def close(self) -> None:
        """End the sequence: with containment on, one verdict exchange; if any rank failed, every rank raises
        the first failing rank's exception type, naming each failing rank, where it failed and its error (the
        failing rank's own exception chained as the cause)."""
        if not self.active:
            return
        fault, self.fault, self.skipping = self.fault, None, False

        def facts() -> _Verdict:
            if fault is not None:
                exc, (name, i, n) = fault
                raise _retold(exc, f"failed at {name} {i} of {n}: {type(exc).__name__}: {exc}")
            return _Verdict()

        group = _compat.resolve_group(self.group) if isinstance(self.group, str) else self.group
        try:
            agreement.verdict(group, facts, what=self.what)
        except Exception as verdict:
            if fault is not None:
                raise verdict from fault[0]
            raise


def _raise(exc: Exception) -> None:
    raise exc


def _retold(exc: Exception, message: str) -> Exception:
    """An exception of ``exc``'s type saying ``message`` (a RuntimeError where the type needs other arguments)."""
    try:
        return type(exc)(message)
    except Exception:
        return RuntimeError(message)
