"""The agreement records themselves: every kind round-trips through the wire, a record too long for one row is
refused, require_same names the fields and each rank's value, a rank whose facts raised makes every rank raise,
and with checks off nothing is exchanged."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from wf_mesh import agreement
from wf_mesh.agreement import Facts, agree, fact
from wf_mesh.errors import DisagreementError, ShapeMismatchError
from wf_mesh.testing import c10d_ops, run_distributed

from helpers import raised_everywhere


class Mode:
    """A non-str choice (choices are any objects compared with ==)."""

    def __init__(self, name):
        self.name = name

    def __eq__(self, other):
        return isinstance(other, Mode) and other.name == self.name

    def __repr__(self):
        return f"Mode({self.name})"


MODES = (Mode("fast"), Mode("exact"), None)


@dataclasses.dataclass(frozen=True)
class Every(Facts):
    """One field of every kind."""

    flag: bool
    count: int
    ratio: float
    dtype: torch.dtype
    shape: tuple[int, ...]
    maybe_count: int | None
    maybe_ratio: float | None
    maybe_dtype: torch.dtype | None
    maybe_shape: tuple[int, ...] | None
    name: str = fact(choices=("ring", "ulysses"))
    mode: object = fact(choices=MODES, label="the mode")
    note: object = fact(local=True, default=None)


SAMPLES = [
    Every(True, 0, 0.0, torch.float32, (), None, None, None, None, "ring", None),
    Every(False, -(2**63), -0.0, torch.bfloat16, (0,), 2**63 - 1, math.inf, torch.bool, (), "ulysses", MODES[0]),
    Every(True, 7, 1 / 3, torch.uint64, (2, 3, 5), -1, -math.inf, torch.complex128, (1, 0, 4), "ring", MODES[1]),
    Every(False, 1, 5e-324, torch.float8_e5m2, tuple(range(10)), 0, 1e308, torch.float64, (9,), "ulysses", None),
]


@pytest.mark.parametrize("record", SAMPLES)
def test_every_kind_round_trips(record):
    slots = record.encode()
    assert all(isinstance(s, int) and -(2**63) <= s < 2**63 for s in slots)
    back = Every.decode(slots)
    assert back == record
    assert math.copysign(1.0, back.ratio) == math.copysign(1.0, record.ratio)  # -0.0 stays -0.0: exact bits
    row = agreement.header_row("round trip", record)
    assert row.shape == (agreement.ROW,) and row.dtype == torch.int64
    assert agreement.read_header(row, "round trip", Every) == record
    assert agreement.read_header(row, "another call", Every) is None  # a row of another origin is no header


def test_nan_and_every_dtype_round_trip():
    @dataclasses.dataclass(frozen=True)
    class One(Facts):
        value: float
        dtype: torch.dtype

    for dtype in agreement.DTYPES:
        assert One.decode(One(math.nan, dtype).encode()).dtype is dtype
    assert math.isnan(One.decode(One(math.nan, torch.int8).encode()).value)


def test_local_fields_stay_home():
    record = dataclasses.replace(SAMPLES[2], note=object())
    assert Every.decode(record.encode()).note is None
    assert len(record.encode()) == len(SAMPLES[2].encode())  # not on the wire


def test_bad_values_and_declarations_name_the_field():
    with pytest.raises(TypeError, match=r"Every.name: 'flash' is not one of \['ring', 'ulysses'\]"):
        dataclasses.replace(SAMPLES[0], name="flash").encode()
    with pytest.raises(TypeError, match=r"Every.dtype: dtype torch.qint8 has no wire code"):
        dataclasses.replace(SAMPLES[0], dtype=torch.qint8).encode()

    @dataclasses.dataclass(frozen=True)
    class Loose(Facts):
        label: str  # a str needs choices

    with pytest.raises(TypeError, match=r"a fact must be bool, int, float, torch.dtype, tuple\[int, \.\.\.\]"):
        Loose("x").encode()


@dataclasses.dataclass(frozen=True)
class Long(Facts):
    shape: tuple[int, ...]


def test_a_record_too_long_for_one_row_is_refused():
    Long(tuple(range(agreement.MAX_FACTS - 1))).encode()  # fits: the length slot + MAX_FACTS - 1 values
    agreement.header_row("fits", Long(tuple(range(agreement.MAX_FACTS - 1))))
    with pytest.raises(ValueError, match=r"^send: Long takes 45 wire slots, more than the 44 of one agreement row"):
        agreement.header_row("send", Long(tuple(range(agreement.MAX_FACTS))))


# ---- on 2 gloo ranks ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Call(Facts):
    seq_dim: int
    batch: int
    heads: int = fact(label="query heads")
    dtype: torch.dtype
    shape: tuple[int, ...] = fact(label="local shape")
    kept: object = fact(local=True, default=None)


def exchange(case):
    rank = dist.get_rank()
    world = dist.group.WORLD
    if case == "too_long":
        return agree(world, lambda: Long(tuple(range(50 if rank else 3))), what="too_long")
    if case == "raises":

        def facts():
            if rank == 1:
                raise KeyError("no such axis 'ep'")
            return Call(0, 1, 2, torch.float32, ())

        return agree(world, facts, what="lookup")
    agreed = agree(
        world, lambda: Call(rank if case == "one" else 1, 2, 4 + rank, torch.float32, (3, rank), kept=rank), what="c"
    )
    if case == "values":
        return agreed.values("heads"), agreed.mine.kept, agreed.mine.heads, agreed.exchanged, agreed.ranks
    if case == "one":
        agreed.require_same("seq_dim")
    if case == "several":
        agreed.require_same("batch", "heads", "dtype", error=ShapeMismatchError)
    if case == "key":
        agreed.require_same(key=lambda r: r.shape[1:], label="the shape after dim 0", hint="; pass equal shapes")
    return agreed


CASES = {
    "one": (DisagreementError, r"^c: ranks disagree on seq_dim \(rank 0: 0; rank 1: 1\)$"),
    "several": (
        ShapeMismatchError,
        r"^c: ranks disagree on \(batch, query heads, dtype\) \(rank 0: \(2, 4, torch.float32\); "
        r"rank 1: \(2, 5, torch.float32\)\)$",
    ),
    "key": (
        DisagreementError,
        r"^c: ranks disagree on the shape after dim 0 \(rank 0: \(0,\); rank 1: \(1,\)\); pass equal shapes$",
    ),
    "raises": (KeyError, r"""^"lookup: rank 1: no such axis 'ep' \(raised on every rank of the group \[0, 1\]\)"$"""),
    "too_long": (ValueError, r"^too_long: rank 1: Long takes 51 wire slots, more than the 44 of one agreement row"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_errors_name_the_fields_and_every_value_on_every_rank(case):
    error, match = CASES[case]
    raised_everywhere(run_distributed(2, exchange, case, return_exceptions=True), error, match)


def test_values_in_group_rank_order_and_the_local_fields_of_this_rank():
    assert run_distributed(2, exchange, "values") == [([4, 5], rank, 4 + rank, True, [0, 1]) for rank in range(2)]


def checks_off():
    rank = dist.get_rank()
    agreement.set_checks(False)
    try:
        skipped = agree(dist.group.WORLD, lambda: Call(rank, 1, 1, torch.float32, (), kept="mine"), what="skipped")
        skipped.require_same("seq_dim")  # nothing to compare: no error although the ranks differ
        try:
            skipped.values("seq_dim")
        except RuntimeError as exc:
            unexchanged = str(exc)
        needed = agree(dist.group.WORLD, lambda: Call(rank, 1, 1, torch.float32, ()), what="needed", required=True)
        return (
            skipped.exchanged,
            skipped.rows,
            skipped.mine.kept,
            unexchanged,
            needed.exchanged,
            needed.values("seq_dim"),
        )
    finally:
        agreement.set_checks(None)


def test_with_checks_off_nothing_is_exchanged_unless_required():
    assert (
        run_distributed(2, checks_off)
        == [(False, None, "mine", "skipped: the facts were not exchanged (checks are off)", True, [0, 1])] * 2
    )


# ---- verdict: the one-word exchange fault containment closes with -----------------------------------------
@dataclasses.dataclass(frozen=True)
class Done(Facts):
    """A verdict's record: no fields."""


