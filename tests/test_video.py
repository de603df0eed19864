"""Video latent CP plans: find_split-based blocks, sequence shards, position embeddings, restore."""

import math
import re
from contextlib import nullcontext

import pytest
import torch

import wf_mesh
from wf_mesh import parallel_state as ps
from wf_mesh.testing import run_distributed

from helpers import raised_everywhere


def latent(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_plan_follows_find_split_without_global_state():
    ps.destroy_model_parallel()  # a find_split of an earlier test in this process may have set cp_size_t
    split = wf_mesh.plan_video_split((1, 16, 24, 88, 160), 16)
    assert (split.cp_t, split.cp_h, split.local_thw) == (8, 2, (3, 44, 160))
    assert not hasattr(ps, "cp_size_t")  # the native planner has no side effect; the legacy find_split sets it
    assert wf_mesh.find_split((1, 16, 24, 88, 160), 16) == torch.Size(split.local_thw) and ps.cp_size_t == 8
    split = wf_mesh.plan_video_split((2, 4, 5, 8, 6), 4)  # T=5 cannot take a factor of 4: height gets it all
    assert (split.cp_t, split.cp_h, split.local_thw) == (1, 4, (5, 2, 6))
    ps.destroy_model_parallel()
    assert not hasattr(ps, "cp_size_t")
    with pytest.raises(ValueError, match="a factor 2 is left for W, which is never split"):  # find_split's rule
        wf_mesh.plan_video_split((1, 16, 21, 88, 160), 8, split_width=False)


@pytest.mark.parametrize(
    "shape, cp, patch, splits, local",
    [  # width takes what time and height cannot: refused before
        ((1, 16, 21, 88, 160), 8, (1, 2, 2), (1, 4, 2), (21, 22, 80)),
        ((1, 4, 3, 6, 8), 2, (1, 2, 2), (1, 1, 2), (3, 6, 4)),  # H=6 is 3 patches: W takes the 2
        ((1, 4, 3, 6, 8), 6, (1, 2, 2), (3, 1, 2), (1, 6, 4)),
        ((1, 4, 4, 8, 4), 4, (1, 2, 2), (4, 1, 1), (1, 8, 4)),  # as before: time first
        ((1, 4, 2, 4, 12), 12, (1, 2, 2), (2, 2, 3), (1, 2, 4)),  # every dim split
    ],
)
def test_plan_splits_width_when_time_and_height_are_exhausted(shape, cp, patch, splits, local):
    split = wf_mesh.plan_video_split(shape, cp, patch)
    assert ((split.cp_t, split.cp_h, split.cp_w), split.local_thw, split.patch) == (splits, local, patch)
    with pytest.raises(ValueError, match="left for W, which is never split") if splits[2] > 1 else nullcontext():
        wf_mesh.plan_video_split(shape, cp, patch, split_width=False)


def test_token_grid_of_the_plan():
    split = wf_mesh.plan_video_split((1, 16, 4, 8, 12), 8, (1, 2, 2))
    assert (split.token_grid, split.local_token_grid, split.local_thw) == ((4, 4, 6), (1, 2, 6), (1, 4, 12))
    assert split.token_block(5) == (slice(2, 3), slice(2, 4), slice(0, 6))  # rank 5 = (t 2, h 1, w 0)
    assert split.latent_block(5) == (slice(2, 3), slice(4, 8), slice(0, 12)) and split.block(5) == (
        slice(2, 3),
        slice(4, 8),
    )
    odd = wf_mesh.plan_video_split((1, 16, 4, 8, 5), 4, (1, 2, 2))  # W=5 is never split, but is no whole grid
    with pytest.raises(ValueError, match=r"W=5 is not a multiple of its patch 2 \(patch \(1, 2, 2\)\)"):
        _ = odd.token_grid


@pytest.mark.parametrize(
    "call, error, message",
    [  # silently wrong before: H=5 over 2 ranks dropped a row, zero-length dims gave zero shapes
        (
            lambda: wf_mesh.plan_video_split((1, 2, 1, 5, 4), 2),
            ValueError,
            "H=5 over 2 ranks would not give equal blocks of whole 2-wide patches (each block 2, 1 left over); make H "
            "a multiple of 4",
        ),
        (lambda: wf_mesh.find_split((1, 2, 1, 5, 4), 2), ValueError, "H=5 over 2 ranks would not give equal blocks"),
        (lambda: wf_mesh.plan_video_split((1, 2, 0, 4, 4), 2), ValueError, "shape[2] (T)=0 must be >= 1"),
        (lambda: wf_mesh.find_split((1, 16, 24, 88, 160), 2.5), TypeError, "cp_size must be an int, got float 2.5"),
        (
            lambda: wf_mesh.find_split((1, 16, 24, 88, 160), 2, patch_values=(0, 2, 2)),
            ValueError,
            "patch_values[0]=0 must be >= 1",
        ),
        (lambda: wf_mesh.plan_video_split((1, 16, 24.0, 88, 160), 2), TypeError, "shape[2] (T) must be an int"),
        (  # no dim takes the 2 (it says which dim has how many patches; W is not blamed for H)
            lambda: wf_mesh.plan_video_split((1, 4, 3, 6, 6), 2),
            ValueError,
            "cannot split (T=3, H=6, W=6) with patch (1, 2, 2) over cp_size=2: after T, H and W took 1 x 1 x 1 "
            "ranks, a factor 2 divides none of T=3 (3 patches of 1), H=6 (3 patches of 2), W=6 (3 patches of 2); "
            "cp_size must divide the number of patches (3 x 3 x 3)",
        ),
        (
            lambda: wf_mesh.plan_video_split((1, 4, 1, 2, 9), 2),  # W=9 over 2 would drop a column
            ValueError,
            "W=9 over 2 ranks would not give equal blocks of whole 2-wide patches",
        ),
    ],
)
def test_plan_refuses_what_it_cannot_split_exactly(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_sequence_views_round_trip_single_process():
    x = latent((2, 3, 4, 6, 5))
    split = wf_mesh.plan_video_split(x.shape, 4)  # cp_t=4: T=4 -> 1 frame per rank
    seq = split.to_sequence(x)
    assert seq.shape == (2, 4 * 6 * 5, 3)
    assert torch.equal(split.from_sequence(seq), x)
    with pytest.raises(ValueError, match=r"expected \(T, H, W\) = \(4, 6, 5\), got shape \(2, 3, 4, 6, 6\)"):
        split.to_sequence(latent((2, 3, 4, 6, 6)))


def video_cp(shape, cp, tp):
    wf_mesh.initialize_model_parallel(cp_size=cp, tp_size=tp)
    x = latent(shape)
    _, c, t, h, w = shape
    pos = latent((t, h, w, c), seed=1)
    split = wf_mesh.plan_video_split(shape, cp)
    tokens = split.shard(x)
    local_pos = split.shard_positions(pos)
    flat_pos = split.shard_positions(pos.reshape(t * h * w, c))  # natural-order (T*H*W, D) works too
    out = split.gather(tokens + local_pos)  # a "model": add position embeddings token by token
    return tokens, torch.equal(local_pos, flat_pos), out, split.gather(tokens)


@pytest.mark.parametrize(
    "world, shape, cp, tp",
    [
        (2, (1, 3, 4, 4, 6), 2, 1),
        (4, (2, 3, 2, 8, 4), 4, 1),
        (4, (1, 2, 6, 4, 2), 2, 2),
        (8, (1, 2, 4, 8, 2), 8, 1),
        (2, (1, 2, 3, 6, 8), 2, 1),  # width split
        (8, (1, 2, 2, 4, 8), 8, 1),  # 2 x 2 x 2
    ],
)
def test_video_shard_gather_matches_single_process(world, shape, cp, tp):
    x = latent(shape)
    _, c, t, h, w = shape
    pos = latent((t, h, w, c), seed=1)
    split = wf_mesh.plan_video_split(shape, cp)
    reference_seq = split.to_sequence(x)  # single-process: the block-ordered sequence
    reference_out = split.from_sequence(reference_seq + split.positions_to_sequence(pos).unsqueeze(0))
    assert torch.equal(reference_out, x + pos.permute(3, 0, 1, 2).unsqueeze(0))
    for rank, (tokens, same_pos, out, restored) in enumerate(run_distributed(world, video_cp, shape, cp, tp)):
        cp_rank = (rank // tp) % cp
        assert torch.equal(tokens, torch.chunk(reference_seq, cp, 1)[cp_rank])
        assert same_pos
        assert torch.equal(out, reference_out)
        assert torch.equal(restored, x)


def wrong_mesh_size():
    wf_mesh.initialize_model_parallel(cp_size=2)
    split = wf_mesh.plan_video_split((1, 1, 4, 4, 4), 4)
    split.shard(latent((1, 1, 4, 4, 4)))


def test_plan_must_match_the_mesh():
    with pytest.raises(ValueError, match="this VideoSplit plans 4 cp ranks, the mesh has 2"):
        run_distributed(2, wrong_mesh_size)


# ---- the token grid: patch tokens after the patch embedding ---------------------------------------------
def natural_index(positions, grid):
    """Row-major index of global (t, h, w) positions on the token grid."""
    _, h, w = grid
    return positions[:, 0] * h * w + positions[:, 1] * w + positions[:, 2]


def token_cp(shape, cp, tp, patch, dim):
    wf_mesh.initialize_model_parallel(cp_size=cp, tp_size=tp)
    split = wf_mesh.plan_video_split(shape, cp, patch)
    n = math.prod(split.token_grid)
    tokens = latent((shape[0], n, 5), seed=2).requires_grad_()  # (B, N, D), natural (t h w) order
    table = latent((n, 3), seed=3)  # a (N, D) rotary table: dim 0
    heads = latent((2, 3, n, 4), seed=4)  # (B, heads, N, D): dim 2
    local = split.shard_tokens(tokens, dim=dim)
    weight = latent(tokens.shape, seed=5)  # every rank computes the same loss from the gathered tokens
    full = split.gather_tokens(local * 2, dim=dim)
    (full * weight).sum().backward()
    grad = tokens.grad.clone()
    torch.distributed.all_reduce(grad, group=wf_mesh.get_parallel_mesh().group("cp"))  # sum of the cp shards' grads
    plan = split.attention_plan(tokens=True)  # the token grid's sequence, not the latent's
    assert plan.lengths == (n // cp,) * cp and split.attention_plan().lengths == (split.local_tokens,) * cp
    return (
        split.positions(),
        local.detach(),
        split.shard_tokens(table, dim=0),
        split.shard_tokens(heads, dim=2),
        full.detach(),
        grad,
    )


@pytest.mark.parametrize(
    "world, shape, cp, tp, patch",
    [
        (2, (2, 3, 4, 4, 6), 2, 1, (1, 2, 2)),  # time
        (4, (1, 3, 1, 8, 4), 4, 1, (1, 2, 2)),  # height
        (2, (1, 3, 3, 6, 8), 2, 1, (1, 2, 2)),  # width: (T=3, H=6, W=8), refused before
        (4, (1, 3, 3, 6, 8), 2, 2, (1, 2, 2)),  # width, with tp
        (8, (1, 2, 2, 4, 8), 8, 1, (1, 2, 2)),  # 2 x 2 x 2
        (4, (1, 2, 4, 4, 2), 4, 1, (2, 1, 1)),  # a temporal patch
    ],
)
def test_tokens_positions_and_gather_match_single_process(world, shape, cp, tp, patch):
    split = wf_mesh.plan_video_split(shape, cp, patch)
    grid = split.token_grid
    n = math.prod(grid)
    tokens, table, heads = latent((shape[0], n, 5), seed=2), latent((n, 3), seed=3), latent((2, 3, n, 4), seed=4)
    seen = []
    for rank, (pos, local, local_table, local_heads, full, grad) in enumerate(
        run_distributed(world, token_cp, shape, cp, tp, patch, 1)
    ):  # rank = tp + cp * TP
        assert pos.dtype == torch.int64 and pos.shape == (n // cp, 3)
        index = natural_index(pos, grid)  # this rank's tokens ARE the tokens at its global positions
        assert torch.equal(local, tokens[:, index])
        assert torch.equal(local_table, table[index]) and torch.equal(local_heads, heads[:, :, index])
        assert torch.equal(full, tokens * 2)  # natural order again
        assert torch.equal(grad, 2 * latent(tokens.shape, seed=5))  # replicate rule: the shards' grads sum to it
        if rank % tp == 0:
            seen += index.tolist()
    assert sorted(seen) == list(range(n))  # every token on exactly one cp rank


def test_gather_tokens_on_a_negative_dim():
    shape = (1, 3, 2, 4, 4)
    split = wf_mesh.plan_video_split(shape, 2, (1, 2, 2))
    n = math.prod(split.token_grid)
    results = run_distributed(2, token_cp, shape, 2, 1, (1, 2, 2), -2)
    assert all(torch.equal(full, latent((1, n, 5), seed=2) * 2) for *_, full, _ in results)


def patch_embedding_cp(shape):
    """A Conv3d patch embedding of this rank's latent block equals this rank's shard of the full embedding."""
    wf_mesh.initialize_model_parallel(cp_size=torch.distributed.get_world_size())
    split = wf_mesh.plan_video_split(shape, torch.distributed.get_world_size(), (1, 2, 2))
    torch.manual_seed(0)
    embed = torch.nn.Conv3d(shape[1], 8, kernel_size=(1, 2, 2), stride=(1, 2, 2))
    x = latent(shape)
    full = embed(x).flatten(2).transpose(1, 2)  # (B, N, 8) natural order
    ts, hs, ws = split.latent_block(wf_mesh.get_parallel_mesh().rank("cp"))
    block = embed(x[:, :, ts, hs, ws]).flatten(2).transpose(1, 2)  # the block's tokens, natural within the block
    return (split.shard_tokens(full) - block).abs().max().item()


@pytest.mark.parametrize("world, shape", [(2, (1, 3, 3, 6, 8)), (4, (2, 3, 2, 8, 4)), (8, (1, 2, 2, 4, 8))])
def test_token_shards_are_the_patch_embedding_of_the_latent_blocks(world, shape):
    assert (
        max(run_distributed(world, patch_embedding_cp, shape)) < 1e-6
    )  # the same sums; a conv kernel may order them differently


def bad_token_count():
    wf_mesh.initialize_model_parallel(cp_size=2)
    split = wf_mesh.plan_video_split((1, 1, 2, 4, 4), 2, (1, 2, 2))  # 8 tokens, 4 per rank
    split.shard_tokens(torch.zeros(1, 9, 3))


def uneven_token_shards():
    wf_mesh.initialize_model_parallel(cp_size=2)
    split = wf_mesh.plan_video_split((1, 1, 2, 4, 4), 2, (1, 2, 2))
    split.gather_tokens(torch.zeros(1, 4 + torch.distributed.get_rank(), 3))  # rank 1 holds 5


def test_wrong_token_counts_are_refused():
    message = "shard_tokens: dim 1 of shape (1, 9, 3) holds 9 tokens, the token grid (2, 2, 2) (latent (2, 4, 4), "
    raised_everywhere(
        run_distributed(2, bad_token_count, return_exceptions=True),
        ValueError,
        re.escape(message + "patch (1, 2, 2)) has 8"),
    )
    raised_everywhere(
        run_distributed(2, uneven_token_shards, return_exceptions=True),
        wf_mesh.ShapeMismatchError,
        r"local lengths along dim 1 \(rank 0: 4, rank 1: 5\) are not torch.chunk shards of a sequence of 8",
    )
