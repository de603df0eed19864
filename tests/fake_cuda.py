"""Run CUDA code paths on a CPU-only build: fake CUDA tensors, torch's ``fake`` process group, an op recorder.

- :func:`fake_process_group`: this process as rank ``rank`` of ``world_size`` on torch's ``fake`` backend (no
  data moves; an all-gather hands back this rank's input in every slot, i.e. every simulated peer made the
  same call); :func:`fake_cuda`: a ``FakeTensorMode`` in which ``device="cuda"`` tensors have shapes, dtypes
  and strides from torch's CUDA kernels' meta functions but no memory.
- On a CPU-only build the Python bindings of ``x[...]``, ``x[...] = y``, ``.contiguous()``, ``.copy_()`` and ``~x`` take
  a CUDA device guard and raise ("not linked with support for cuda devices") for fake CUDA tensors, while the
  same aten ops run: :class:`RouteIndexing` (a TorchFunctionMode) sends those four through ``torch.ops.aten``.
- :class:`OpRecorder` (a dispatch mode) records every aten op with its outputs' sizes and strides.
- Autograd on fake CUDA tensors aborts the process on a CPU-only build: backward code is called directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from wf_mesh import _compat

aten = torch.ops.aten


def _is_cuda(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cuda"


def _index(x: torch.Tensor, index: object) -> torch.Tensor:
    """``x[index]`` for ints, slices, None and Ellipsis, through aten view ops."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(i, torch.Tensor) or isinstance(i, list) for i in items):
        raise NotImplementedError(f"fake CUDA indexing with tensors or lists: {index!r}")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        named = sum(1 for i in items if i is not None and i is not Ellipsis)
        items[at : at + 1] = [slice(None)] * (x.ndim - named)
    dim = 0
    for item in items:
        if item is None:
            x = aten.unsqueeze.default(x, dim)
            dim += 1
        elif isinstance(item, int):
            x = aten.select.int(x, dim, item)
        else:
            start, stop, step = item.indices(x.shape[dim])
            x = aten.slice.Tensor(x, dim, start, max(stop, start), step)
            dim += 1
    return x


class RouteIndexing(TorchFunctionMode):
    """Indexing, index assignment, ``contiguous``, ``copy_`` and ``~`` of CUDA tensors through ``torch.ops.aten``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and _is_cuda(args[0]):
            x = args[0]
            if func is torch.Tensor.__getitem__:
                return _index(x, args[1])
            if func is torch.Tensor.__setitem__:
                view, value = _index(x, args[1]), args[2]
                if isinstance(value, torch.Tensor):
                    aten.copy_.default(view, value)
                else:
                    aten.fill_.Scalar(view, value)
                return None
            if func is torch.Tensor.contiguous:
                if x.is_contiguous():
                    return x
                return aten.clone.default(x, memory_format=torch.contiguous_format)
            if func is torch.Tensor.copy_:
                return aten.copy_.default(x, args[1])
            if func is torch.Tensor.__invert__:
                return aten.bitwise_not.default(x)
        return func(*args, **kwargs)


def _tensors(out: object) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            yield from _tensors(item)


@dataclasses.dataclass(frozen=True)
class Op:
    """One aten op and its tensor outputs' ``(sizes, strides)``."""

    name: str
    outputs: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


class OpRecorder(_compat.dispatch_mode()):
    """Records every op dispatched while active into ``ops``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = list(_tensors(out))
        self.ops.append(Op(str(func), tuple((tuple(t.shape), tuple(t.stride())) for t in tensors)))
        return out

    def names(self, contains: str) -> set[str]:
        """Names of the recorded ops containing ``contains``."""
        return {op.name for op in self.ops if contains in op.name}

    def quadratic(self, length: int) -> list[Op]:
        """Ops that produced a tensor with two or more dims of at least ``length`` elements that are not
        broadcast (stride 0): a ``length x length`` grid in memory."""
        return [
            op
            for op in self.ops
            if any(sum(1 for n, s in zip(size, stride) if n >= length and s != 0) >= 2 for size, stride in op.outputs)
        ]


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as ``rank`` of ``world_size`` on torch's fake backend (build meshes inside, before
    :func:`fake_cuda`: a DeviceMesh reads its rank tensor)."""
    if dist.is_initialized():
        raise RuntimeError("fake_process_group: a default process group already exists in this process")
    dist.init_process_group("fake", store=_compat.fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_cuda() -> Iterator[OpRecorder]:
    """Fake tensors (CUDA ones included) with the routing of :class:`RouteIndexing`; yields the
    :class:`OpRecorder` of every op inside."""
    recorder = OpRecorder()
    with _compat.fake_tensor_mode(), RouteIndexing(), recorder:
        yield recorder
