"""Agree before acting: one small all-gather in front of every collective wf_mesh issues.

A collective goes wrong when ranks do not call it the same way: one rank raises on a bad argument while its
peers wait in the collective (a hang until the timeout), or ranks pass different sizes (gloo aborts the
process, or data arrives in the wrong place). So every wf_mesh entry point that issues a collective first
calls :func:`agree`: each rank computes its *facts*, a :class:`Facts` record whose named fields decide what
the collective will do (shapes, dtypes, ``seq_dim``, ``seq_len``, a bucket size, ...), and its own validation
runs while it does. One all-gather of a fixed-size int64 row per rank then tells every rank the records and
the verdict of every other rank, and all of them continue, or all of them raise the same exception:

- a rank whose validation raised: every rank raises that exception's type, with a message naming the rank(s)
  and what each said (a second, small all-gather carries the messages; it runs on this error path only);
- ranks inside different wf_mesh calls at once (e.g. ``gather_sequence`` here, ``broadcast`` there):
  :class:`~wf_mesh.errors.DisagreementError` naming each rank's call;
- facts that must be equal and are not (:meth:`Agreed.require_same`, by field name): DisagreementError
  naming the field (its label) and each rank's value.

A call site declares its record once::

    @dataclasses.dataclass(frozen=True)
    class _GatherFacts(agreement.Facts):
        seq_dim: int
        seq_len: int | None
        grad: str = agreement.fact(choices=("replicate", "partial"))
        local_shape: tuple[int, ...]
        unwrapped: object = agreement.fact(local=True)   # stays on this rank (Agreed.mine)

    agreed = agreement.agree(group, lambda: _GatherFacts(...), what="gather_sequence")
    agreed.require_same("seq_dim")    # "gather_sequence: ranks disagree on seq_dim (rank 0: 1; rank 1: 2)"

Cost: one all-gather of ``ROW`` int64 per rank and call. Where the exchange only validates (the data
collective would work without it), :func:`checks_enabled` can turn it off: set ``WF_MESH_CHECKS=0`` in the
environment of every rank, or pass ``checks=False`` to :func:`~wf_mesh.init_parallel` (ranks agree on it when
the mesh is built). It is deliberately not a per-call switch: a rank that skips the exchange while a peer
does not meets that peer's exchange with its data collective, which is exactly the crash this prevents.
Exchanges that carry what receivers need (a broadcast's shape) always run.

:func:`verdict` is the cheap form for an exchange that carries no facts, only "did every rank succeed"
(fault containment closes each contained sequence with one): one all-reduce of a single int64 word; the full
exchange above runs only when a rank failed, and reports exactly as it does.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import os
import struct
import threading
import types
import typing
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from wf_mesh import _compat, errors, waits

__all__ = ["Agreed", "Facts", "agree", "checks_enabled", "comm_device", "fact", "verdict"]

ROW = 48
"""int64 slots each rank contributes per exchange: ``[call, status, error bytes, number of facts, *facts]``."""

MAX_FACTS = ROW - 4

_OK, _RAISED = 0, 1

DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.complex32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.uint16,
    torch.uint32,
    torch.uint64,
)
"""Every dtype a fact can name, by index (:func:`dtype_code`); the order is fixed (it is the wire format)."""

_DTYPE_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}

# Exception types that travel by index (what a rank raised is re-raised as the same type everywhere).
# Most specific first: a type is encoded as the first entry it is an instance of.
_TYPES: tuple[type[BaseException], ...] = (
    errors.ShapeMismatchError,
    errors.DisagreementError,
    errors.IndivisibleSequenceError,
    errors.NotInitializedError,
    errors.StateError,
    errors.DegreeError,
    IndexError,
    KeyError,
    TypeError,
    ValueError,
    NotImplementedError,
    FileNotFoundError,
    ImportError,
    OSError,
    torch.OutOfMemoryError,
    RuntimeError,
    MemoryError,
    Exception,
)

F = TypeVar("F", bound="Facts")

_checks: bool | None = None  # set while a mesh built with an explicit choice is alive


def checks_enabled() -> bool:
    """Whether validation-only exchanges run: the mesh's ``checks``, else ``WF_MESH_CHECKS`` (on unless ``"0"``)."""
    if _checks is not None:
        return _checks
    return os.environ.get("WF_MESH_CHECKS", "1") != "0"


