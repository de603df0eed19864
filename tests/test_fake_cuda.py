"""The CUDA path of cp_attention without a GPU (tests/fake_cuda.py): fake CUDA tensors at the sizes of a
video DiT (bf16, S_local 8192, 16 heads, head dim 128, cp 4) on torch's ``fake`` process group, in this one
process as rank 0 of 4. FakeTensorMode runs torch's CUDA kernels' shape, dtype and stride rules (their meta
functions): no memory is used and no value is computed, so these tests pin WHICH kernel runs and WHAT it
allocates, never a result (benchmarks/gpu_check.py checks values on a GPU).

Asserted for every method (ring, ulysses, usp, allgather), causal + zigzag and a block-causal mask plan, grouped-query K/V and a key padding
mask: the fused SDPA op that ran (flash without a mask, memory-efficient with one) and that no op produced a
tensor with two non-broadcast dims of at least S_local (an S_local x S_local grid). The math kernel, the
last resort, is shown to be caught by the same check. Autograd on fake CUDA tensors aborts a CPU-only build,
so the backward is checked by calling the block backward and the ring's backward directly.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from fake_cuda import fake_cuda, fake_process_group
from torch.distributed.device_mesh import init_device_mesh

from wf_mesh import _compat, agreement, attention_kernels, faults
from wf_mesh.attention import cp_attention
from wf_mesh.attention_kernels import Kernel, attend, attend_backward
from wf_mesh.attention_ops import RingAttention, RingPlan, rank_segments
from wf_mesh.attention_plan import plan_cp_attention
from wf_mesh.masks import RangeMask

CP, S, HEADS, HEAD_DIM = 4, 8192, 16, 128
FLASH = "aten._scaled_dot_product_flash_attention.default"
EFFICIENT = "aten._scaled_dot_product_efficient_attention.default"
FLASH_BACKWARD = "aten._scaled_dot_product_flash_attention_backward.default"
EFFICIENT_BACKWARD = "aten._scaled_dot_product_efficient_attention_backward.default"


@pytest.fixture(scope="module")
def meshes():
    with fake_process_group(CP):
        yield {
            "cp": init_device_mesh("cpu", (CP,), mesh_dim_names=("cp",)),
            "usp": init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_ring", "cp_ulysses")),
        }


def cuda(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="cuda")


VARIANTS = {  # name: (kv heads, key padding mask, the SDPA op)
    "causal-zigzag": (HEADS, False, FLASH),
    "causal-zigzag-gqa-padding": (4, True, EFFICIENT),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("method", ["ring", "ulysses", "usp", "allgather"])
def test_forward_runs_the_fused_kernel_and_allocates_no_quadratic_tensor(method, variant, meshes):
    kv_heads, padded, op = VARIANTS[variant]
    with fake_cuda() as recorder:
        q, k, v = cuda(1, S, HEADS, HEAD_DIM), cuda(1, S, kv_heads, HEAD_DIM), cuda(1, S, kv_heads, HEAD_DIM)
        pad = torch.zeros(1, S, dtype=torch.bool, device="cuda") if padded else None
        out = cp_attention(
            q,
            k,
            v,
            method=method,
            mesh=meshes["usp" if method == "usp" else "cp"],
            layout="bshd",
            causal=True,
            balance="zigzag",
            key_padding_mask=pad,
        )
    assert (out.shape, out.dtype, out.device.type) == (q.shape, q.dtype, "cuda")
    assert recorder.names("attention") == {op}
    assert recorder.quadratic(S) == []


def test_the_math_kernel_is_what_the_quadratic_check_catches(meshes, monkeypatch):
    monkeypatch.setattr(attention_kernels, "_warned", set())  # it warns once per process and reason
    with pytest.warns(RuntimeWarning, match=r"dtype torch.float64"), fake_cuda() as recorder:
        q = cuda(1, HEADS, S, HEAD_DIM, dtype=torch.float64)
        cp_attention(q, q, q, layout="bhsd", mesh=meshes["cp"], causal=True)
    assert recorder.names("attention") == set()
    caught = {op.name for op in recorder.quadratic(S)}
    assert {"aten.bmm.default", "aten.exp.default"} <= caught, caught  # the scores and probabilities


BLOCKS = {  # name: (kv heads, key padding mask, kernel, the backward op)
    "flash-gqa": (4, False, Kernel.FLASH, FLASH_BACKWARD),
    "efficient-gqa-padding": (4, True, Kernel.EFFICIENT, EFFICIENT_BACKWARD),
    "efficient-head-dim-100": (HEADS, True, Kernel.EFFICIENT, EFFICIENT_BACKWARD),
}


@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("causal", [False, True])
def test_block_backward_runs_the_fused_backward_op(block, causal):
    kv_heads, padded, kernel, op = BLOCKS[block]
    d = 100 if block.endswith("100") else HEAD_DIM
    with fake_cuda() as recorder:
        q, dout = cuda(1, HEADS, S, d), cuda(1, HEADS, S, d)
        k, v = cuda(1, kv_heads, S, d), cuda(1, kv_heads, S, d)
        pad = torch.zeros(1, S, dtype=torch.bool, device="cuda") if padded else None
        out, lse = attend(q, k, v, pad, causal, 0.1, kernel)
        dq, dk, dv = attend_backward(dout, q, k, v, out, lse, pad, causal, 0.1, kernel)
    assert (out.shape, lse.shape, lse.dtype) == (q.shape, (1, HEADS, S), torch.float32)
    assert [(g.shape, g.dtype) for g in (dq, dk, dv)] == [(x.shape, x.dtype) for x in (q, k, v)]
    assert op in recorder.names("attention")
    assert recorder.quadratic(S) == []


def test_ring_backward_on_fake_tensors(meshes):
    """RingAttention.backward called directly (a namespace stands in for autograd's ctx): K/V hops, the
    fused backward per pair, dK/dV travelling back on the fake process group."""
    segments = rank_segments(CP * S, CP, "zigzag")
    group = meshes["cp"].get_group()
    plan = RingPlan(group, 0, segments[0], segments, [S] * CP, True, 1 / math.sqrt(HEAD_DIM), Kernel.FLASH)
    with fake_cuda() as recorder:
        q, dout = cuda(1, HEADS, S, HEAD_DIM), cuda(1, HEADS, S, HEAD_DIM)
        k, v = cuda(1, 4, S, HEAD_DIM), cuda(1, 4, S, HEAD_DIM)
        out = cuda(1, HEADS, S, HEAD_DIM)
        lse = torch.empty(1, HEADS, S, dtype=torch.float32, device="cuda")
        ctx = types.SimpleNamespace(saved_tensors=(q, k, v, out, lse), pad=None, plan=plan)
        dq, dk, dv, *_ = RingAttention.backward(ctx, dout)
    assert [(g.shape, g.dtype) for g in (dq, dk, dv)] == [(x.shape, x.dtype) for x in (q, k, v)]
    assert recorder.names("attention") == {FLASH_BACKWARD}
    assert recorder.names("c10d") >= {"c10d.send.default", "c10d.recv_.default"}
    assert recorder.quadratic(S) == []


@pytest.mark.parametrize("method", ["ring", "ulysses", "usp", "allgather"])
def test_a_mask_plan_runs_the_flash_kernel_per_piece_and_allocates_no_quadratic_tensor(method, meshes):
    """A block-causal mask (16 frame chunks) on a work-balanced plan: every piece is a full or an aligned causal
    pair, so the flash kernel runs with no position mask and nothing S_local x S_local is built."""
    mesh = meshes["usp" if method == "usp" else "cp"]
    agreement.set_checks(False)  # the plan's agreement is an exchange of real CPU tensors (none on fake ones)
    try:
        plan = plan_cp_attention(mask=RangeMask.block_causal([CP * S // 16] * 16), mesh=mesh)
        n = plan.local_len
        with fake_cuda() as recorder:
            q, k = cuda(1, n, HEADS, HEAD_DIM), cuda(1, n, 4, HEAD_DIM)
            out = cp_attention(q, k, k, method=method, layout="bshd", plan=plan)
    finally:
        agreement.set_checks(None)
    assert (out.shape, out.dtype, out.device.type) == (q.shape, q.dtype, "cuda")
    assert recorder.names("attention") == {FLASH}
    assert recorder.quadratic(n) == []


@pytest.mark.parametrize("method", ["ring", "ulysses", "usp", "allgather"])
def test_contained_attention_runs_the_same_kernels_and_closes_with_one_word(method, meshes):
    """contain_faults=True on the CUDA path: every local step runs in its FaultSequence on fake CUDA tensors
    (the same fused op, no quadratic tensor) and the call closes with one one-word all-reduce (a real host-side
    word, outside the fake mode). The failure path needs real peers: tests/test_faults*.py on gloo."""
    faults.set_containment(True)
    try:
        with fake_cuda() as recorder:
            q = cuda(1, S, HEADS, HEAD_DIM)
            mesh = meshes["usp" if method == "usp" else "cp"]
            out = cp_attention(q, q, q, method=method, mesh=mesh, layout="bshd", causal=True, balance="zigzag")
    finally:
        faults.set_containment(None)
    assert (out.shape, out.dtype, out.device.type) == (q.shape, q.dtype, "cuda")
    assert recorder.names("attention") == {FLASH}
    assert recorder.quadratic(S) == []
    closes = [op.name for op in recorder.ops if op.name == "c10d.allreduce_.default"]
    assert len(closes) == 1, sorted(recorder.names("c10d"))


def test_the_efficient_backward_reads_out_in_its_forwards_layout():
    """A merged ring output is (B, H, S, D)-contiguous; the memory-efficient backward must get it in the layout its
    forward returns, (B, S, H, D) in memory: given the other, its 16-bit gradients were wrong on an H200."""
    seen = []

    class OutArgument(_compat.dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) == EFFICIENT_BACKWARD:
                seen.append(args[5].transpose(1, 2).is_contiguous())  # (grad_out, q, k, v, bias, out, ...)
            return func(*args, **(kwargs or {}))

    with fake_cuda():
        q, dout = cuda(1, HEADS, S, HEAD_DIM), cuda(1, HEADS, S, HEAD_DIM)
        pad = torch.zeros(1, S, dtype=torch.bool, device="cuda")
        out, lse = attend(q, q, q, pad, False, 0.1, Kernel.EFFICIENT)
        merged = torch.ops.aten.clone.default(out, memory_format=torch.contiguous_format)
        assert merged.is_contiguous() and not merged.transpose(1, 2).is_contiguous()
        with OutArgument():
            attend_backward(dout, q, q, q, merged, lse, pad, False, 0.1, Kernel.EFFICIENT)
    assert seen == [True]
