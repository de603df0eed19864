"""Per-rank functions of ``placements.ipynb``: each runs on every rank of a :class:`~wf_mesh.testing.LocalCluster`.

A function defined in a notebook cannot be sent to the cluster's workers (they cannot import the kernel's
``__main__``), so the notebook's distributed steps live here, next to it. The workers import this module by
name: the notebook puts this folder on ``sys.path`` before it starts the cluster (the workers are forked from a
server process that the first cluster starts with the kernel's ``sys.path``)::

    import sys; sys.path.insert(0, "<this folder>")
    import placements_helpers as helpers
    cluster = LocalCluster(4).start()
    pieces = cluster.run(helpers.latent_pieces, (1, 4, 2, 8, 8), cp=4)   # one dict per rank

Each function builds its own mesh (the cluster destroys it after every call) and returns plain, picklable
values: views as text and as HTML (``PlacementView(dtensor)`` on the rank), shapes, collective counts.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import wf_mesh
from wf_mesh import ParallelDims, PlacementView, init_parallel, plan_video_split
from wf_mesh.viz import parse_placement

__all__ = ["TRANSITIONS", "attention_shards", "fsdp_ema_shards", "latent_pieces", "redistribute_costs"]

PATCH = (1, 2, 2)
"""Patch size (T, H, W) of the video model: a patch token covers ``1 x 2 x 2`` latent positions."""


def _seeded(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))  # the same on every rank


def latent_pieces(shape: tuple[int, int, int, int, int], cp: int) -> dict:
    """Shard a ``(B, C, T, H, W)`` latent over ``cp`` ranks with :func:`~wf_mesh.plan_video_split` (time first,
    then height); return this rank's (T, H) block, its sequence shape ``(B, latent positions, C)``, its patch
    tokens (positions / patch size), whether a gather restores the latent, and the placement view of the token
    sequence (a real DTensor) as text and HTML."""
    mesh = init_parallel(ParallelDims(cp=cp))
    latent = _seeded(shape)
    split = plan_video_split(shape, cp, PATCH)
    sequence = split.shard(latent, as_dtensor=True)
    tokens = sequence.to_local()
    t_block, h_block = split.block(mesh.rank("cp"))
    view = PlacementView(sequence, dim_names=("B", "positions", "C"))
    return {
        "rank": dist.get_rank(),
        "cp_rank": mesh.rank("cp"),
        "t": (t_block.start, t_block.stop),
        "h": (h_block.start, h_block.stop),
        "sequence": tuple(tokens.shape),
        "patch_tokens": tokens.shape[1] // math.prod(PATCH),
        "restored": torch.equal(split.gather(tokens), latent),
        "view": str(view),
        "html": view._repr_html_(),
    }


TRANSITIONS = [
    ("R, R", "R, S(1)"),
    ("R, S(1)", "R, R"),
    ("R, S(1)", "R, S(2)"),
    ("S(0), S(1)", "R, R"),
    ("R, P", "R, R"),
    ("R, P", "R, S(1)"),
]
"""Placement changes on a 2-D ``(dp, cp)`` mesh that :func:`redistribute_costs` measures."""


def redistribute_costs(shape: tuple[int, ...] = (4, 8, 6), transitions=TRANSITIONS) -> list[dict]:
    """Redistribute a tensor between placements on the ``(dp, cp)`` axes of a dp=2 x cp=2 mesh and count the
    collectives each change issues (CommDebugMode); checks every result against the full tensor."""
    # gloo has no all-to-all: DTensor falls back to an all-gather and logs a warning saying so (the notebook
    # says it in words instead).
    logging.getLogger("torch.distributed.tensor._collective_utils").setLevel(logging.ERROR)
    mesh = init_parallel(ParallelDims(cp=2))
    submesh = mesh.root["dp", "cp"]
    full = _seeded(shape)
    rows = []
    for source, target in transitions:
        src = [parse_placement(p) for p in source.split(", ")]
        dst = [parse_placement(p) for p in target.split(", ")]
        if any(p.is_partial() for p in src):  # a Partial tensor: each rank holds one term of the sum
            terms = submesh.size(1)
            x = DTensor.from_local(full / terms, submesh, src, shape=full.shape, stride=full.stride())
        else:
            x = distribute_tensor(full, submesh, src, src_data_rank=None)
        with CommDebugMode() as comm:
            y = x.redistribute(submesh, dst)
        counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
        rows.append(
            {
                "from": source,
                "to": target,
                "collectives": counts,
                "local": tuple(y.to_local().shape),
                "correct": torch.allclose(y.full_tensor(), full, atol=1e-6),
            }
        )
    return rows


def fsdp_ema_shards(dp_replicate: int | None = None, steps: int = 2) -> dict:
    """FSDP2 (``fully_shard`` over the dp_cp axis, or HSDP with ``dp_replicate``) on a tiny MLP, a few AdamW
    steps with :class:`~wf_mesh.ShardedEMA`; return the placement views (text and HTML) of the first Linear's
    weight ``(out, in)`` and of its EMA shard, and the weight's placements and local shape."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_parallel(ParallelDims(cp=2), dp_replicate=dp_replicate)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.GELU(), torch.nn.Linear(10, 3))
    fully_shard(model, mesh=mesh.hsdp_mesh() if dp_replicate else mesh.fsdp_mesh())
    ema = wf_mesh.ShardedEMA(model, beta=0.9)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        model(_seeded((4, 6)) + step).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update(model)
    weight = PlacementView(model[0].weight, dim_names=("out", "in"))
    ema_weight = ema.state_dict()["0.weight"]
    ema_view = PlacementView(ema_weight, dim_names=("out", "in"))
    return {
        "rank": dist.get_rank(),
        "weight": str(weight),
        "weight_html": weight._repr_html_(),
        "ema": str(ema_view),
        "ema_local": tuple(ema_weight.to_local().shape),
        "ema_dtype": str(ema_weight.dtype),
        "weight_placements": [str(p) for p in model[0].weight.placements],
        "weight_local": tuple(model[0].weight.to_local().shape),
    }


