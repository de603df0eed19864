"""Small, safe collectives: agree on tensor metadata across a group, and broadcast a tensor or str.

Every rank first all-gathers a tiny int64 header (kind, dtype, shape). All ranks then see the same
facts and either all go on or all raise the same exception: a rank whose tensor disagrees never leaves
its peers hanging in the data collective, and gloo never sees mismatched sizes (which can abort it).
No pickle anywhere: strings travel as UTF-8 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["DTYPES", "DTYPE_CODES", "ShapeMismatchError", "TensorHeader", "broadcast", "exchange_headers", "group_device"]

MAX_NDIM = 8
# Fixed dtype codes (no pickle) for every header wf_mesh exchanges (collectives, pipeline): index into this tuple.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64,
)  # fmt: skip
DTYPE_CODES: dict[torch.dtype, int] = {dtype: code for code, dtype in enumerate(DTYPES)}
KIND_NONE, KIND_TENSOR, KIND_STR, KIND_UNSUPPORTED = 0, 1, 2, 3
_KIND_NAMES = {KIND_NONE: "None", KIND_TENSOR: "Tensor", KIND_STR: "str"}


class ShapeMismatchError(RuntimeError, ValueError):
    """Ranks disagree about a tensor's shape or dtype. Raised on every rank, before any data moves.

    Both RuntimeError (what legacy callers catch around a failed gather) and ValueError (what it is).
    """


class TensorHeader(tuple):
    """``(kind, dtype_code, ndim, *shape)`` as exchanged between ranks; see :func:`exchange_headers`."""

    @classmethod
    def of(cls, item: object) -> TensorHeader:
        if item is None:
            return cls((KIND_NONE, -1, 0))
        if isinstance(item, str):
            return cls((KIND_STR, DTYPE_CODES[torch.uint8], 1, len(item.encode("utf-8"))))
        if isinstance(item, torch.Tensor):
            if item.dtype not in DTYPES or item.ndim > MAX_NDIM:
                return cls((KIND_UNSUPPORTED, -1, 0))
            return cls((KIND_TENSOR, DTYPE_CODES[item.dtype], item.ndim, *item.shape))
        return cls((KIND_UNSUPPORTED, -1, 0))

    @property
    def kind(self) -> int:
        return self[0]

    @property
    def dtype(self) -> torch.dtype | None:
        return DTYPES[self[1]] if self[1] >= 0 else None

    @property
    def ndim(self) -> int:
        return self[2]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self[3 : 3 + self.ndim])

    def describe(self) -> str:
        if self.kind == KIND_TENSOR:
            return f"Tensor{tuple(self.shape)} {self.dtype}"
        return _KIND_NAMES.get(self.kind, "unsupported")


def group_device(group: dist.ProcessGroup) -> torch.device:
    """Device a collective on ``group`` runs on: the current CUDA device for NCCL, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exchange_headers(item: object, group: dist.ProcessGroup) -> list[TensorHeader]:
    """All-gather every rank's :class:`TensorHeader` of ``item`` over ``group`` (in group-rank order)."""
    header = list(TensorHeader.of(item))
    padded = torch.full((3 + MAX_NDIM,), -1, dtype=torch.int64)
    padded[: len(header)] = torch.tensor(header, dtype=torch.int64)
    size = dist.get_world_size(group)
    out = torch.empty(size * padded.numel(), dtype=torch.int64, device=group_device(group))
    dist.all_gather_single(out, padded.to(out.device), group=group)
    rows = out.view(size, -1).tolist()
    return [TensorHeader(row[: 3 + max(row[2], 0)]) for row in rows]


def _describe_all(headers: Sequence[TensorHeader], ranks: Sequence[int]) -> str:
    return ", ".join(f"rank {r}: {h.describe()}" for r, h in zip(ranks, headers))


def _utf8(text: str) -> torch.Tensor:
    data = bytearray(text.encode("utf-8"))
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def broadcast(
    item: torch.Tensor | str | None, process_group: dist.ProcessGroup | None = None
) -> torch.Tensor | str | None:
    """Broadcast a tensor or str from the SMALLEST global rank of ``process_group`` to all of its ranks.

    ``None`` group: returns ``item`` itself (parallelism off); a group of one rank likewise. If the source
    passes None every rank gets None. Tensors: the source's shape and dtype travel first; a receiver may
    pass a tensor of the same ndim and dtype (its values are ignored) or None, and gets a new tensor on
    the group's device. The source gets its own object back. No pickle: a str travels as UTF-8 bytes.

    Raises (on every rank, before any data moves): TypeError for anything but Tensor/str/None;
    ShapeMismatchError when a receiver's tensor differs from the source's in ndim or dtype.
    """
    if process_group is None or dist.get_world_size(process_group) == 1:
        return item
    ranks = dist.get_process_group_ranks(process_group)
    headers = exchange_headers(item, process_group)
    bad = [(r, h) for r, h in zip(ranks, headers) if h.kind == KIND_UNSUPPORTED]
    if bad:
        r = bad[0][0]
        what = type(item).__name__ if dist.get_rank() == r else "an unsupported type or dtype"
        raise TypeError(
            f"broadcast supports torch.Tensor (up to {MAX_NDIM} dims, dtypes {[str(d) for d in DTYPES]}), "
            f"str and None; rank {r} passed {what} (ranks with unsupported items: {[r for r, _ in bad]})"
        )
    src = headers[0]
    if src.kind == KIND_NONE:
        return None
    disagree = [
        r for r, h in zip(ranks, headers)
        if h.kind != KIND_NONE and (h.kind != src.kind or (h.kind == KIND_TENSOR and (h.ndim, h.dtype) != (src.ndim, src.dtype)))
    ]  # fmt: skip
    if disagree:
        raise ShapeMismatchError(
            f"broadcast: ranks {disagree} passed items that do not match the source (rank {ranks[0]}); "
            f"receivers must pass None or the same kind (a tensor of the same ndim and dtype): "
            f"{_describe_all(headers, ranks)}"
        )
    device = group_device(process_group)
    is_src = dist.get_rank() == ranks[0]
    if is_src:
        payload = _utf8(item) if src.kind == KIND_STR else item
        payload = payload.to(device).contiguous()
    else:
        payload = torch.empty(src.shape, dtype=src.dtype, device=device)
    if payload.numel():
        dist.broadcast(payload, group=process_group, group_src=0)
    if is_src:
        return item
    if src.kind == KIND_STR:
        return bytes(payload.cpu().tolist()).decode("utf-8")
    return payload
