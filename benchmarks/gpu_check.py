"""GPU check of CP attention: every method against single-GPU SDPA on one CUDA device, in one command.

    python benchmarks/gpu_check.py [--world-sizes 1,2,4] [--seq 4096] [--time-seq 8192]

Needs a CUDA device (exits 2 with a message without one). All ranks share the one GPU: local processes on gloo
(``wf_mesh.testing.LocalCluster``; NCCL wants a device per rank) with CUDA tensors on ``cuda:0``; world 1 is
the block core alone (a ring of one). Per world size, method (ring, ulysses, usp at 4 as 2 x 2, allgather),
dtype (bfloat16, float32) and mask (causal + zigzag with GQA; key padding with rows that see no key; a
block-causal RangeMask of 8 chunks on its work-balanced plan, ``plan_cp_attention(mask=...)``), and KV-cache
decoding of 8 uneven chunks (``wf_mesh.KVCache``, forward only) against the dense block-causal mask:

- forward and backward (dq, dk, dv) max abs errors against float64 SDPA on the full sequence, judged with
  the CPU suite's tolerances (fp32 1e-4 abs + rel with TF32 off, bf16 3e-2);
- the kernel the block core chose (``wf_mesh.attention_kernels.choose_kernel``);

and at world 1 on ``--time-seq`` tokens: fused vs math fwd+bwd time (CUDA events, median of 5) and peak memory
(``torch.cuda.max_memory_allocated`` of one fwd+bwd), math forced with ``sdpa_kernel([SDPBackend.MATH])``.
Prints one table; exits 1 if any result is wrong or a case raised (the error is in the table), else 0.
Sized for well under 5 minutes on one H200.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import wf_mesh
from wf_mesh.attention import cp_attention, zigzag_shard
from wf_mesh.attention_kernels import choose_kernel
from wf_mesh.masks import RangeMask
from wf_mesh.testing import LocalCluster

TOL = {"bfloat16": 3e-2, "float32": 1e-4}
HEADS, KV_HEADS, HEAD_DIM, BATCH = 16, 4, 128, 1
FUSED_AND_MATH = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.MATH,
]


def _inputs(seq: int, dtype: torch.dtype, seed: int = 0, device: str = "cuda"):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(BATCH, KV_HEADS, seq, HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(2))
    pad = torch.rand(BATCH, seq, generator=g) < 0.3
    pad[:, : seq // 8] = True  # causal: the first queries see no key at all
    return [x.to(dtype=dtype, device=device) for x in (q, k, v, dout)], pad.to(device)


def _reference(q, k, v, dout, pad, causal, mask=None):
    """float64 SDPA on the full sequence: (out, dq, dk, dv); rows without keys give 0 (as the CP path does).
    ``mask``: a RangeMask (its dense matrix; ``causal`` is then False)."""
    q, k, v = (x.double().detach().requires_grad_() for x in (q, k, v))
    allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
    allowed = allowed.tril() if causal else allowed
    if mask is not None:
        allowed = mask.dense().to(q.device)
    if pad is not None:
        allowed = allowed & pad.logical_not()[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True).nan_to_num()
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout.double()))


def _error(got: torch.Tensor, want: torch.Tensor, tol: float) -> tuple[float, bool]:
    diff = (got.double() - want).abs()
    return diff.max().item(), bool((diff <= tol + tol * want.abs()).all())


def check_world(seq: int, device: str = "cuda") -> list[dict]:
    """On every rank: each method, dtype and mask against SDPA; the rows of rank 0 (every rank checks its own
    shard; a wrong shard anywhere makes that rank's row wrong, and the rows are and-ed over ranks)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    n = torch.distributed.get_world_size()
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=n, cp_ulysses=2 if n == 4 else 1))
    methods = ["ring", "ulysses", "allgather"] + (["usp"] if n == 4 else [])
    rows = []
    for dtype_name in ("bfloat16", "float32"):
        dtype = getattr(torch, dtype_name)
        (q, k, v, dout), pad = _inputs(seq, dtype, device=device)
        for mask in ("causal-zigzag-gqa", "padding", "block-causal-plan"):
            causal, padded = mask.startswith("causal"), mask == "padding"
            ranges = RangeMask.block_causal([seq // 8] * 8) if mask == "block-causal-plan" else None
            plan = wf_mesh.plan_cp_attention(mask=ranges, mesh=pm) if ranges is not None else None
            want = _reference(q, k, v, dout, pad if padded else None, causal, ranges)
            balance = "zigzag" if causal else None

            def shard(x, dim, balance=balance, plan=plan):
                if plan is not None:  # the work-balanced plan's tokens of this rank
                    return plan.shard(x, dim)
                if balance:
                    return zigzag_shard(x, dim, mesh=pm)
                return wf_mesh.shard_sequence(x, dim, mesh=pm, as_dtensor=False)

            kernel = choose_kernel(q.device, dtype, HEAD_DIM, padded=padded).kernel.value
            for method in methods:
                row = {"world": n, "method": method, "dtype": dtype_name, "mask": mask, "kernel": kernel}
                try:
                    leaves = [shard(x, 2).clone().requires_grad_() for x in (q, k, v)]
                    out = cp_attention(
                        *leaves,
                        layout="bhsd",
                        method=method,
                        mesh=pm,
                        causal=causal,
                        **({"plan": plan} if plan is not None else {"balance": balance}),
                        key_padding_mask=shard(pad, 1) if padded else None,
                    )
                    out.backward(shard(dout, 2))
                    got = [out.detach(), *(x.grad for x in leaves)]
                    errors = [_error(g, shard(w, 2), TOL[dtype_name]) for g, w in zip(got, want)]
                    row.update(fwd=errors[0][0], bwd=max(e for e, _ in errors[1:]), ok=all(ok for _, ok in errors))
                except Exception as exc:  # reported in the table, judged wrong
                    row.update(fwd=math.nan, bwd=math.nan, ok=False, error=f"{type(exc).__name__}: {exc}"[:200])
                verdict = torch.tensor([int(row["ok"])])
                torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MIN)
                row["ok"] = bool(verdict.item())
                rows.append(row)
    for dtype_name in ("bfloat16", "float32"):
        rows.append(_kv_cache_row(seq, getattr(torch, dtype_name), dtype_name, device))
    return rows


def _kv_cache_row(seq: int, dtype: torch.dtype, dtype_name: str, device: str) -> dict:
    """KV-cache decoding (``wf_mesh.KVCache``) of 8 uneven chunks against SDPA with the dense block-causal mask."""
    (q, k, v, _), _ = _inputs(seq, dtype, seed=2, device=device)
    chunks = [seq // 8 + (1 if c % 2 else -1) for c in range(8)]
    chunks[-1] += seq - sum(chunks)
    row = {"world": torch.distributed.get_world_size(), "method": "kv_cache", "dtype": dtype_name}
    row.update(mask="block-causal-decode", kernel=choose_kernel(q.device, dtype, HEAD_DIM, padded=False).kernel.value)
    try:
        cache = wf_mesh.KVCache(
            layers=1, batch=BATCH, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype, device=device
        )
        outputs, start = [], 0
        with torch.no_grad():
            for n in chunks:
                step = cache.next_chunk(n)
                mine = [step.shard(t[:, :, start : start + n], seq_dim=2) for t in (q, k, v)]
                outputs.append(step.gather(step.attend(0, *mine), seq_dim=2))
                start += n
        want = _reference(q, k, v, torch.zeros_like(q), None, False, RangeMask.block_causal(chunks))[0]
        err, ok = _error(torch.cat(outputs, dim=2), want, TOL[dtype_name])
        row.update(fwd=err, bwd=math.nan, ok=ok)
    except Exception as exc:  # reported in the table, judged wrong
        row.update(fwd=math.nan, bwd=math.nan, ok=False, error=f"{type(exc).__name__}: {exc}"[:200])
    verdict = torch.tensor([int(row["ok"])])
    torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MIN)
    row["ok"] = bool(verdict.item())
    return row


def _fwd_bwd_time_and_memory(seq: int, dtype: torch.dtype, force_math: bool) -> tuple[float, int, str]:
    (q, k, v, dout), _ = _inputs(seq, dtype, seed=1)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    pm = wf_mesh.get_parallel_mesh()

    def step():
        out = cp_attention(*leaves, layout="bhsd", mesh=pm, causal=True)
        out.backward(dout)

    with sdpa_kernel([SDPBackend.MATH] if force_math else FUSED_AND_MATH), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the math fallback's warning: forced here
        kernel = choose_kernel(q.device, dtype, HEAD_DIM, padded=False).kernel.value
        step()  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), peak, kernel


