"""Broadcast a tensor or a small Python value from a group's first rank, without pickle by default.

What travels pickle-free (typed, exact, type kept on receivers): None, bool, int (any size), float,
complex, str (any code points), bytes, Enum members (the class is resolved on receivers by module and
qualified name and must be an Enum subclass: a str-Enum member arrives as that member), tuples, lists and
dicts of these, and tensors of any dtype (also inside containers). Anything else is pickled after a
one-time warning naming the type, unless pickle is turned off (``allow_pickle=False``, or
``WF_MESH_ALLOW_PICKLE=0`` in the environment): then every rank raises a TypeError naming the type. Receiving
ranks must agree to unpickle: one of them turning pickle off is enough to refuse.

Protocol: one agreement exchange (:mod:`wf_mesh.agreement`) carries the kind, sizes and, for a tensor, its
dtype and shape; then the encoded value (one uint8 broadcast) and the tensors' bytes (one more). A tensor is
one broadcast of its bytes; a pickled value one broadcast of its pickle. A problem on the source (an
unsupported object with pickle off, a value pickle cannot take, a DTensor) or a receiver whose tensor does
not match raises on every rank before any data moves: the source's tensor bytes and its pickle are made
while its facts are (a failure there is its verdict). What can fail after the data moved (a receiver's
decode or unpickle, the source's tensor payload) is contained (:mod:`wf_mesh.faults`).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import os
import pickle
import struct
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from wf_mesh import agreement, waits
from wf_mesh.errors import ShapeMismatchError
from wf_mesh.faults import FaultSequence

__all__ = ["broadcast"]

_warned: set[str] = set()


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s data as a flat uint8 tensor (a view when it is contiguous): any dtype travels as bytes."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def tensor_from_bytes(data: torch.Tensor, dtype: torch.dtype, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`bytes_of`: a view of the flat uint8 ``data`` as ``dtype`` of ``shape``."""
    return data.view(dtype).reshape(shape)


# ---- typed encoding -----------------------------------------------------------------------------------
class _Unsupported(TypeError):
    """A value the typed encoding does not cover (it may still be pickled)."""