def attention_shards(seq_len: int = 30, heads: int = 4, cp: int = 4, cp_ulysses: int = 2) -> dict:
    """Who holds which tokens and heads at each stage of CP attention on a (cp_ring x cp_ulysses) split, and
    each method's largest difference from single-process SDPA (the gathered forward output)."""
    import torch.nn.functional as F

    from wf_mesh.sizing import chunk_range

    mesh = init_parallel(ParallelDims(cp=cp, cp_ulysses=cp_ulysses))
    c, u = mesh.rank("cp"), mesh.rank("cp_ulysses")
    q, k, v = (_seeded((1, heads, seq_len, 8)) * (i + 1) for i in range(3))  # the same on every rank
    want = F.scaled_dot_product_attention(q, k, v)
    group = mesh.ranks("cp_ulysses")  # the Ulysses group: consecutive cp ranks, contiguous tokens
    tokens = [chunk_range(seq_len, cp, mesh.dims.coords(r)["cp"]) for r in group]
    per = heads // cp_ulysses
    errors = {}
    for method in ("ring", "ulysses", "usp", "allgather"):
        shards = [wf_mesh.shard_sequence(t, seq_dim=2).detach().requires_grad_() for t in (q, k, v)]
        out = wf_mesh.cp_attention(*shards, layout="bhsd", method=method)
        full = wf_mesh.gather_sequence(out, seq_dim=2)
        errors[method] = (full - want).abs().max().item()
    return {
        "rank": dist.get_rank(),
        "cp": c,
        "ring": mesh.rank("cp_ring"),
        "ulysses": u,
        "tokens": chunk_range(seq_len, cp, c),
        "usp_heads": (u * per, (u + 1) * per),
        "usp_tokens": (tokens[0][0], tokens[-1][1]),
        "ring_peers": mesh.ranks("cp_ring"),
        "max_error": errors,
    }
