"""Which kernel computes one (query rows, key block) pair of context-parallel attention, and the call itself.

CP attention needs, for each pair, ``(out, lse)`` with the row log-sum-exp (to merge partial results over key
blocks; fp32, float64 for float64 inputs: :func:`accumulation_dtype`) and a backward that takes the MERGED out
and lse of the whole key range (so that each block's probabilities are its exact share of the full softmax, as
in ring attention). The fused SDPA kernels do both;
:func:`choose_kernel` picks one per call, in the order torch's SDPA prefers them:

===========  ==============================  ==========================================================
kernel       runs on                         takes
===========  ==============================  ==========================================================
flash        CUDA, sm80+                     float16/bfloat16, head dim <= 256, causal, grouped-query
                                             K/V as they are; no key padding
efficient    CUDA, sm50+                     float32/float16/bfloat16, any head dim, causal, key padding
                                             as an expanded ``attn_bias`` (no ``(Sq, Sk)`` buffer);
                                             grouped-query K/V repeated to the query heads (per block)
cudnn        CUDA, sm80+                     float16/bfloat16, head dim <= 128, as efficient; picked only
                                             when flash and efficient are disabled (``sdpa_kernel``)
cpu_flash    CPU                             every float dtype, causal, key padding as a ``(B, 1, 1, Sk)``
                                             bias, grouped-query K/V as they are
math         anywhere (the last resort)      everything; materializes the pair's ``(Sq, Sk)`` scores (fp32;
                                             float64 for float64: the only CUDA kernel for float64)
===========  ==============================  ==========================================================

The only masks a pair carries are the key padding mask and the causal mask of two equal position ranges
(the kernels' own causal mode): :meth:`wf_mesh.attention_ops.RingPlan.pairs` cuts every other causal pair
into fully visible and diagonal pieces, so no path builds a position mask. Kernels torch's SDPA switches off
(``torch.backends.cuda.enable_flash_sdp(False)``, ``sdpa_kernel(...)``) are not picked; on CPU the flash
switch decides between cpu_flash and math. When math is picked it warns once per reason
(:func:`choose_kernel`), naming what ruled out each fused kernel.

A row that sees no key (every key of the block padded) gets out 0 and lse -inf whatever the kernel reports
there (the kernels differ: 0, +inf or NaN); the backward treats an lse of -inf as "no key anywhere" (zero
gradients). Head dims that are not a multiple of 8 are zero-padded for the fused CUDA kernels (as SDPA does):
the scale is passed explicitly, so the result is unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings

import torch

from wf_mesh import _compat

__all__ = ["Kernel", "KernelChoice", "accumulation_dtype", "attend", "attend_backward", "choose_kernel"]


class Kernel(enum.Enum):
    """The kernels one (query rows, key block) pair can run on."""

    FLASH = "flash"
    EFFICIENT = "efficient"
    CUDNN = "cudnn"
    CPU_FLASH = "cpu_flash"
    MATH = "math"


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """A kernel and, for the math kernel, why no fused one runs (None when math is not a fallback)."""

    kernel: Kernel
    reason: str | None = None


_HALF = (torch.float16, torch.bfloat16)
_CUDA_FUSED = (Kernel.FLASH, Kernel.EFFICIENT, Kernel.CUDNN)
_HEAD_DIM_ALIGN = 8
_BIAS_ALIGN = 16  # elements: the efficient kernel's bias strides must be multiples of 16 bytes / 8 elements
_warned: set[str] = set()


def _capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability.

    Returns:
        ``(major, minor)``; on a build without CUDA (fake CUDA tensors) ``(9, 0)``, the newest hardware, so
        that the choice is the one a GPU would make.
    """
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability(device)
    return (9, 0)