def set_checks(value: bool | None) -> None:
    """Set this process's checks (None: back to the environment). :func:`~wf_mesh.init_parallel` calls it once
    the ranks agreed on ``checks``; anything else calling it must do so on every rank alike (a rank that skips
    an exchange its peers run crashes them)."""
    global _checks
    _checks = value


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device collectives on ``group`` use: the current CUDA device for NCCL, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dtype_code(dtype: torch.dtype) -> int:
    """The fact that names ``dtype`` (its index in :data:`DTYPES`); ValueError for a dtype not listed."""
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no wire code; supported: {[str(d) for d in DTYPES]}") from None


def float_bits(value: float) -> int:
    """A float as an int64 fact (its IEEE-754 bits), so that floats can be agreed on exactly."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def bits_float(bits: int) -> float:
    """The float whose IEEE-754 bits :func:`float_bits` returned."""
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


# ---------------------------------------------------------------------------------------------------------
# Facts as named records
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Kind:
    """How one field travels: its slots on the wire, and how a value is written, read back and shown."""

    name: str
    encode: Callable[[object], list[int]]
    decode: Callable[[list[int]], tuple[object, list[int]]]  # (value, the slots left)


def _one(to_int: Callable[[object], int], from_int: Callable[[int], object]) -> tuple[Callable, Callable]:
    return (lambda v: [to_int(v)]), (lambda s: (from_int(s[0]), s[1:]))


def _tuple_encode(value: object) -> list[int]:
    values = [int(v) for v in value]  # type: ignore[attr-defined]
    return [len(values), *values]


_KINDS: dict[object, tuple[str, Callable, Callable]] = {
    bool: ("bool", *_one(lambda v: int(bool(v)), bool)),
    int: ("int", *_one(int, int)),  # type: ignore[arg-type]
    float: ("float", *_one(float_bits, bits_float)),  # type: ignore[arg-type]
    torch.dtype: ("dtype", *_one(dtype_code, lambda i: DTYPES[i])),  # type: ignore[arg-type]
    tuple[int, ...]: ("tuple[int, ...]", _tuple_encode, lambda s: (tuple(s[1 : 1 + s[0]]), s[1 + s[0] :])),
}
KINDS = "bool, int, float, torch.dtype, tuple[int, ...], any of these | None, or a fact() with choices"
"""What a wire field may be (for messages)."""


def _optional(inner: _Kind) -> _Kind:
    """``inner | None``: a presence slot, then the value's slots when present."""

    def decode(slots: list[int]) -> tuple[object, list[int]]:
        return (None, slots[1:]) if not slots[0] else inner.decode(slots[1:])

    return _Kind(f"{inner.name} | None", lambda v: [0] if v is None else [1, *inner.encode(v)], decode)


def _kind_of(annotation: object, choices: Sequence[object] | None) -> _Kind:
    if choices is not None:
        options = tuple(choices)

        def to_index(v: object) -> int:
            if v not in options:
                raise ValueError(f"{v!r} is not one of {list(options)}")
            return options.index(v)

        return _Kind("choice", *_one(to_index, lambda i: options[i]))
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        return _optional(_kind_of(inner, None))
    for key, (name, encode, decode) in _KINDS.items():
        if annotation == key:
            return _Kind(name, encode, decode)
    raise TypeError(f"a fact must be {KINDS}; got {annotation}")


def fact(
    *,
    label: str | None = None,
    choices: Sequence[object] | None = None,
    local: bool = False,
    default: object = dataclasses.MISSING,
) -> Any:
    """Declare a field of a :class:`Facts` record.

    Args:
        label: how messages name the field (default: its name).
        choices: the values the field may take (any objects, compared with ``==``); it travels as an index.
        local: the value stays on this rank (``Agreed.mine``): results of the validation the caller needs,
            such as unwrapped tensors. Local fields are not exchanged and cannot be compared.
        default: the field's default value (as a dataclass default).

    Returns:
        A dataclass field carrying these settings.
    """
    return dataclasses.field(default=default, metadata={"label": label, "choices": choices, "local": local})