def _encode(value: Any, out: bytearray, tensors: list[torch.Tensor]) -> None:
    kind = type(value)
    if value is None:
        out += b"N"
    elif kind is bool:
        out += b"T" if value else b"F"
    elif isinstance(value, enum.Enum):
        cls = type(value)
        out += b"E"
        _encode_str(f"{cls.__module__}:{cls.__qualname__}", out)
        _encode_str(value.name, out)
    elif kind is int:
        raw = value.to_bytes((value.bit_length() + 8) // 8 or 1, "little", signed=True)
        out += b"I" + struct.pack("<I", len(raw)) + raw
    elif kind is float:
        out += b"D" + struct.pack("<d", value)
    elif kind is complex:
        out += b"C" + struct.pack("<dd", value.real, value.imag)
    elif kind is str:
        out += b"S"
        _encode_str(value, out)
    elif kind is bytes:
        out += b"B" + struct.pack("<I", len(value)) + value
    elif kind in (tuple, list):
        out += (b"U" if kind is tuple else b"L") + struct.pack("<I", len(value))
        for item in value:
            _encode(item, out, tensors)
    elif kind is dict:
        out += b"M" + struct.pack("<I", len(value))
        for key, item in value.items():
            _encode(key, out, tensors)
            _encode(item, out, tensors)
    elif kind is torch.Tensor or kind is torch.nn.Parameter:
        out += b"X" + struct.pack("<iI", agreement.dtype_code(value.dtype), value.ndim)
        out += struct.pack(f"<{value.ndim}q", *value.shape)
        tensors.append(value)
    else:
        raise _Unsupported(type(value).__qualname__)


def _encode_str(text: str, out: bytearray) -> None:
    raw = text.encode("utf-8", "surrogatepass")  # lone surrogates too: receivers get exactly the same str
    out += struct.pack("<I", len(raw)) + raw


class _Decoder:
    def __init__(self, data: bytes, tensors: list[torch.Tensor]) -> None:
        self.data, self.pos, self.tensors = data, 0, iter(tensors)

    def take(self, n: int) -> bytes:
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def text(self) -> str:
        return self.take(self.unpack("<I")[0]).decode("utf-8", "surrogatepass")

    def value(self) -> Any:
        tag = self.take(1)
        if tag == b"N":
            return None
        if tag in (b"T", b"F"):
            return tag == b"T"
        if tag == b"E":
            return _enum_member(self.text(), self.text())
        if tag == b"I":
            return int.from_bytes(self.take(self.unpack("<I")[0]), "little", signed=True)
        if tag == b"D":
            return self.unpack("<d")[0]
        if tag == b"C":
            return complex(*self.unpack("<dd"))
        if tag == b"S":
            return self.text()
        if tag == b"B":
            return self.take(self.unpack("<I")[0])
        if tag in (b"U", b"L"):
            items = [self.value() for _ in range(self.unpack("<I")[0])]
            return tuple(items) if tag == b"U" else items
        if tag == b"M":
            return {self.value(): self.value() for _ in range(self.unpack("<I")[0])}
        if tag == b"X":
            _, ndim = self.unpack("<iI")  # dtype and shape were read by _tensor_specs
            self.take(8 * ndim)
            return next(self.tensors)
        raise ValueError(f"broadcast: corrupt payload (tag {tag!r} at byte {self.pos - 1})")


def _enum_member(path: str, name: str) -> enum.Enum:
    module, _, qualname = path.partition(":")
    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
        raise TypeError(f"broadcast: {path} is not an Enum class, refusing to build a value of it")
    return cls[name]


def _tensor_specs(data: bytes) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """The dtype and shape of every tensor in an encoded value, in order (to allocate receive buffers)."""
    specs, decoder = [], _Decoder(data, [])
    stack = [1]  # values still to read at each nesting level
    while stack:
        stack[-1] -= 1
        tag = decoder.take(1)
        if tag == b"X":
            code, ndim = decoder.unpack("<iI")
            specs.append((agreement.DTYPES[code], decoder.unpack(f"<{ndim}q")))
        elif tag in (b"U", b"L", b"M"):
            count = decoder.unpack("<I")[0]
            stack.append(count * (2 if tag == b"M" else 1))
        elif tag == b"E":
            decoder.text()
            decoder.text()
        elif tag in (b"I", b"B"):
            decoder.take(decoder.unpack("<I")[0])
        elif tag == b"S":
            decoder.text()
        else:
            decoder.take({b"N": 0, b"T": 0, b"F": 0, b"D": 8, b"C": 16}[tag])
        while stack and stack[-1] == 0:
            stack.pop()
    return specs


def pickle_allowed(allow_pickle: bool | None) -> bool:
    """``allow_pickle`` if given, else the environment: pickle is allowed unless ``WF_MESH_ALLOW_PICKLE=0``."""
    if allow_pickle is not None:
        return bool(allow_pickle)
    return os.environ.get("WF_MESH_ALLOW_PICKLE", "1") != "0"


# ---- broadcast ----------------------------------------------------------------------------------------
_KINDS = ("none", "tensor", "value", "pickle")


@dataclasses.dataclass(frozen=True)
class _BroadcastFacts(agreement.Facts):
    """One rank's side of a broadcast: what the source sends (receivers: what they pass)."""

    kind: str = agreement.fact(choices=_KINDS)
    pickle_ok: bool = agreement.fact(label="pickle allowed")
    value_bytes: int = 0
    """The typed encoding's length (source)."""
    tensor_bytes: int = 0
    """The bytes of the tensors inside the value (source)."""
    dtype: torch.dtype | None = None
    """A tensor passed (source or receiver)."""
    shape: tuple[int, ...] = ()
    encoded: bytes = agreement.fact(local=True, default=b"")
    """For a pickled value, the name of the type the typed encoding does not cover (the source's warning)."""
    tensors: tuple[torch.Tensor, ...] = agreement.fact(local=True, default=())
    """The tensors inside the source's value, in encoding order."""
    sent: torch.Tensor | None = agreement.fact(local=True, default=None)
    """The source's first broadcast, made with its facts: a tensor's bytes, the typed encoding or the pickle,
    as uint8 on the group's device."""

    def shown(self) -> str:
        return f"Tensor{self.shape} {self.dtype}" if self.kind == "tensor" else "no tensor"


def _broadcast_facts(item: Any, is_source: bool, pickle_ok: bool, device: torch.device) -> _BroadcastFacts:
    if isinstance(item, DTensor):
        raise TypeError(
            "broadcast does not take a DTensor (its shards differ per rank); broadcast dtensor.full_tensor() "
            "or redistribute it instead"
        )
    if isinstance(item, torch.Tensor) and type(item) in (torch.Tensor, torch.nn.Parameter):
        sent = bytes_of(item.detach()).to(device) if is_source else None
        return _BroadcastFacts("tensor", pickle_ok, dtype=item.dtype, shape=tuple(item.shape), sent=sent)
    if not is_source:
        return _BroadcastFacts("none" if item is None else "value", pickle_ok)
    if item is None:
        return _BroadcastFacts("none", True)
    encoded = bytearray()
    tensors: list[torch.Tensor] = []
    try:
        _encode(item, encoded, tensors)
    except _Unsupported as exc:
        if not pickle_ok:
            raise TypeError(
                f"broadcast: {exc} values need pickle, which is off (allow_pickle=False or "
                f"WF_MESH_ALLOW_PICKLE=0); send a typed value (None, bool, int, float, complex, str, bytes, "
                f"Enum, tensor, or tuples/lists/dicts of these)"
            ) from None
        try:
            pickled = pickle.dumps(item)
        except Exception as failed:
            raise TypeError(f"cannot pickle the source's value ({exc}): {type(failed).__name__}: {failed}") from None
        sent = torch.frombuffer(bytearray(pickled), dtype=torch.uint8).to(device)
        return _BroadcastFacts("pickle", True, len(pickled), encoded=str(exc).encode(), sent=sent)
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors)
    sent = torch.frombuffer(encoded, dtype=torch.uint8).to(device)
    return _BroadcastFacts("value", True, len(encoded), tensor_bytes, tensors=tuple(tensors), sent=sent)


