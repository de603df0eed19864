"""Bounded waits (wf_mesh.waits): a peer that stops answering without dying makes the waiting ranks raise
CollectiveTimeoutError after the mesh's timeout, naming the call, the axis, the ranks and the timeout.

Each case starts a cluster of its own (a timed-out gloo group is not reused) with a 3 s timeout; the stuck rank
sleeps 6 s. The bound asserted on how long the waiting ranks took is a hang check, not a timing assertion.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh import attention_ops
from wf_mesh.errors import CollectiveTimeoutError
from wf_mesh.testing import LocalCluster

pytestmark = pytest.mark.slow  # a cluster start and a 3 s timeout per case
TIMEOUT = datetime.timedelta(seconds=3)
HANG = 60.0


def run_fresh(world, fn, *args):
    cluster = LocalCluster(world).start()
    try:
        return cluster.run(fn, *args, return_exceptions=True)
    finally:
        cluster.shutdown()


def stuck_before(call):
    """Rank 1 sleeps instead of joining ``call``; rank 0 runs it."""
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2), timeout=TIMEOUT)
    if dist.get_rank() == 1:
        time.sleep(2 * TIMEOUT.total_seconds())
        return "slept"
    start = time.monotonic()
    try:
        if call == "broadcast":
            wf_mesh.broadcast(torch.ones(3), pm.group("cp"))
        else:
            q = torch.randn(1, 2, 4, 8)
            wf_mesh.cp_attention(q, q, q, method="ring", mesh=pm, layout="bhsd")
    except CollectiveTimeoutError as exc:
        return str(exc), time.monotonic() - start, isinstance(exc, TimeoutError) and isinstance(exc, RuntimeError)
    return "returned"


@pytest.mark.parametrize("call", ["broadcast", "cp_attention"])
def test_a_peer_that_never_joins_is_named_after_the_timeout(call):
    rank0, rank1 = run_fresh(2, stuck_before, call)
    assert rank1 == "slept"
    message, took, both_types = rank0
    assert message.startswith(f"{call}: no answer from a peer of the cp axis (ranks [0, 1]) within its timeout of 3 s")
    assert "init_parallel(timeout=...)" in message and "Timed out" in message, message
    assert both_types and took < HANG


def stuck_mid_ring():
    """4 ranks in a ring; rank 1 stalls in its first block step, after it posted its first hop."""
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=4), timeout=TIMEOUT)
    if dist.get_rank() == 1:
        block = attention_ops._forward_block

        def slow(*args):
            time.sleep(2 * TIMEOUT.total_seconds())
            return block(*args)

        attention_ops._forward_block = slow
    q = torch.randn(1, 2, 4, 8)
    start = time.monotonic()
    try:
        wf_mesh.cp_attention(q, q, q, method="ring", mesh=pm, layout="bhsd")
    except RuntimeError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "returned", "", time.monotonic() - start


def test_a_peer_stuck_in_the_middle_of_a_ring_is_named_at_the_hop():
    results = run_fresh(4, stuck_mid_ring)
    for rank in (0, 2):  # rank 0 sends hop 2 to rank 1, rank 2 receives hop 2 from it: both wait for rank 1
        kind, message, took = results[rank]
        assert kind == "CollectiveTimeoutError", (rank, kind, message)
        assert message.startswith("cp_attention ring hop: no answer from a peer of the cp axis (ranks [0, 1, 2, 3])")
        assert took < HANG
    for rank in (1, 3):  # they meet the broken ring later: an error, never a silent result or a hang
        assert results[rank][0] != "returned" and results[rank][2] < HANG, results[rank]


def stage_whose_peer_never_answers(op):
    """pp 2: stage 1 builds its link, then sleeps instead of answering stage 0's ``op``."""
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(pp=2), timeout=TIMEOUT)
    link = wf_mesh.PipelineP2P(pm)
    if dist.get_rank() == 1:
        time.sleep(2 * TIMEOUT.total_seconds())
        return "slept"
    start = time.monotonic()
    try:
        if op == "receive":
            link.recv((4,), torch.float32)
        elif op == "send":
            link.send(torch.ones(4))
            link.wait_sends()
        else:
            link.exchange(send_next=torch.ones(4), recv_prev=((4,), torch.float32))
    except CollectiveTimeoutError as exc:
        return str(exc), time.monotonic() - start
    return "returned"


@pytest.mark.parametrize(
    "op, what",
    [
        ("receive", "pipeline receive from pp stage 1 (global rank 1)"),
        ("send", "pipeline send to pp stage 1 (global rank 1)"),
        ("exchange", "pipeline exchange with pp stage 1 (global rank 1)"),
    ],
)
def test_a_pipeline_stage_whose_peer_never_answers_names_the_peer_and_the_pp_axis(op, what):
    rank0, rank1 = run_fresh(2, stage_whose_peer_never_answers, op)
    assert rank1 == "slept"
    message, took = rank0
    assert message.startswith(f"{what}: no answer from a peer of the pp axis (ranks [0, 1]) within its timeout of 3 s")
    assert "Timed out" in message and took < HANG, message


def stuck_in_gather_copy_in():
    """cp 2: rank 1 agrees, then stalls in its copy-in, before the gather's all-gather."""
    from wf_mesh import context_parallel

    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2), timeout=TIMEOUT)
    if dist.get_rank() == 1:
        padded = context_parallel._padded_shard

        def slow(*args):
            time.sleep(2 * TIMEOUT.total_seconds())
            return padded(*args)

        context_parallel._padded_shard = slow
    start = time.monotonic()
    try:
        wf_mesh.gather_sequence(torch.ones(2, 3), 0, mesh=pm)
    except CollectiveTimeoutError as exc:
        return str(exc), time.monotonic() - start
    except RuntimeError as exc:  # rank 1 meets its peer's abandoned all-gather: any error, never a hang
        return type(exc).__name__, time.monotonic() - start
    return "returned", time.monotonic() - start


def test_a_peer_stuck_before_the_gathers_all_gather_is_named():
    (message, took), (kind, took1) = run_fresh(2, stuck_in_gather_copy_in)
    assert message.startswith("gather_sequence: no answer from a peer of the cp axis (ranks [0, 1]) within its timeout")
    assert took < HANG and took1 < HANG, (message, kind)


def stuck_before_shard_sequence():
    """cp 2: rank 1 sleeps; rank 0 shards a Partial DTensor (DTensor's reduce-scatter, bounded, not contained)."""
    from torch.distributed.tensor import DTensor, Partial

    from wf_mesh.context_parallel import cp_mesh

    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2), timeout=TIMEOUT)
    if dist.get_rank() == 1:
        time.sleep(2 * TIMEOUT.total_seconds())
        return "slept"
    x = DTensor.from_local(torch.ones(2, 4), cp_mesh(pm), [Partial()], run_check=False)
    start = time.monotonic()
    try:
        wf_mesh.shard_sequence(x, 1, mesh=pm)
    except CollectiveTimeoutError as exc:
        return str(exc), time.monotonic() - start
    return "returned"


def test_a_peer_stuck_before_a_dtensor_shard_sequence_is_named():
    (message, took), rank1 = run_fresh(2, stuck_before_shard_sequence)
    assert rank1 == "slept"
    assert message.startswith("shard_sequence: no answer from a peer of the cp axis (ranks [0, 1]) within its timeout")
    assert took < HANG