class Facts:
    """Base of an agreement record: a frozen dataclass whose fields are the facts one rank reports.

    Subclass it with ``@dataclasses.dataclass(frozen=True)``. Each field is a bool, int, float (exact: its
    IEEE-754 bits), torch.dtype, ``tuple[int, ...]``, any of these ``| None``, or a :func:`fact` with
    ``choices``; :func:`fact` also sets the label messages use and marks ``local`` fields, which stay on this
    rank. The wire is one fixed-size int64 row: the fields in declaration order, each in the slots its kind
    takes (one per scalar; a tuple its length plus one; ``| None`` one more); at most ``MAX_FACTS`` in all.
    """

    @classmethod
    def _wire_fields(cls) -> list[tuple[dataclasses.Field, _Kind]]:
        cached = cls.__dict__.get("_wire_cache")
        if cached is None:
            hints = typing.get_type_hints(cls)
            cached = [
                (f, _kind_of(hints[f.name], f.metadata.get("choices")))
                for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                if not f.metadata.get("local")
            ]
            cls._wire_cache = cached  # type: ignore[attr-defined]
        return cached

    @classmethod
    def label(cls, name: str) -> str:
        """How messages name field ``name``."""
        field = {f.name: f for f in dataclasses.fields(cls)}[name]  # type: ignore[arg-type]
        return field.metadata.get("label") or name

    def encode(self) -> list[int]:
        """The record's wire slots (local fields left out)."""
        slots: list[int] = []
        for field, kind in self._wire_fields():
            try:
                slots += kind.encode(getattr(self, field.name))
            except (TypeError, ValueError) as exc:
                raise TypeError(f"{type(self).__name__}.{field.name}: {exc}") from None
        return slots

    @classmethod
    def decode(cls: type[F], slots: Sequence[int]) -> F:
        """A record from its wire slots; local fields are None."""
        rest, values = list(slots), {}
        for field, kind in cls._wire_fields():
            values[field.name], rest = kind.decode(rest)
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            values.setdefault(field.name, None)
        return cls(**values)


@functools.lru_cache(maxsize=256)
def _call_code(what: str) -> int:
    return zlib.crc32(what.encode()) & 0x7FFFFFFF


def header_row(what: str, facts: Facts, device: torch.device | str = "cpu") -> torch.Tensor:
    """One rank's row in the wire format of every header wf_mesh sends (also point to point: the pipeline's
    checked mode sends one before each payload).

    Returns:
        An int64 tensor of ``ROW`` slots on ``device``.
    """
    slots = _slots(what, facts)
    row = torch.zeros(ROW, dtype=torch.int64)
    row[: 4 + len(slots)] = torch.tensor([_call_code(what), _OK, 0, len(slots), *slots], dtype=torch.int64)
    return row.to(device)


@typing.overload
def read_header(row: torch.Tensor, what: str, schema: None = None) -> tuple[int, ...] | None: ...
@typing.overload
def read_header(row: torch.Tensor, what: str, schema: type[F]) -> F | None: ...
def read_header(row: torch.Tensor, what: str, schema: type[F] | None = None) -> F | tuple[int, ...] | None:
    """The facts of a :func:`header_row` sent by ``what``.

    Returns:
        A ``schema`` record, else the raw ints; None if the row is not such a header.
    """
    values = row.tolist()
    if values[0] != _call_code(what) or values[1] != _OK or not 0 <= values[3] <= MAX_FACTS:
        return None
    slots = tuple(values[4 : 4 + values[3]])
    return slots if schema is None else schema.decode(slots)


def _slots(what: str, facts: Facts) -> list[int]:
    if not isinstance(facts, Facts):
        raise TypeError(f"{what}: the facts function must return a Facts record, got {type(facts).__name__}")
    slots = facts.encode()
    if len(slots) > MAX_FACTS:
        raise ValueError(
            f"{what}: {type(facts).__name__} takes {len(slots)} wire slots, more than the {MAX_FACTS} of one agreement row "
            "(a long tuple field?); send fewer facts, e.g. a crc of a long shape"
        )
    return slots


def _type_code(exc: BaseException) -> int:
    return next(i for i, t in enumerate(_TYPES) if isinstance(exc, t))


