"""A video-generation server loop under context parallelism that survives one request's failure.

Each request runs a small DiT attention layer over its tokens, sharded over cp (ring attention, then the output
gathered on every rank). With ``contain_faults=True`` a rank whose step fails mid-ring (simulated here with
``--fail-at``: rank 1's block kernel at ring hop 2 raises MemoryError) does not leave its peers waiting: every
rank raises that error, answers "failed" for the request, and serves the next one on the same mesh, exactly.

    torchrun --nproc-per-node 4 examples/serve_video_dit.py --requests 20 --fail-at 5,13
"""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange

import wf_mesh
from wf_mesh.testing import injected_fault

DIM, HEADS = 32, 4


def weights() -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's weights, the same on every rank (a server loads them)."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(DIM, 3 * DIM, generator=g) / DIM**0.5, torch.randn(DIM, DIM, generator=g) / DIM**0.5


def request_tokens(i: int) -> torch.Tensor:
    """Request ``i``'s tokens ``(1, S, DIM)``; lengths vary (uneven shards)."""
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(1, 24 + 3 * (i % 5), DIM, generator=g)


def layer(x: torch.Tensor, attention: Callable[..., torch.Tensor]) -> torch.Tensor:
    """One attention layer over ``x`` ``(1, S, DIM)``, ``attention(q, k, v)`` on ``(B, H, S, D)``."""
    w_qkv, w_out = weights()
    q, k, v = rearrange(x @ w_qkv, "b s (three h d) -> three b h s d", three=3, h=HEADS)
    return rearrange(attention(q, k, v), "b h s d -> b s (h d)") @ w_out


def answer(x: torch.Tensor, mesh: wf_mesh.ParallelMesh) -> torch.Tensor:
    """The request's output ``(1, S, DIM)`` on every rank: the layer on this rank's tokens, gathered."""
    local = wf_mesh.shard_sequence(x, 1, mesh=mesh, as_dtensor=False)
    out = layer(local, lambda q, k, v: wf_mesh.cp_attention(q, k, v, method="ring", mesh=mesh, layout="bhsd"))
    return wf_mesh.gather_sequence(out, 1, mesh=mesh, seq_len=x.shape[1])


def reference(i: int) -> torch.Tensor:
    """Request ``i``'s output computed by one process."""
    return layer(request_tokens(i), F.scaled_dot_product_attention)


def resources() -> tuple[int, int, int]:
    """``(open file descriptors, threads, resident bytes)`` of this process (Linux)."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return len(os.listdir("/proc/self/fd")), threading.active_count(), rss


def serve(
    mesh: wf_mesh.ParallelMesh, requests: int, fail_at: frozenset[int] = frozenset(), fail_rank: int = 1
) -> tuple[list[torch.Tensor | str], list[tuple[int, int, int]]]:
    """Serve ``requests`` requests; request ``i`` in ``fail_at`` fails on ``fail_rank`` at ring hop 2.

    Returns:
        ``(answers, resources)``: each request's output or ``"failed"``, and :func:`resources` after each.
    """
    answers: list[torch.Tensor | str] = []
    seen = []
    for i in range(requests):
        fails = i in fail_at and dist.get_rank() == fail_rank
        oom = injected_fault("ring hop", 2, MemoryError(f"request {i}: out of memory")) if fails else None
        try:
            with oom or contextlib.nullcontext(), torch.no_grad():
                answers.append(answer(request_tokens(i), mesh))
        except MemoryError:
            answers.append("failed")
        seen.append(resources())
    return answers, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--fail-at", default="5,13", help="requests that fail on rank 1 (comma-separated)")
    args = parser.parse_args()
    fail_at = frozenset(int(i) for i in args.fail_at.split(",") if i)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    with wf_mesh.init_from_env(wf_mesh.ParallelDims(cp=world), contain_faults=True) as session:
        answers, _ = serve(session.mesh, args.requests, fail_at)
        exact = all(isinstance(a, str) or torch.allclose(a, reference(i), atol=1e-5) for i, a in enumerate(answers))
        if session.rank == 0:
            failed = [i for i, a in enumerate(answers) if isinstance(a, str)]
            print(f"served {len(answers) - len(failed)} of {len(answers)}; failed: {failed}; exact: {exact}")


if __name__ == "__main__":
    main()
