"""Agree before acting: one small all-gather in front of every collective wf_mesh issues.

A collective goes wrong when ranks do not call it the same way: one rank raises on a bad argument while its
peers wait in the collective (a hang until the timeout), or ranks pass different sizes (gloo aborts the
process, or data arrives in the wrong place). So every wf_mesh entry point that issues a collective first
calls :func:`agree`: each rank computes its *facts* (the integers that decide what the collective will do:
shapes, dtypes, ``seq_dim``, ``seq_len``, a bucket size, ...), and its own validation runs while it does.
One all-gather of a fixed-size int64 row per rank then tells every rank the facts and the verdict of every
other rank, and all of them continue, or all of them raise the same exception:

- a rank whose validation raised: every rank raises that exception's type, with a message naming the rank(s)
  and what each said (a second, small all-gather carries the messages; it runs on this error path only);
- ranks inside different wf_mesh calls at once (e.g. ``gather_sequence`` here, ``broadcast`` there):
  :class:`~wf_mesh.errors.DisagreementError` naming each rank's call;
- facts that must be equal and are not (:meth:`Agreed.require_same`): DisagreementError naming each value.

Cost: one all-gather of ``ROW`` int64 per rank and call. Where the exchange only validates (the data
collective would work without it), :func:`checks_enabled` can turn it off: set ``WF_MESH_CHECKS=0`` in the
environment of every rank, or pass ``checks=False`` to :func:`~wf_mesh.init_parallel` (ranks agree on it when
the mesh is built). It is deliberately not a per-call switch: a rank that skips the exchange while a peer
does not meets that peer's exchange with its data collective, which is exactly the crash this prevents.
Exchanges that carry what receivers need (a broadcast's shape) always run.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import zlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from wf_mesh import errors

__all__ = ["Agreed", "agree", "checks_enabled", "comm_device"]

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
    errors.PipelineStateError,
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
    RuntimeError,
    Exception,
)

_checks: bool | None = None  # set while a mesh built with an explicit choice is alive


def checks_enabled() -> bool:
    """Whether validation-only exchanges run: the current mesh's ``checks`` setting, else ``WF_MESH_CHECKS``
    (anything but ``"0"`` means on; the default is on)."""
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


def _call_code(what: str) -> int:
    return zlib.crc32(what.encode()) & 0x7FFFFFFF


def header_row(what: str, facts: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """One rank's row as an int64 tensor of ``ROW`` (the wire format of every header wf_mesh sends, also
    point to point: the pipeline's checked mode sends one before each payload)."""
    facts = [int(f) for f in facts]
    if len(facts) > MAX_FACTS:
        raise ValueError(f"{what}: too many facts for a header ({len(facts)} > {MAX_FACTS})")
    row = torch.zeros(ROW, dtype=torch.int64)
    row[: 4 + len(facts)] = torch.tensor([_call_code(what), _OK, 0, len(facts), *facts], dtype=torch.int64)
    return row.to(device)


def read_header(row: torch.Tensor, what: str) -> tuple[int, ...] | None:
    """The facts of a :func:`header_row` sent by ``what``; None if the row is not such a header."""
    values = row.tolist()
    if values[0] != _call_code(what) or values[1] != _OK or not 0 <= values[3] <= MAX_FACTS:
        return None
    return tuple(values[4 : 4 + values[3]])


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
class Agreed:
    """What every rank of the group reported, in group-rank order (the same object on every rank)."""

    what: str
    ranks: list[int]
    """Global ranks of the group, in group-rank order."""
    rows: list[tuple[int, ...]]
    """Each rank's facts."""

    def require_same(
        self,
        label: str,
        value: Callable[[tuple[int, ...]], object] | None = None,
        *,
        error: type[errors.DisagreementError] = errors.DisagreementError,
        hint: str = "",
    ) -> None:
        """Raise ``error`` on every rank unless ``value(row)`` (default: the whole row) is equal on all ranks.

        The message names ``label`` and each rank's value.
        """
        values = [row if value is None else value(row) for row in self.rows]
        if any(v != values[0] for v in values[1:]):
            raise error(f"{self.what}: ranks disagree on {label} ({_by_value(self.ranks, values)}){hint}")


