"""Video latent CP plans: find_split-based blocks, sequence shards, position embeddings, restore."""

import re

import pytest
import torch

import wf_mesh
from wf_mesh import parallel_state as ps
from wf_mesh.testing import run_distributed


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
    with pytest.raises(ValueError, match="a factor 2 is left for W"):
        wf_mesh.plan_video_split((1, 16, 21, 88, 160), 8)


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
    [(2, (1, 3, 4, 4, 6), 2, 1), (4, (2, 3, 2, 8, 4), 4, 1), (4, (1, 2, 6, 4, 2), 2, 2), (8, (1, 2, 4, 8, 2), 8, 1)],
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
