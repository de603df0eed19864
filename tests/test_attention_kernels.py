"""The block core of CP attention (wf_mesh.attention_kernels, RingPlan.pairs): which kernel runs, and that the
CPU flash kernel and the math kernel give single-process SDPA's values, forward and backward, on one key
block and on key blocks merged by log-sum-exp (each block's backward given the MERGED out and lse, as the
ring computes it). References are float64, from the formula (rows that see no key: out 0, lse -inf, zero
gradients, as SDPA gives) and checked against ``F.scaled_dot_product_attention`` where it is defined."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from wf_mesh import attention_kernels
from wf_mesh.attention_kernels import Kernel, accumulation_dtype, attend, attend_backward, choose_kernel
from wf_mesh.attention_ops import RingPlan, Segment, merge_partial

TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def inputs(dtype, heads=4, kv_heads=4, sq=7, sk=7, pad_kind=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, sq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, sk, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, heads, sq, 8, generator=g, dtype=torch.float64)
    pad = None
    if pad_kind is not None:
        pad = torch.rand(2, sk, generator=g) < 0.3
        if pad_kind == "empty rows":
            pad[1] = True  # batch 1: every key is padding
            pad[0, :3] = True  # batch 0, causal: queries 0..2 see no key
    return [x.to(dtype) for x in (q, k, v, dout)], pad


def reference(q, k, v, dout, pad, causal, scale):
    """float64 ``(out, lse, dq, dk, dv)`` from the formula."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ kk.transpose(-1, -2) * scale
    allowed = torch.ones(s.shape[-2:], dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    if pad is not None:
        allowed = allowed & ~pad[:, None, None, :]
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)
    out = torch.exp(s - lse.masked_fill(lse == -math.inf, 0)[..., None]) @ vv
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.double())
    return out.detach(), lse.detach(), dq, dk, dv


def close(got, want, tol):
    return torch.allclose(got.double(), want, atol=tol, rtol=tol)


CASES = [
    pytest.param(
        dtype, kernel, causal, kv_heads, pad_kind, id=f"{dtype}-{kernel.value}-{causal=}-kv{kv_heads}-{pad_kind}"
    )
    for dtype in (torch.float64, torch.float32, torch.bfloat16)
    for kernel in (Kernel.CPU_FLASH, Kernel.MATH)
    for causal in (False, True)
    for kv_heads in (4, 2)
    for pad_kind in (None, "padding", "empty rows")
]


@pytest.mark.parametrize("dtype, kernel, causal, kv_heads, pad_kind", CASES)
def test_one_block_equals_sdpa(dtype, kernel, causal, kv_heads, pad_kind):
    (q, k, v, dout), pad = inputs(dtype, kv_heads=kv_heads, pad_kind=pad_kind)
    want = reference(q, k, v, dout, pad, causal, 0.3)
    out, lse = attend(q, k, v, pad, causal, 0.3, kernel)
    assert lse.dtype == accumulation_dtype(dtype) and lse.shape == q.shape[:-1]
    assert torch.equal(torch.isinf(lse), torch.isinf(want[1]))  # exactly the rows that see no key
    finite = ~torch.isinf(want[1])
    assert close(out, want[0], TOL[dtype]) and close(lse[finite], want[1][finite], TOL[dtype])
    if pad_kind == "empty rows":
        assert torch.isinf(lse[1]).all() and not out[1].any()
    grads = attend_backward(dout, q, k, v, out.to(dtype), lse, pad, causal, 0.3, kernel)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert all(close(g, w, 4 * TOL[dtype]) for g, w in zip(grads, want[2:]))
    if pad is None:  # the formula is SDPA's
        sdpa = F.scaled_dot_product_attention(
            *(x.double() for x in (q, k, v)), is_causal=causal, scale=0.3, enable_gqa=kv_heads != q.shape[1]
        )
        assert torch.allclose(sdpa, want[0], atol=1e-12)


