"""wf_mesh.p2p: which point-to-point transfers stage through host memory (a pure choice), and the staged path
itself, forced on CPU gloo: ring attention forward and backward and every pipeline transfer give the same bits
as the direct path."""

import pytest
import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh import p2p
from wf_mesh.testing import run_distributed

from helpers import sample
from test_pipeline import LAYOUTS, _ring, _world, denoise, denoise_reference, native_transfers

# (backend as dist.get_backend names it, tensor's device type) -> staged
CHOICES = {
    ("gloo", "cuda"): True,  # gloo's send / recv hand a device pointer to TCP
    ("gloo", "cpu"): False,
    ("nccl", "cuda"): False,
    ("cpu:gloo,cuda:nccl", "cuda"): False,  # the device's own backend decides
    ("cpu:gloo,cuda:nccl", "cpu"): False,
    ("cpu:gloo,cuda:gloo", "cuda"): True,
    ("fake", "cuda"): False,
    ("gloo", "xpu"): True,
}


@pytest.mark.parametrize("backend, device_type", list(CHOICES))
def test_the_choice_is_a_pure_function_of_backend_and_device(backend, device_type):
    assert p2p.staged(backend, device_type) is CHOICES[backend, device_type]
    assert p2p.staged(backend, device_type, forced=True) is True


def test_the_serving_backend_of_a_per_device_string():
    assert p2p.serving_backend("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert p2p.serving_backend("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert p2p.serving_backend("gloo", "cuda") == "gloo"


def staged_transfers(layout, checked):
    with p2p.forced_staging():
        work = p2p.isend(torch.ones(1), group=dist.group.WORLD, group_dst=(dist.get_rank() + 1) % dist.get_world_size())
        received = torch.zeros(1)
        p2p.irecv(received, group=dist.group.WORLD, group_src=(dist.get_rank() - 1) % dist.get_world_size()).wait()
        work.wait()
        assert isinstance(work, p2p.StagedWork) and work.is_completed() and received.item() == 1.0
        return native_transfers(layout, checked)


@pytest.mark.parametrize("layout, checked", [("pp2", False), ("pp2", True), ("pp4", True)])
def test_staged_pipeline_transfers_are_exact(layout, checked):
    direct = run_distributed(_world(layout), native_transfers, layout, checked)
    staged = run_distributed(_world(layout), staged_transfers, layout, checked)
    for rank, (want, got) in enumerate(zip(direct, staged)):
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(want[0], got[0])), rank
        assert got[1:] == want[1:]
        _, prev, _ = _ring(layout, rank)
        assert got[2][0] != prev or LAYOUTS[layout][2] == 2  # what came back is the neighbour's, not ours


def staged_denoise(layout, checked):
    with p2p.forced_staging():
        return denoise(layout, checked)


@pytest.mark.parametrize("checked", [False, True])
def test_staged_legacy_scheduler_matches_one_process(checked):
    expected = denoise_reference()
    got = run_distributed(2, staged_denoise, "pp2", checked)
    assert got[0] is None
    torch.testing.assert_close(got[1], expected, rtol=1e-12, atol=1e-12)


def ring_attention(cp, causal, staged):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=cp))
    q, k, v, dout = (sample((2, 4, 8 * cp, 16), seed=s) for s in range(4))
    balance = "zigzag" if causal else None
    shard = (
        (lambda x: wf_mesh.zigzag_shard(x, 2, mesh=pm))
        if causal
        else (lambda x: wf_mesh.shard_sequence(x, 2, mesh=pm, as_dtensor=False))
    )
    leaves = [shard(x).requires_grad_() for x in (q, k, v)]
    with p2p.forced_staging() if staged else torch.enable_grad():
        out = wf_mesh.cp_attention(*leaves, layout="bhsd", method="ring", mesh=pm, causal=causal, balance=balance)
        out.backward(shard(dout))
    return [out.detach(), *(x.grad for x in leaves)]


@pytest.mark.parametrize("cp, causal", [(2, False), (4, True), (4, False)])
def test_staged_ring_hops_forward_and_backward_are_exact(cp, causal):
    direct = run_distributed(cp, ring_attention, cp, causal, False)
    staged = run_distributed(cp, ring_attention, cp, causal, True)
    for rank, (want, got) in enumerate(zip(direct, staged)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), want, got):
            assert torch.equal(a, b), (rank, name)