def _cuda_refusals(device: torch.device, dtype: torch.dtype, head_dim: int, padded: bool) -> dict[Kernel, str]:
    """Why each fused CUDA kernel cannot run this case (kernels that can are absent)."""
    major, minor = _capability(device)
    sm = f"sm{major}{minor}"
    backends = torch.backends.cuda
    out: dict[Kernel, str] = {}
    if not backends.flash_sdp_enabled():
        out[Kernel.FLASH] = "disabled (torch.backends.cuda.enable_flash_sdp / sdpa_kernel)"
    elif dtype not in _HALF:
        out[Kernel.FLASH] = f"dtype {dtype} (takes float16, bfloat16)"
    elif head_dim > 256:
        out[Kernel.FLASH] = f"head dim {head_dim} (at most 256)"
    elif padded:
        out[Kernel.FLASH] = "mask kind key padding (takes no attn_bias)"
    elif major < 8:
        out[Kernel.FLASH] = f"{sm} (needs sm80+)"
    if not backends.mem_efficient_sdp_enabled():
        out[Kernel.EFFICIENT] = "disabled (torch.backends.cuda.enable_mem_efficient_sdp / sdpa_kernel)"
    elif dtype not in (*_HALF, torch.float32):
        out[Kernel.EFFICIENT] = f"dtype {dtype} (takes float32, float16, bfloat16)"
    elif major < 5:
        out[Kernel.EFFICIENT] = f"{sm} (needs sm50+)"
    if not backends.cudnn_sdp_enabled():
        out[Kernel.CUDNN] = "disabled (torch.backends.cuda.enable_cudnn_sdp / sdpa_kernel)"
    elif dtype not in _HALF:
        out[Kernel.CUDNN] = f"dtype {dtype} (takes float16, bfloat16)"
    elif head_dim > 128:
        out[Kernel.CUDNN] = f"head dim {head_dim} (at most 128)"
    elif major < 8:
        out[Kernel.CUDNN] = f"{sm} (needs sm80+)"
    return out


def choose_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, *, padded: bool) -> KernelChoice:
    """The kernel for the blocks of one cp_attention call; warns once per reason when it is the math one.

    Args:
        device: where q, k, v live.
        dtype: their dtype.
        head_dim: their last dim.
        padded: whether a key padding mask comes with the keys (causal needs no flag: every kernel has a
            causal mode, and pairs carry no other position mask).

    Returns:
        The kernel, with the reason when it is the math fallback.
    """
    if device.type == "cpu":
        if torch.backends.cuda.flash_sdp_enabled():  # the switch SDPA itself consults on CPU
            return KernelChoice(Kernel.CPU_FLASH)
        return _fallback("the CPU flash kernel is disabled (torch.backends.cuda.enable_flash_sdp / sdpa_kernel)")
    if device.type != "cuda":
        return _fallback(f"device type {device.type!r} (fused kernels: CPU and CUDA)")
    refused = _cuda_refusals(device, dtype, head_dim, padded)
    for kernel in _CUDA_FUSED:
        if kernel not in refused:
            return KernelChoice(kernel)
    return _fallback("; ".join(f"{k.value}: {why}" for k, why in refused.items()))


def _fallback(reason: str) -> KernelChoice:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"cp_attention: no fused attention kernel for these blocks ({reason}); using the math kernel "
            "(fp32, float64 for float64 inputs), which materializes every (query, key) block's scores",
            RuntimeWarning,
            stacklevel=4,
        )
    return KernelChoice(Kernel.MATH, reason)


