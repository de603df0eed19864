"""wf_mesh.broadcast: typed, pickle-free payloads from the group's smallest rank (values and types exact on
every receiver), any tensor dtype, the pickle fallback and its switch, and errors raised on every rank."""

import warnings

import pytest
import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh import collectives
from wf_mesh.errors import ShapeMismatchError
from wf_mesh.testing import run_distributed

from helpers import DataType, Opaque, raised_everywhere, sample

VALUES = {
    "none": None,
    "bool": True,
    "int": -7,
    "big_int": 2**100 + 3,
    "float": 0.1,
    "nan_like": float("inf"),
    "complex": 1.5 - 2j,
    "str": "é ✓ \ud800",  # a lone surrogate: encodable only with surrogatepass, and exact on receipt
    "empty_str": "",
    "bytes": b"\x00\xffraw",
    "enum": DataType.VIDEO,
    "tuple": (1, "a", (None, False)),
    "list": [1.0, [2, 3]],
    "dict": {"state_t": 4, "kind": DataType.IMAGE, 7: b"x", "nested": {"t": (1,)}},
}
TENSORS = {
    "uint16": torch.arange(6, dtype=torch.int32).reshape(2, 3).to(torch.uint16),
    "float8": torch.linspace(-2, 2, 5).to(torch.float8_e4m3fn),
    "bfloat16": sample((3, 2), dtype=torch.bfloat16),
    "bool": torch.tensor([True, False]),
    "scalar": torch.tensor(3.5),
    "empty": torch.empty(0, 4),
}


def broadcast_everything():
    rank = dist.get_rank()
    group = dist.new_group([1, 2, 3])  # smallest rank 1 is the source
    if rank == 0:
        return None
    out = {}
    for name, value in VALUES.items():
        out[name] = wf_mesh.broadcast(value if rank == 1 else "ignored", group)
    for name, tensor in TENSORS.items():
        out[f"tensor_{name}"] = wf_mesh.broadcast(tensor if rank == 1 else None, group)
    mixed = {"latent": sample((2, 3)), "flags": [True, torch.arange(3)], "t": DataType.VIDEO}
    out["mixed"] = wf_mesh.broadcast(mixed if rank == 1 else None, group)
    again = wf_mesh.broadcast(mixed, group)  # receivers pass their own dict: ignored
    # a value whose only tensors are empty carries no tensor bytes (it once hung the source, receivers raised)
    out["empty_only"] = wf_mesh.broadcast({"e": torch.empty(0, 4), "n": 1} if rank == 1 else None, group)
    out["source_identity"] = again is mixed
    return out


def test_typed_payloads_arrive_exactly_with_their_types():
    results = run_distributed(4, broadcast_everything)
    assert results[0] is None
    for out in results[1:]:
        for name, value in VALUES.items():
            got = out[name]
            assert got == value and type(got) is type(value), (name, got)
        assert type(out["enum"]) is DataType and out["dict"]["kind"] is DataType.IMAGE
        for name, tensor in TENSORS.items():
            got = out[f"tensor_{name}"]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape
            assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)) if tensor.ndim else got == tensor
        assert torch.equal(out["mixed"]["latent"], sample((2, 3))) and out["mixed"]["t"] is DataType.VIDEO
        assert out["mixed"]["flags"][0] is True and torch.equal(out["mixed"]["flags"][1], torch.arange(3))
        assert out["empty_only"]["n"] == 1 and out["empty_only"]["e"].shape == (0, 4)
    assert [out["source_identity"] for out in results[1:]] == [True, False, False]


def pickled(allow):
    rank = dist.get_rank()
    collectives._warned.clear()  # it warns once per process and type: other tests on these workers pickle too
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = wf_mesh.broadcast(Opaque([rank]) if rank == 0 else None, dist.group.WORLD, allow_pickle=allow(rank))
    return got, [str(w.message) for w in caught]


def allow_all(rank):
    return None


def refuse_on_rank_1(rank):
    return rank != 1


def test_other_objects_are_pickled_after_a_warning():
    results = run_distributed(2, pickled, allow_all)
    assert [got for got, _ in results] == [Opaque([0]), Opaque([0])]
    assert "pickling a Opaque (not a typed value)" in results[0][1][0] and not results[1][1]


def misuse(case):
    rank = dist.get_rank()
    world = dist.group.WORLD
    if case == "pickle_refused_by_a_receiver":
        return pickled(refuse_on_rank_1)
    if case == "pickle_off_on_the_source":
        return wf_mesh.broadcast(Opaque(1), world, allow_pickle=False)
    if case == "dtensor":
        wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
        return wf_mesh.broadcast(wf_mesh.shard_sequence(torch.zeros(2, 4), 1, as_dtensor=True), world)
    if case == "receiver_dtype":
        return wf_mesh.broadcast(torch.zeros(2, dtype=torch.int64 if rank else torch.float32), world)


MISUSE = {
    "pickle_refused_by_a_receiver": (
        TypeError,
        r"broadcast: the source's value needs pickle and ranks \[1\] turned pickle off",
    ),
    "pickle_off_on_the_source": (TypeError, r"broadcast: rank 0: Opaque values need pickle, which is off"),
    "dtensor": (TypeError, r"broadcast: broadcast does not take a DTensor \(its shards differ per rank\)"),
    "receiver_dtype": (
        ShapeMismatchError,
        r"broadcast: ranks \[1\] passed tensors that do not match the source's \(rank 0\) ndim and dtype",
    ),
}


@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_raises_on_every_rank(case):
    error, match = MISUSE[case]
    raised_everywhere(run_distributed(2, misuse, case, return_exceptions=True), error, match)


def test_none_group_returns_the_item_itself():
    item = {"a": [1]}
    assert wf_mesh.broadcast(item, None) is item and wf_mesh.broadcast(None) is None