def _describe_ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def _by_value(ranks: Sequence[int], values: Sequence[object]) -> str:
    """``"rank 0: a; ranks [1, 3]: b"``: ranks grouped by value, in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for rank, value in zip(ranks, values):
        groups.setdefault(str(value), []).append(rank)
    return "; ".join(f"{_describe_ranks(rs)}: {value}" for value, rs in groups.items())


@dataclasses.dataclass(frozen=True)
class Agreed(Generic[F]):
    """What every rank of the group reported, in group-rank order (the same object on every rank), and this
    rank's own record with its local fields."""

    what: str
    ranks: list[int]
    """Global ranks of the group, in group-rank order."""
    rows: list[F] | None
    """Each rank's record as exchanged (local fields None); None when the exchange did not run (checks off)."""
    mine: F
    """This rank's record, local fields included."""

    @property
    def exchanged(self) -> bool:
        """Whether the ranks exchanged their facts (False: checks off, only this rank's validation ran)."""
        return self.rows is not None

    @property
    def all_rows(self) -> list[F]:
        """:attr:`rows` of an exchange that ran (``required=True``, or checks on).

        Raises:
            RuntimeError: the facts were not exchanged (checks are off).
        """
        if self.rows is None:
            raise RuntimeError(f"{self.what}: the facts were not exchanged (checks are off)")
        return self.rows

    def values(self, name: str) -> list:
        """Field ``name`` of every rank's record, in group-rank order (of :attr:`all_rows`)."""
        return [getattr(row, name) for row in self.all_rows]

    def require_same(
        self,
        *names: str,
        key: Callable[[F], object] | None = None,
        label: str | None = None,
        error: type[errors.DisagreementError] = errors.DisagreementError,
        hint: str = "",
    ) -> None:
        """Raise ``error`` on every rank unless the fields ``names`` (or ``key(record)``) are equal on all ranks.

        The message names the fields (their labels, or ``label``) and each rank's value. Nothing to check when
        the exchange did not run.

        Raises:
            TypeError: neither ``names`` nor ``key`` given, or a ``key`` without its ``label``.
        """
        if self.rows is None:
            return
        if key is None:
            if not names:
                raise TypeError("require_same needs field names or a key")
            schema = type(self.rows[0])
            key = (
                (lambda r: getattr(r, names[0])) if len(names) == 1 else (lambda r: tuple(getattr(r, n) for n in names))
            )
            labels = [schema.label(n) for n in names]
            label = label or (labels[0] if len(labels) == 1 else "(" + ", ".join(labels) + ")")
        elif label is None:
            raise TypeError("require_same with a key needs its label")
        values = [key(row) for row in self.rows]
        if any(v != values[0] for v in values[1:]):
            raise error(f"{self.what}: ranks disagree on {label} ({_by_value(self.ranks, values)}){hint}")


def agree(
    group: dist.ProcessGroup | None,
    facts: Callable[[], F],
    *,
    what: str,
    required: bool = False,
) -> Agreed[F]:
    """Run ``facts()`` (this rank's validation and facts) and exchange the result with every rank of ``group``.

    Returns the :class:`Agreed` records of all ranks. When the exchange is validation only (``required=False``)
    and :func:`checks_enabled` is off, only ``facts()`` runs (its exception, if any, is raised on this rank
    only) and the result has ``rows=None``. If any rank's ``facts()`` raised, or ranks are in different calls
    (``what``), every rank raises (see the module docstring) and no data collective follows.

    Args:
        group: the group the following collective runs on (None: the default group).
        facts: returns this rank's :class:`Facts` record (at most ``MAX_FACTS`` slots on the wire); whatever
            it raises is this rank's verdict.
        what: the call's name, e.g. ``"gather_sequence"``; it starts every message.
        required: the caller needs the other ranks' facts (not just validation): never skipped.

    Returns:
        The agreed records; ``mine`` is this rank's own, local fields included.

    Raises:
        DisagreementError: ranks are in different calls (a failing rank's exception type is raised as said).
    """
    ranks = dist.get_process_group_ranks(group)
    if not required and not checks_enabled():
        return Agreed(what, ranks, None, facts())
    message = b""
    mine: F | None = None
    try:
        mine = facts()
        slots = _slots(what, mine)
        status = _OK
    except Exception as exc:
        slots, status = [], _RAISED
        text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
        text = text.removeprefix(f"{what}: ")
        if _TYPES[_type_code(exc)] is Exception:
            text = f"{type(exc).__name__}: {text}"
        message = f"{_type_code(exc)}:{text}".encode("utf-8", "backslashreplace")
    row = [_call_code(what), status, len(message), len(slots), *slots]
    row += [0] * (ROW - len(row))
    size, device = len(ranks), comm_device(group)
    # the cheapest host row (this exchange starts every checked call); it outlives the blocking all-gather
    sent = torch.frombuffer(array.array("q", row), dtype=torch.int64).to(device)
    gathered = torch.empty(size * ROW, dtype=torch.int64, device=device)
    with waits.bounded(group, what):
        _compat.all_gather_single(gathered, sent, group=group)
    table = gathered.view(size, ROW).tolist()
    calls = [r[0] for r in table]
    if any(c != calls[0] for c in calls) or any(r[1] != _OK for r in table):
        same_call = all(c == calls[0] for c in calls)
        if not same_call:  # each rank says which call it is in
            message = what.encode()
        with waits.bounded(group, what):
            texts = _gather_messages(message, [r[2] if same_call else -1 for r in table], group, device)
        if not same_call:
            raise errors.DisagreementError(
                f"ranks are in different wf_mesh calls at once ({_by_value(ranks, texts)}); every rank of the "
                "group must make the same collective calls in the same order"
            )
        _raise_reported(what, ranks, texts)
    received = [tuple(r[4 : 4 + r[3]]) for r in table]
    assert mine is not None  # the exchange reports a rank whose facts() raised
    return Agreed(what, ranks, [type(mine).decode(r) for r in received], mine)


