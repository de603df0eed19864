"""Pickled objects: ``wf_mesh.broadcast`` of a value only pickle carries and the legacy
``cat_outputs_cp_object_list``. A value pickle cannot take raises on every rank before any data moves; a
receiver's unpickle failing (injected, or an object whose unpickling raises on one rank only) raises on every
rank, naming the rank and the error, within a hang bound, and the next call on the same mesh is exact. With
containment off the success path pays no closing exchange."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh.legacy.context_parallel import cat_outputs_cp_object_list
from wf_mesh.testing import injected_fault, run_distributed

from helpers import Opaque, caught

HANG_BOUND_S = 60.0


class FailsOnRank2:
    """Pickles everywhere; unpickling it raises on global rank 2 only."""

    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return (_rebuilt, (self.value,))


def _rebuilt(value):
    if dist.get_rank() == 2:
        raise ValueError(f"cannot rebuild {value} here")
    return Opaque(value)


def fault_on(rank: int, where: str):
    return injected_fault(where, 1, MemoryError("simulated")) if dist.get_rank() == rank else contextlib.nullcontext()


def send(value):
    return wf_mesh.broadcast(value if dist.get_rank() == 0 else None, wf_mesh.get_parallel_mesh().group("cp"))


def exact_broadcasts(contain: bool):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()), contain_faults=contain)
    source = Opaque({"step": 3, "frames": [1, 2]})
    got = wf_mesh.broadcast(source if dist.get_rank() == 0 else None, pm.group("cp"))
    identity = got is source
    parts = cat_outputs_cp_object_list([Opaque(dist.get_rank())] * dist.get_rank(), pm.group("cp"))
    pm.destroy()
    return got, identity, parts


@pytest.mark.parametrize("world, contain", [(2, True), (4, True), (4, False)])
def test_pickled_values_arrive_exactly(world, contain):
    parts = [Opaque(r) for r in range(world) for _ in range(r)]  # rank 0 holds none
    for rank, (got, identity, gathered) in enumerate(run_distributed(world, exact_broadcasts, contain)):
        assert got == Opaque({"step": 3, "frames": [1, 2]}) and identity == (rank == 0), rank
        assert gathered == parts, rank


def unpicklable(what: str):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()), contain_faults=True)
    lock = threading.Lock()
    outcome, _ = caught(
        lambda: (
            send(lock)
            if what == "broadcast"
            else cat_outputs_cp_object_list([lock] if dist.get_rank() == 1 else [1], pm.group("cp"))
        ),
        contextlib.nullcontext(),
    )
    again = send(Opaque(7)) if what == "broadcast" else cat_outputs_cp_object_list([dist.get_rank()], pm.group("cp"))
    pm.destroy()
    return outcome, again


@pytest.mark.parametrize("what", ["broadcast", "cat_outputs_cp_object_list"])
def test_a_value_pickle_cannot_take_raises_on_every_rank_before_data_moves(what):
    want = (
        "broadcast: rank 0: cannot pickle the source's value (lock): TypeError: cannot pickle '_thread.lock' object"
        if what == "broadcast"
        else "cat_outputs_cp_object_list: rank 1: cannot pickle this rank's objects: TypeError: cannot pickle "
        "'_thread.lock' object"
    )
    for rank, (outcome, again) in enumerate(run_distributed(2, unpicklable, what)):
        assert outcome[0] == "TypeError" and outcome[1].startswith(want), (rank, outcome)
        assert again == (Opaque(7) if what == "broadcast" else [0, 1]), rank


def failing_broadcast(failing_rank: int, injected: bool):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()), contain_faults=True)
    value = Opaque("first") if injected else FailsOnRank2("first")
    fault = fault_on(failing_rank, "unpickle") if injected else contextlib.nullcontext()
    outcome, took = caught(lambda: send(value), fault)
    again = send(Opaque("second"))
    pm.destroy()
    return outcome, took, again


@pytest.mark.parametrize("world, failing_rank, injected", [(2, 1, True), (4, 2, True), (4, 2, False)])
def test_a_failing_unpickle_raises_on_every_rank_and_the_next_broadcast_is_exact(world, failing_rank, injected):
    error, detail = ("MemoryError", "simulated") if injected else ("ValueError", "cannot rebuild first here")
    want = (
        f"broadcast: rank {failing_rank}: failed at unpickle 1 of 1: {error}: {detail} "
        f"(raised on every rank of the group {list(range(world))})"
    )
    for rank, (outcome, took, again) in enumerate(run_distributed(world, failing_broadcast, failing_rank, injected)):
        assert outcome == (error, want), rank
        assert took < HANG_BOUND_S, rank
        assert again == Opaque("second"), rank


def failing_cat(failing_rank: int, where: str):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()), contain_faults=True)
    group, rank = pm.group("cp"), dist.get_rank()
    outcome, took = caught(
        lambda: cat_outputs_cp_object_list([Opaque(rank)] * (rank + 1), group), fault_on(failing_rank, where)
    )
    again = cat_outputs_cp_object_list([("next", rank)], group)
    pm.destroy()
    return outcome, took, again


@pytest.mark.parametrize(
    "world, failing_rank, where", [(2, 1, "unpickle"), (4, 1, "unpickle"), (4, 3, "unpickle"), (4, 2, "copy-in")]
)
def test_a_failing_cat_outputs_cp_object_list_raises_on_every_rank_and_the_next_is_exact(world, failing_rank, where):
    want = (
        f"cat_outputs_cp_object_list: rank {failing_rank}: failed at {where} 1 of 1: MemoryError: simulated "
        f"(raised on every rank of the group {list(range(world))})"
    )
    for rank, (outcome, took, again) in enumerate(run_distributed(world, failing_cat, failing_rank, where)):
        assert outcome == ("MemoryError", want), rank
        assert took < HANG_BOUND_S, rank
        assert again == [("next", r) for r in range(world)], rank


def uncontained_counts():
    """Containment off (the default): each call is the agreement and ONE collective."""
    from torch.distributed.tensor.debug import CommDebugMode

    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()), contain_faults=False)
    group = pm.group("cp")
    with CommDebugMode() as pickled:
        got = wf_mesh.broadcast(Opaque(1) if dist.get_rank() == 0 else None, group)
    with CommDebugMode() as tensor:
        wf_mesh.broadcast(torch.arange(3.0) if dist.get_rank() == 0 else None, group)
    with CommDebugMode() as gathered:
        parts = cat_outputs_cp_object_list([Opaque(dist.get_rank())], group)
    pm.destroy()
    return got, parts, pickled.get_total_counts(), tensor.get_total_counts(), gathered.get_total_counts()


def test_without_containment_the_success_path_pays_no_closing_exchange():
    for got, parts, *counts in run_distributed(2, uncontained_counts):
        assert got == Opaque(1) and parts == [Opaque(0), Opaque(1)]
        assert counts == [2, 2, 2]