def verdicts(failing, rounds=3):
    """``rounds`` verdicts in a row; ranks in ``failing`` raise in the second. Returns what each round gave on
    this rank (None: passed)."""
    rank, seen = dist.get_rank(), []
    for i in range(rounds):

        def facts():
            if i == 1 and rank in failing:
                raise MemoryError(f"out of memory on rank {rank}")
            return Done()

        try:
            agreement.verdict(dist.group.WORLD, facts, what="seq")
            seen.append(None)
        except Exception as exc:
            seen.append(exc)
    return seen


def verdict_ops():
    ops = []
    with c10d_ops(lambda name, args: ops.append((name, sum(t.numel() for t in args[0])))):
        agreement.verdict(dist.group.WORLD, Done, what="seq")
    return ops


@pytest.mark.parametrize("world", [2, 4])
def test_a_verdict_raises_the_failing_ranks_error_on_every_rank_and_the_next_one_passes(world):
    failing = {world - 1} if world == 2 else {1, 2}
    outcomes = run_distributed(world, verdicts, failing)
    assert all(seen[0] is None and seen[2] is None for seen in outcomes)
    names = "; ".join(f"rank {r}: out of memory on rank {r}" for r in sorted(failing))
    raised_everywhere([seen[1] for seen in outcomes], MemoryError, f"^seq: {names} \\(raised on every rank")


def test_a_verdict_that_passes_is_one_single_word_all_reduce():
    for ops in run_distributed(2, verdict_ops):
        assert ops == [("allreduce_", 1)], ops