def verdict(group: dist.ProcessGroup | None, facts: Callable[[], Facts], *, what: str) -> None:
    """A required exchange of facts that carry nothing but success: :func:`agree`'s verdict, cheaper where
    every rank succeeds.

    One all-reduce (max) of ONE int64 word per rank, 1 if this rank's ``facts()`` raised, else 0. Only when a
    rank failed do all ranks run :func:`agree` with the same ``facts``, which raises on every rank as it says.
    Why one word: it is the cheapest collective there is (gloo's ring all-reduce takes two to three times as
    long from three words on with 4 processes, and :func:`agree`'s all-gather of rows as much). What it does
    not check: that the ranks are in the same call (the agreement that starts a checked call does).

    Args:
        group: the group (None: the default group).
        facts: this rank's verdict: returns a record with no fields, or raises (the failure to report).
        what: the call's name, as for :func:`agree`.

    Raises:
        As :func:`agree`: a failing rank's exception type on every rank.
        RuntimeError: (on every rank) ``facts()`` raised on some rank in the first exchange but not in the
            full one (it must give the same verdict when called again).
    """
    try:
        facts()
        failed = 0
    except Exception:
        failed = 1
    with _compat.outside_fake_mode():  # a host-side word, real even where a fake-tensor test runs the call
        word = _verdict_word(group).fill_(failed)
        with waits.bounded(group, what):
            dist.all_reduce(word, op=dist.ReduceOp.MAX, group=group)
        if word.item():
            agree(group, facts, what=what, required=True)
            raise RuntimeError(f"{what}: a rank's verdict changed between two exchanges (facts() must be repeatable)")


_verdict_words = threading.local()  # per thread: .by_device, {device: the one-word buffer}


def _verdict_word(group: dist.ProcessGroup | None) -> torch.Tensor:
    """This thread's one-word buffer on ``group``'s device, reused by every verdict (each is synchronous; with 4
    processes gloo takes ~0.2 ms longer to reduce a freshly allocated tensor).

    Returns:
        The buffer (its value is the last verdict's).
    """
    device = comm_device(group)
    words: dict[torch.device, torch.Tensor] = _verdict_words.__dict__.setdefault("by_device", {})
    word = words.get(device)
    if word is None:
        word = words[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return word


def _gather_messages(
    message: bytes, lengths: list[int], group: dist.ProcessGroup | None, device: torch.device
) -> list[str]:
    """All-gather each rank's UTF-8 message (``lengths[i] < 0``: the length is not known, exchange it first)."""
    if any(n < 0 for n in lengths):
        mine = torch.tensor([len(message)], dtype=torch.int64, device=device)
        every = torch.empty(len(lengths), dtype=torch.int64, device=device)
        _compat.all_gather_single(every, mine, group=group)
        lengths = every.tolist()
    width = max(max(lengths), 1)
    padded = torch.zeros(width, dtype=torch.uint8)
    if message:
        padded[: len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
    every = torch.empty(len(lengths) * width, dtype=torch.uint8, device=device)
    _compat.all_gather_single(every, padded.to(device), group=group)
    rows = every.view(len(lengths), width).cpu()
    return [bytes(rows[i, :n].tolist()).decode("utf-8", "replace") for i, n in enumerate(lengths)]


def _raise_reported(what: str, ranks: list[int], texts: list[str]) -> None:
    reported = [(rank, text.partition(":")) for rank, text in zip(ranks, texts) if text]
    first_type = _TYPES[int(reported[0][1][0])]
    failing = [rank for rank, _ in reported]
    bodies = [body for _, (_, _, body) in reported]
    if len(failing) == len(ranks) and len(set(bodies)) == 1:  # every rank found the same problem
        raise first_type(f"{what}: {bodies[0]}")
    raise first_type(f"{what}: {_by_value(failing, bodies)} (raised on every rank of the group {ranks})")