def broadcast(item: Any, process_group: dist.ProcessGroup | None = None, *, allow_pickle: bool | None = None) -> Any:
    """Broadcast ``item`` from the SMALLEST global rank of ``process_group`` to all of its ranks.

    ``None`` group: returns ``item`` itself (parallelism off); a group of one rank likewise. The source gets
    its own object back; receivers get an equal value of the same type (module docstring), tensors on the
    group's device (CPU on gloo). A receiver may pass anything; a receiver passing a tensor while the source
    sends a tensor must match its ndim and dtype (ShapeMismatchError on every rank otherwise).

    Args:
        item: the source's value (what receivers pass is ignored, but for the tensor check above).
        process_group: the group to broadcast over, or None.
        allow_pickle: allow pickling values the typed encoding does not cover (default: the environment,
            ``WF_MESH_ALLOW_PICKLE``; on by default).

    Returns:
        The source's value on every rank (the source's own object on the source).

    Raises:
        TypeError: (on every rank, before any data moves) a DTensor, or a value that needs pickle while
            pickle is off on any rank.
        ShapeMismatchError: (on every rank) as above.
    """
    if process_group is None or dist.get_world_size(process_group) == 1:
        return item
    ranks = dist.get_process_group_ranks(process_group)
    is_source = dist.get_rank() == ranks[0]
    pickle_ok = pickle_allowed(allow_pickle)
    device = agreement.comm_device(process_group)
    agreed = agreement.agree(
        process_group, lambda: _broadcast_facts(item, is_source, pickle_ok, device), what="broadcast", required=True
    )
    src = agreed.all_rows[0]
    if src.kind == "none":
        return None
    if src.kind == "tensor":
        return _broadcast_tensor(item, agreed, process_group, is_source)
    if src.kind == "pickle":
        return _broadcast_pickled(item, agreed, process_group, is_source)
    mine = agreed.mine
    data = mine.sent if is_source else torch.empty(src.value_bytes, dtype=torch.uint8, device=device)
    assert data is not None, "the source's facts carry its encoding"
    with waits.bounded(process_group, "broadcast"):
        dist.broadcast(data, group=process_group, group_src=0)
    # sent only when there are bytes to send, decided by the source's facts alike on every rank (empty tensors
    # in the value take none)
    # contained (wf_mesh.faults): the source's concatenation and a receiver's decode are local steps
    seq = FaultSequence(process_group, "broadcast")
    payload = torch.empty(0, dtype=torch.uint8, device=device)
    if src.tensor_bytes:
        if is_source:
            payload = seq.step(("tensor payload", 1, 1), _payload_of, mine.tensors, device)
            if payload is None:  # the receivers still expect these bytes
                payload = torch.zeros(src.tensor_bytes, dtype=torch.uint8, device=device)
        else:
            payload = torch.empty(src.tensor_bytes, dtype=torch.uint8, device=device)
        with waits.bounded(process_group, "broadcast"):
            dist.broadcast(payload, group=process_group, group_src=0)
    value = item if is_source else seq.step(("decode", 1, 1), _decoded, data, payload)
    seq.close()
    return value