# ---- helpers --------------------------------------------------------------------------------------------
def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of softmax statistics, merged outputs and accumulated gradients for inputs of ``dtype``.

    Returns:
        float64 for float64 (float64 stays float64 end to end), float32 otherwise.
    """
    return torch.promote_types(dtype, torch.float32)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """K/V with ``heads`` heads (grouped-query heads repeated, as ``enable_gqa=True`` pairs them)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Gradients of repeated K/V heads summed back onto the ``kv_heads`` they repeat."""
    if grad.shape[1] == kv_heads:
        return grad
    return grad.unflatten(1, (kv_heads, grad.shape[1] // kv_heads)).sum(2)


def _pad_head_dim(x: torch.Tensor) -> torch.Tensor:
    extra = -x.shape[-1] % _HEAD_DIM_ALIGN
    return torch.nn.functional.pad(x, (0, extra)) if extra else x


def _padding_bias(pad: torch.Tensor, dtype: torch.dtype, heads: int, q_len: int, align: int) -> torch.Tensor:
    """Additive ``-inf`` bias of the padded keys.

    Returns:
        ``(B, H, Sq, Sk)`` as an expanded view of one ``(B, 1, 1, Sk')`` buffer (``Sk'`` = Sk rounded up to
        ``align``): ``B * Sk'`` elements, never ``Sq * Sk``.
    """
    b, sk = pad.shape
    buf = torch.zeros(b, 1, 1, sk + (-sk % align), dtype=dtype, device=pad.device)
    bias = buf.narrow(-1, 0, sk)
    bias.masked_fill_(pad.view(b, 1, 1, sk), -math.inf)
    return bias.expand(b, heads, q_len, sk)


def _rows_without_keys(pad: torch.Tensor, causal: bool) -> torch.Tensor:
    """The query rows that see no key of the block.

    Returns:
        Bool ``(B, 1, Sq|1)`` (causal: rows i of an aligned square whose keys ``0..i`` are all padding).
    """
    if causal:
        return (pad.logical_not().cumsum(-1) == 0).unsqueeze(1)
    return pad.all(-1).view(-1, 1, 1)


# ---- forward and backward of one pair -----------------------------------------------------------------
def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pad: torch.Tensor | None,
    causal: bool,
    scale: float,
    kernel: Kernel,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of q against one key block on ``kernel``.

    Args:
        q: ``(B, H, Sq, D)``.
        k: ``(B, Hkv, Sk, D)``, ``H % Hkv == 0`` (query head h uses key head ``h // (H // Hkv)``).
        v: like k.
        pad: bool ``(B, Sk)``, True = padding key, or None.
        causal: the causal mask of two equal position ranges (``Sq == Sk``, query i sees keys ``0..i``).
        scale: the softmax scale.
        kernel: from :func:`choose_kernel`.

    Returns:
        ``out`` ``(B, H, Sq, D)`` (q's dtype; fp32 from the math kernel) and ``lse`` ``(B, H, Sq)`` in fp32
        (float64 for float64 inputs), -inf with out 0 for rows that see no key.
    """
    heads = q.shape[1]
    if kernel is Kernel.MATH:
        return _math_forward(q, k, v, pad, causal, scale)
    if kernel is Kernel.CPU_FLASH:
        bias = None if pad is None else _padding_bias(pad, q.dtype, 1, 1, 1)
        out, lse = _compat.flash_attention_cpu(q, k, v, bias, causal, scale)
    else:
        d = q.shape[-1]
        qq = _pad_head_dim(q)
        if kernel is Kernel.FLASH:
            out, lse = _compat.flash_attention_cuda(qq, _pad_head_dim(k), _pad_head_dim(v), causal, scale)
        else:
            kk, vv = (_pad_head_dim(_expand_heads(x, heads)) for x in (k, v))
            bias = None if pad is None else _padding_bias(pad, q.dtype, heads, q.shape[2], _BIAS_ALIGN)
            attention = _compat.efficient_attention_cuda if kernel is Kernel.EFFICIENT else _compat.cudnn_attention_cuda
            out, lse = attention(qq, kk, vv, bias, causal, scale)
        out = out.narrow(-1, 0, d)
    if pad is not None:
        empty = _rows_without_keys(pad, causal)
        lse = lse.masked_fill(empty, -math.inf)
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse


def attend_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    pad: torch.Tensor | None,
    causal: bool,
    scale: float,
    kernel: Kernel,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one pair given the MERGED ``out`` (q's dtype) and ``lse`` of the whole key range.

    Args:
        dout: the output's gradient, ``(B, H, Sq, D)``.
        q: as for :func:`attend`.
        k: as for :func:`attend`.
        v: as for :func:`attend`.
        out: the merged output of these query rows over every key block.
        lse: their merged log-sum-exp (accumulation dtype) ``(B, H, Sq)``; -inf: the row sees no key anywhere.
        pad: as for :func:`attend`.
        causal: as for :func:`attend`.
        scale: as for :func:`attend`.
        kernel: as for :func:`attend`.

    Returns:
        Gradients shaped like q, k, v (dk, dv with the ``Hkv`` heads of k, v).
    """
    lse = lse.masked_fill(lse == -math.inf, 0.0)  # every score of such a row is -inf: p = 0 whatever lse is
    heads, kv_heads = q.shape[1], k.shape[1]
    if kernel is Kernel.MATH:
        return _math_backward(dout, q, k, v, out, lse, pad, causal, scale)
    if kernel is Kernel.CPU_FLASH:
        bias = None if pad is None else _padding_bias(pad, q.dtype, 1, 1, 1)
        return _compat.flash_attention_cpu_backward(dout, q, k, v, out, lse, bias, causal, scale)
    d = q.shape[-1]
    qq, oo, do = (_pad_head_dim(x) for x in (q, out, dout))
    if kernel is Kernel.FLASH:
        grads = _compat.flash_attention_cuda_backward(
            do, qq, _pad_head_dim(k), _pad_head_dim(v), oo, lse, causal, scale
        )
    else:
        kk, vv = (_pad_head_dim(_expand_heads(x, heads)) for x in (k, v))
        bias = None if pad is None else _padding_bias(pad, q.dtype, heads, q.shape[2], _BIAS_ALIGN)
        backward = (
            _compat.efficient_attention_cuda_backward
            if kernel is Kernel.EFFICIENT
            else _compat.cudnn_attention_cuda_backward
        )
        grads = backward(do, qq, kk, vv, oo, lse, bias, causal, scale)
    dq, dk, dv = (g.narrow(-1, 0, d) for g in grads)
    return dq, _fold_heads(dk, kv_heads), _fold_heads(dv, kv_heads)


# ---- the math kernel (the last resort) --------------------------------------------------------------------
def _allowed(pad: torch.Tensor | None, causal: bool, q_len: int, k_len: int, device: torch.device):
    """Bool ``(B|1, 1, Sq|1, Sk)`` of the keys each query may see (None: all of them)."""
    allowed = None if pad is None else ~pad[:, None, None, :]
    if causal:
        tri = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()
        allowed = tri if allowed is None else allowed & tri
    return allowed


def _math_forward(q, k, v, pad, causal, scale):
    acc, heads = accumulation_dtype(q.dtype), q.shape[1]
    s = torch.matmul(q.to(acc), _expand_heads(k, heads).to(acc).transpose(-1, -2)) * scale
    allowed = _allowed(pad, causal, q.shape[2], k.shape[2], q.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(lse == -math.inf, 0)[..., None])
    return torch.matmul(p, _expand_heads(v, heads).to(acc)), lse


def _math_backward(dout, q, k, v, out, lse, pad, causal, scale):
    acc, heads, kv_heads = accumulation_dtype(q.dtype), q.shape[1], k.shape[1]
    qf, kf, vf, do = q.to(acc), _expand_heads(k, heads).to(acc), _expand_heads(v, heads).to(acc), dout.to(acc)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    allowed = _allowed(pad, causal, q.shape[2], k.shape[2], q.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    p = torch.exp(s - lse.to(acc)[..., None])
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - (do * out.to(acc)).sum(-1, keepdim=True))
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    return dq, _fold_heads(dk, kv_heads), _fold_heads(dv, kv_heads)