def time_world_one(seq: int) -> list[dict]:
    wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=1))
    rows = []
    for dtype_name in ("bfloat16", "float32"):
        dtype = getattr(torch, dtype_name)
        fused_s, fused_mem, kernel = _fwd_bwd_time_and_memory(seq, dtype, force_math=False)
        math_s, math_mem, _ = _fwd_bwd_time_and_memory(seq, dtype, force_math=True)
        rows.append(
            {
                "dtype": dtype_name,
                "kernel": kernel,
                "fused_ms": fused_s * 1e3,
                "math_ms": math_s * 1e3,
                "fused_MiB": fused_mem / 2**20,
                "math_MiB": math_mem / 2**20,
            }
        )
    return rows


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="1,2,4", help="comma-separated cp sizes (default 1,2,4)")
    parser.add_argument("--seq", type=int, default=4096, help="full sequence length of the value checks")
    parser.add_argument("--time-seq", type=int, default=8192, help="sequence length of the timing (world 1)")
    parser.add_argument("--device", default="cuda", help="cpu: the value checks on CPU (trying the script out)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"benchmarks/gpu_check.py: needs a CUDA device; torch {torch.__version__} sees none "
            f"(torch.cuda.is_available() is False, built with CUDA {torch.version.cuda})",
            file=sys.stderr,
        )
        return 2
    worlds = [int(w) for w in args.world_sizes.split(",")]
    rows: list[dict] = []
    timing: list[dict] = []
    for n in worlds:  # the clusters first: this process never initializes CUDA (its workers fork from a server)
        cluster = LocalCluster(n, timeout=600).start()
        try:
            rows += cluster.run(check_world, args.seq, args.device)[0]
            if n == 1 and args.device == "cuda":
                timing = cluster.run(time_world_one, args.time_seq)[0]
        finally:
            cluster.shutdown()
    print(
        f"# CP attention, cp {worlds} processes sharing one GPU; S={args.seq}, H={HEADS}, Hkv={KV_HEADS}, D={HEAD_DIM}"
    )
    print(f"{'world':>5} {'method':>9} {'dtype':>8} {'mask':>18} {'kernel':>10} {'fwd err':>9} {'bwd err':>9}  ok")
    for r in rows:
        print(
            f"{r['world']:>5} {r['method']:>9} {r['dtype']:>8} {r['mask']:>18} {r['kernel']:>10} {r['fwd']:>9.2e} "
            f"{r['bwd']:>9.2e}  {'yes' if r['ok'] else 'NO'}" + (f"  {r['error']}" if "error" in r else "")
        )
    if timing:
        print(f"\n# fused vs math, world 1, causal, S={args.time_seq}: fwd+bwd (median of 5) and peak memory")
        print(
            f"{'dtype':>8} {'kernel':>10} {'fused ms':>9} {'math ms':>9} {'math/fused':>10} {'MiB fused':>10} {'math':>8}"
        )
        for t in timing:
            print(
                f"{t['dtype']:>8} {t['kernel']:>10} {t['fused_ms']:>9.2f} {t['math_ms']:>9.2f} "
                f"{t['math_ms'] / t['fused_ms']:>10.2f} {t['fused_MiB']:>10.1f} {t['math_MiB']:>8.1f}"
            )
    wrong = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(wrong)} of {len(rows)} cases right")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