def _payload_of(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.cat([bytes_of(t.detach()).to(device) for t in tensors])


def _decoded(data: torch.Tensor, payload: torch.Tensor) -> Any:
    raw = data.cpu().numpy().tobytes()
    received, offset = [], 0
    for dtype, shape in _tensor_specs(raw):
        n = torch.Size(shape).numel() * dtype.itemsize
        received.append(tensor_from_bytes(payload[offset : offset + n].clone(), dtype, shape))
        offset += n
    return _Decoder(raw, received).value()


def _broadcast_tensor(
    item: Any, agreed: agreement.Agreed[_BroadcastFacts], group: dist.ProcessGroup, is_source: bool
) -> torch.Tensor:
    src = agreed.all_rows[0]
    disagree = [
        rank
        for rank, row in zip(agreed.ranks, agreed.all_rows)
        if row.kind == "tensor" and (row.dtype, len(row.shape)) != (src.dtype, len(src.shape))
    ]
    if disagree:
        every = ", ".join(f"rank {rank}: {row.shown()}" for rank, row in zip(agreed.ranks, agreed.all_rows))
        raise ShapeMismatchError(
            f"broadcast: ranks {disagree} passed tensors that do not match the source's (rank {agreed.ranks[0]}) "
            f"ndim and dtype; receivers pass None or a tensor of the same ndim and dtype: {every}"
        )
    dtype = src.dtype
    assert dtype is not None, "a tensor's facts carry its dtype"
    # not contained, as nothing needs it: the source's bytes were made with its facts, and a receiver's result
    # is a view of the buffer it received into, so no local step can fail once the data moves
    data = (
        agreed.mine.sent
        if is_source
        else torch.empty(
            torch.Size(src.shape).numel() * dtype.itemsize, dtype=torch.uint8, device=agreement.comm_device(group)
        )
    )
    assert data is not None, "the source's facts carry its bytes"
    if data.numel():
        with waits.bounded(group, "broadcast"):
            dist.broadcast(data, group=group, group_src=0)
    return item if is_source else tensor_from_bytes(data, dtype, src.shape)


def _broadcast_pickled(
    item: Any, agreed: agreement.Agreed[_BroadcastFacts], group: dist.ProcessGroup, is_source: bool
) -> Any:
    refusing = [rank for rank, row in zip(agreed.ranks, agreed.all_rows) if not row.pickle_ok]
    if refusing:
        raise TypeError(
            f"broadcast: the source's value needs pickle and ranks {refusing} turned pickle off "
            "(allow_pickle=False or WF_MESH_ALLOW_PICKLE=0); send a typed value instead"
        )
    type_name = agreed.mine.encoded.decode()
    if is_source and type_name not in _warned:
        _warned.add(type_name)
        warnings.warn(
            f"wf_mesh.broadcast: pickling a {type_name} (not a typed value); pass allow_pickle=False "
            "or set WF_MESH_ALLOW_PICKLE=0 to forbid pickle",
            stacklevel=3,
        )
    # one broadcast of the pickle (its size agreed; the source's bytes made with its facts), then a receiver's
    # unpickle, contained: an object whose unpickling raises on one receiver raises on every rank
    data = (
        agreed.mine.sent
        if is_source
        else torch.empty(agreed.all_rows[0].value_bytes, dtype=torch.uint8, device=agreement.comm_device(group))
    )
    assert data is not None, "the source's facts carry its pickle"
    with waits.bounded(group, "broadcast"):
        dist.broadcast(data, group=group, group_src=0)
    seq = FaultSequence(group, "broadcast")
    value = item if is_source else seq.step(("unpickle", 1, 1), _unpickled, data)
    seq.close()
    return value


def _unpickled(data: torch.Tensor) -> Any:
    """The object pickled in the uint8 tensor ``data`` (any device)."""
    return pickle.loads(data.cpu().numpy().tobytes())
