"""Process helpers of ``worldfoundry.core.distributed.torch_process_group`` (and the package root's
``get_world_size`` / ``get_global_rank`` / ``is_distributed_initialized`` / ``get_distributed_device``).

Safe without torch.distributed: a single process is rank 0 of a world of one, and the decorators just call
the function. With it, ``rank0_first`` is collective over the default group (every rank must call it).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from wf_mesh import agreement
from wf_mesh.legacy import runtime

__all__ = [
    "barrier",
    "device_with_rank",
    "get_device",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "is_initialized",
    "is_local_rank0",
    "is_rank0",
    "rank0_first",
    "rank0_only",
]

F = TypeVar("F", bound=Callable[..., Any])


def is_initialized() -> bool:
    """True once torch.distributed's default group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the global rank); 0 without torch.distributed."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Size of ``group`` (default: the world); 1 without torch.distributed."""
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node: ``LOCAL_RANK`` (set by torchrun), else the global rank (one node)."""
    value = os.environ.get("LOCAL_RANK")
    if value is None:
        return get_rank()
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable LOCAL_RANK={value!r} is not an integer") from None


def is_rank0() -> bool:
    """True on global rank 0 (and in a non-distributed process)."""
    return get_rank() == 0


def is_local_rank0() -> bool:
    """True on the first process of each node (:func:`get_local_rank` is 0)."""
    return get_local_rank() == 0


def barrier() -> None:
    """``torch.distributed.barrier()`` over the default group; nothing without torch.distributed."""
    if is_initialized():
        dist.barrier()


def device_with_rank(device: str) -> str:
    """``"cuda"`` -> ``"cuda:<local rank>"``; any other device string unchanged.

    The original used the global rank, which names a device that does not exist past the first node; the
    local rank is the same number on one node.

    Returns:
        The device string.
    """
    return f"cuda:{get_local_rank()}" if device == "cuda" else device


def get_device(local_rank: int | None = None) -> torch.device:
    """This process's device, with the original signature of ``inference_runtime.get_device``.

    Returns:
        Without ``local_rank``, :func:`wf_mesh.legacy.runtime.get_device` (the current CUDA device, else
        CPU); with it, ``cuda:local_rank`` when CUDA is available, else CPU.
    """
    if local_rank is None:
        return runtime.get_device()
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def rank0_only(func: F) -> F:
    """Decorator: ``func`` runs on global rank 0 only (and in a non-distributed process).

    No collective: rank 0 must not wait on the others inside ``func``.

    Returns:
        The wrapped function; on other ranks it returns None at once.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs) if is_rank0() else None

    return wrapper  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class _Rank0Result(agreement.Facts):
    """Nothing travels but the verdict (did rank 0's call raise?); rank 0 keeps its result."""

    value: object = agreement.fact(local=True)


def rank0_first(func: F) -> F:
    """Decorator: global rank 0 runs ``func`` first; the other ranks run it once rank 0 has returned (e.g. rank
    0 downloads or builds a cache, the others then read it). Every rank returns its own result.

    Collective over the default group (one small all-gather where the original had a barrier): every rank must
    call the wrapped function. If ``func`` raises on rank 0, the others do not run it and every rank raises the
    same exception instead of waiting in the barrier: rank 0's type, or its nearest base among the types
    :mod:`wf_mesh.agreement` carries (ValueError, TypeError, OSError, RuntimeError, ...), with a message naming
    the function and rank 0; on rank 0 it is chained to the original exception.

    Returns:
        The wrapped function.
    """
    what = f"rank0_first({getattr(func, '__qualname__', func)!s})"

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if get_world_size() == 1:
            return func(*args, **kwargs)
        first = is_rank0()
        original: BaseException | None = None  # rank 0's own exception, to chain the agreed one to it

        def facts() -> _Rank0Result:
            nonlocal original
            if not first:
                return _Rank0Result(value=None)
            try:
                return _Rank0Result(value=func(*args, **kwargs))
            except BaseException as exc:
                original = exc
                raise

        try:
            agreed = agreement.agree(dist.group.WORLD, facts, what=what, required=True)
        except Exception as reported:
            if original is not None:
                raise reported from original
            raise
        return agreed.mine.value if first else func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
