"""Bounded waits: a wf_mesh collective whose peer stops answering without dying raises
:class:`~wf_mesh.errors.CollectiveTimeoutError` after the group's timeout, naming the call, the mesh axis, the
group's ranks and the timeout.

The backends already end such a wait: gloo raises a RuntimeError ("Timed out waiting 3000ms for send operation
to complete") once the group's timeout passes, and NCCL's watchdog fails the work after it (by default it then
tears the process down, which the launcher sees). What they cannot say is which wf_mesh call and which axis
waited: a world-spanning axis reuses the default group, and the message names a source file. :class:`bounded`
wraps the places where a wf_mesh call waits (the agreement exchange every checked call starts with, each ring hop)
and retells the timeout there; any other exception passes through unchanged. A killed peer is not a timeout: gloo
sees the closed connection within about a second and its error passes through as it is.

Where the wait is bounded: ``init_parallel(timeout=...)`` sets every axis's groups' timeout (default: the
default group's, torch's 30 minutes for gloo and 10 for NCCL unless ``init_process_group`` said otherwise).
"""

from __future__ import annotations

import re
import typing
from collections.abc import Mapping
from types import TracebackType

import torch.distributed as dist

from wf_mesh import _compat, errors

__all__ = ["bounded", "name_axes"]

_axes: dict[str, str] = {}  # group_name -> the axes it serves, while a mesh is alive
_TIMEOUT = re.compile(r"timed out|timeout|timing out", re.IGNORECASE)


def name_axes(groups: Mapping[str, dist.ProcessGroup] | None) -> None:
    """Name each group after the mesh axes it serves (``{axis: group}``), for the messages; None forgets them.
    :func:`~wf_mesh.init_parallel` calls it when a mesh is built and destroyed."""
    _axes.clear()
    for axis, group in (groups or {}).items():
        name = group.group_name
        _axes[name] = f"{_axes[name]}, {axis}" if name in _axes else axis


def _described(group: dist.ProcessGroup | None) -> str:
    group = group if group is not None else typing.cast(dist.ProcessGroup, dist.group.WORLD)
    axes = _axes.get(group.group_name)
    if axes is None:
        desc = getattr(group, "group_desc", "")
        axes = desc.removeprefix("mesh_") if desc.startswith("mesh_") else None
    ranks = dist.get_process_group_ranks(group)
    where = f"the {axes} axis" if axes and "," not in axes else f"the {axes} axes" if axes else "the group"
    try:
        timeout = f"{_compat.group_timeout(group).total_seconds():g} s"
    except Exception:  # a backend that keeps no options: say so rather than guess
        timeout = "the group's timeout"
    return f"{where} (ranks {ranks}) within its timeout of {timeout}"


class bounded:
    """``with bounded(group, what):`` around a wait on ``group``: a backend timeout inside it is raised as
    :class:`~wf_mesh.errors.CollectiveTimeoutError` (the backend's error chained as its cause); every other
    exception passes through. A class, not a generator: it sits on the hot path of every ring hop."""

    __slots__ = ("group", "what")

    def __init__(self, group: dist.ProcessGroup | None, what: str) -> None:
        self.group = group
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is None or not isinstance(exc, RuntimeError) or isinstance(exc, errors.CollectiveTimeoutError):
            return
        if not _TIMEOUT.search(str(exc)):
            return
        detail = str(exc).split("] ", 1)[-1]  # gloo prefixes the C++ source location
        message = (
            f"{self.what}: no answer from a peer of {_described(self.group)}: a rank is stuck or slower than the "
            f"timeout (init_parallel(timeout=...) sets it); the backend said: {detail}"
        )
        raise errors.CollectiveTimeoutError(message) from exc