@pytest.mark.parametrize("kernel", [Kernel.CPU_FLASH, Kernel.MATH])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.float64, 1e-10)])
def test_blocks_merged_by_lse_and_their_backward_given_the_merged_lse(kernel, causal, dtype, tol):
    """Keys in two blocks (the second one ending at the queries' positions): the merged forward and the sum of
    the per-block backwards (each given the merged out, lse) equal attention over all keys. float64 merges in
    float64 (its own accumulation dtype), to 1e-10."""
    (q, k, v, dout), _ = inputs(dtype, kv_heads=2, sq=6, sk=10, seed=1)
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[1, 4:] = True  # batch 1's diagonal block is all padding: its rows get every key from block 0
    full = torch.ones(6, 10, dtype=torch.bool)
    if causal:  # queries at positions 4..9, keys 0..9
        full = torch.arange(4, 10)[:, None] >= torch.arange(10)[None, :]
    want = _masked_reference(q, k, v, dout, pad, full, 0.3)
    blocks = [(slice(0, 4), False), (slice(4, 10), causal)]
    out = torch.zeros(q.shape, dtype=accumulation_dtype(dtype))
    lse = torch.full(q.shape[:-1], -math.inf, dtype=accumulation_dtype(dtype))
    for cols, diag in blocks:
        part, part_lse = attend(q, k[:, :, cols], v[:, :, cols], pad[:, cols], diag, 0.3, kernel)
        merge_partial(out, lse, part, part_lse)
    assert close(out, want[0], tol)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for cols, diag in blocks:
        g = attend_backward(dout, q, k[:, :, cols], v[:, :, cols], out, lse, pad[:, cols], diag, 0.3, kernel)
        dq += g[0]
        dk[:, :, cols] += g[1]
        dv[:, :, cols] += g[2]
    assert all(close(x, w, 5 * tol) for x, w in zip((dq, dk, dv), want[2:]))


def _masked_reference(q, k, v, dout, pad, allowed, scale):
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * scale
    s = s.masked_fill(~(allowed & ~pad[:, None, None, :]), -math.inf)
    lse = torch.logsumexp(s, -1)
    out = torch.exp(s - lse[..., None]) @ v.repeat_interleave(groups, 1)
    return (out.detach(), lse.detach(), *torch.autograd.grad(out, (q, k, v), dout.double()))


# ---- the pairs of a ring step: no position mask ------------------------------------------------------------
def _plan(q_segments, kv_segments):
    return RingPlan(None, 0, q_segments, [kv_segments], [0], True, 1.0, Kernel.MATH)


@pytest.mark.parametrize(
    "q_seg, k_seg",
    [
        ((0, 10, 4), (0, 10, 4)),  # the diagonal square
        ((0, 10, 4), (0, 3, 12)),  # keys start before and end after the queries (allgather)
        ((0, 10, 6), (0, 12, 2)),  # keys inside the query range
        ((2, 10, 4), (1, 12, 5)),  # keys start inside, end after
        ((0, 10, 4), (0, 2, 9)),  # keys end exactly at the last query
        ((0, 10, 4), (0, 2, 9)),
        ((0, 10, 4), (0, 14, 3)),  # all keys in the future
        ((0, 10, 4), (0, 0, 11)),  # every key at or before the first query
    ],
)
def test_causal_pairs_cover_the_position_mask_with_unmasked_and_diagonal_pieces(q_seg, k_seg):
    qs, ks = Segment(*q_seg), Segment(*k_seg)
    rows_total, cols_total = qs.offset + qs.length, ks.offset + ks.length
    qpos = torch.full((rows_total,), -1)
    qpos[qs.offset :] = torch.arange(qs.start, qs.start + qs.length)
    kpos = torch.arange(ks.start - ks.offset, ks.start + ks.length)
    want = torch.zeros(rows_total, cols_total, dtype=torch.int64)
    want[qs.offset :, ks.offset :] = (qpos[qs.offset :, None] >= kpos[None, ks.offset :]).long()
    got = torch.zeros_like(want)
    for rows, cols, causal in _plan([qs], [ks]).pairs(0):
        piece = torch.ones(rows.stop - rows.start, cols.stop - cols.start, dtype=torch.int64)
        if causal:
            assert piece.shape[0] == piece.shape[1]  # a square whose positions coincide
            assert torch.equal(qpos[rows], kpos[cols])
            piece = piece.tril()
        got[rows, cols] += piece
    assert torch.equal(got, want)  # every visible pair once, nothing else