def agree(
    group: dist.ProcessGroup,
    facts: Callable[[], Sequence[int]],
    *,
    what: str,
    required: bool = False,
) -> Agreed | None:
    """Run ``facts()`` (this rank's validation and facts) and exchange the result with every rank of ``group``.

    Returns the :class:`Agreed` facts of all ranks, or None when the exchange is validation only
    (``required=False``) and :func:`checks_enabled` is off (then ``facts()`` still runs here and its
    exception, if any, is raised on this rank only). If any rank's ``facts()`` raised, or ranks are in
    different calls (``what``), every rank raises (see the module docstring) and no data collective follows.

    Args:
        group: the group the following collective runs on.
        facts: returns up to ``MAX_FACTS`` ints; whatever it raises is this rank's verdict.
        what: the call's name, e.g. ``"gather_sequence"``; it starts every message.
        required: the caller needs the other ranks' facts (not just validation): never skipped.
    """
    if not required and not checks_enabled():
        facts()
        return None
    message = b""
    try:
        mine = tuple(int(f) for f in facts())
        if len(mine) > MAX_FACTS:
            raise ValueError(f"{what}: too many facts to agree on ({len(mine)} > {MAX_FACTS})")
        status = _OK
    except Exception as exc:
        mine, status = (), _RAISED
        text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
        text = text.removeprefix(f"{what}: ")
        if _TYPES[_type_code(exc)] is Exception:
            text = f"{type(exc).__name__}: {text}"
        message = f"{_type_code(exc)}:{text}".encode("utf-8", "backslashreplace")
    row = [_call_code(what), status, len(message), len(mine), *mine]
    size = dist.get_world_size(group)
    device = comm_device(group)
    sent = torch.zeros(ROW, dtype=torch.int64)
    sent[: len(row)] = torch.tensor(row, dtype=torch.int64)
    gathered = torch.empty(size * ROW, dtype=torch.int64, device=device)
    dist.all_gather_single(gathered, sent.to(device), group=group)
    table = gathered.view(size, ROW).tolist()
    ranks = dist.get_process_group_ranks(group)
    calls = [r[0] for r in table]
    if any(c != calls[0] for c in calls) or any(r[1] != _OK for r in table):
        same_call = all(c == calls[0] for c in calls)
        if not same_call:  # each rank says which call it is in
            message = what.encode()
        texts = _gather_messages(message, [r[2] if same_call else -1 for r in table], group, device)
        if not same_call:
            raise errors.DisagreementError(
                f"ranks are in different wf_mesh calls at once ({_by_value(ranks, texts)}); every rank of the "
                "group must make the same collective calls in the same order"
            )
        _raise_reported(what, ranks, texts)
    return Agreed(what, ranks, [tuple(r[4 : 4 + r[3]]) for r in table])


def _gather_messages(message: bytes, lengths: list[int], group: dist.ProcessGroup, device: torch.device) -> list[str]:
    """All-gather each rank's UTF-8 message (``lengths[i] < 0``: the length is not known, exchange it first)."""
    if any(n < 0 for n in lengths):
        mine = torch.tensor([len(message)], dtype=torch.int64, device=device)
        every = torch.empty(len(lengths), dtype=torch.int64, device=device)
        dist.all_gather_single(every, mine, group=group)
        lengths = every.tolist()
    width = max(max(lengths), 1)
    padded = torch.zeros(width, dtype=torch.uint8)
    if message:
        padded[: len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
    every = torch.empty(len(lengths) * width, dtype=torch.uint8, device=device)
    dist.all_gather_single(every, padded.to(device), group=group)
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