# ---- the choice ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "device, dtype, head_dim, padded, kernel",
    [
        (CPU, torch.float32, 64, False, Kernel.CPU_FLASH),
        (CPU, torch.float64, 300, True, Kernel.CPU_FLASH),
        (CUDA, torch.bfloat16, 128, False, Kernel.FLASH),
        (CUDA, torch.float16, 100, False, Kernel.FLASH),  # padded to 104 for the kernel
        (CUDA, torch.bfloat16, 128, True, Kernel.EFFICIENT),  # key padding: attn_bias
        (CUDA, torch.float32, 128, False, Kernel.EFFICIENT),
        (CUDA, torch.bfloat16, 512, False, Kernel.EFFICIENT),
    ],
)
def test_the_fused_kernel_that_supports_the_case(device, dtype, head_dim, padded, kernel):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_kernel(device, dtype, head_dim, padded=padded) == attention_kernels.KernelChoice(kernel)


def test_cudnn_when_sdpa_kernel_allows_only_it():
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        assert choose_kernel(CUDA, torch.bfloat16, 128, padded=True).kernel is Kernel.CUDNN


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(attention_kernels, "_warned", set())


@pytest.mark.parametrize(
    "device, dtype, head_dim, padded, backends, reason",
    [
        (
            CUDA,
            torch.float64,
            128,
            False,
            None,
            "flash: dtype torch.float64 (takes float16, bfloat16); efficient: dtype torch.float64 (takes float32, "
            "float16, bfloat16); cudnn: dtype torch.float64 (takes float16, bfloat16)",
        ),
        (
            CUDA,
            torch.bfloat16,
            512,
            True,
            [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH],
            "flash: head dim 512 (at most 256); efficient: disabled (torch.backends.cuda.enable_mem_efficient_sdp "
            "/ sdpa_kernel); cudnn: head dim 512 (at most 128)",
        ),
        (
            CUDA,
            torch.bfloat16,
            64,
            True,
            [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH],
            "flash: mask kind key padding (takes no attn_bias); efficient: disabled "
            "(torch.backends.cuda.enable_mem_efficient_sdp / sdpa_kernel); cudnn: disabled "
            "(torch.backends.cuda.enable_cudnn_sdp / sdpa_kernel)",
        ),
        (
            CPU,
            torch.float32,
            8,
            False,
            [SDPBackend.MATH],
            "the CPU flash kernel is disabled (torch.backends.cuda.enable_flash_sdp / sdpa_kernel)",
        ),
        (torch.device("meta"), torch.float32, 8, False, None, "device type 'meta' (fused kernels: CPU and CUDA)"),
    ],
)
def test_math_only_as_the_last_resort_warning_once_naming_why(
    device, dtype, head_dim, padded, backends, reason, fresh_warnings
):
    def choose():
        if backends is None:
            return choose_kernel(device, dtype, head_dim, padded=padded)
        with sdpa_kernel(backends):
            return choose_kernel(device, dtype, head_dim, padded=padded)

    with pytest.warns(RuntimeWarning) as caught:
        assert choose() == attention_kernels.KernelChoice(Kernel.MATH, reason)
    assert [str(w.message) for w in caught] == [
        f"cp_attention: no fused attention kernel for these blocks ({reason}); using the math kernel "
        "(fp32, float64 for float64 inputs), which materializes every (query, key) block's scores"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        assert choose().kernel is Kernel.MATH
