"""RangeMask (wf_mesh.masks) and the work balancer (wf_mesh.load_balance): pure arithmetic, checked against
masks built row by row from the definition, on random small masks."""

import itertools
import random

import pytest
import torch

import wf_mesh
from wf_mesh.load_balance import balance_by_work, contiguous_segments, imbalance, rank_work
from wf_mesh.masks import Range, RangeMask, frame_chunk_sizes


def definition(ranges, seq_len):
    """The dense mask straight from the definition: query q_start + i of a causal range sees keys
    k_start .. k_start + i (within its key range); the union over ranges."""
    out = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for qs, qe, ks, ke, kind in ranges:
        for q in range(qs, qe):
            out[q, ks : ke if kind == "full" else min(ke, ks + q - qs + 1)] = True
    return out


def random_mask(rng, max_len=20, max_ranges=5):
    seq_len = rng.randint(1, max_len)
    ranges = []
    for _ in range(rng.randint(0, max_ranges)):
        qs, ks = rng.randrange(seq_len), rng.randrange(seq_len)
        ranges.append(
            (qs, rng.randint(qs + 1, seq_len), ks, rng.randint(ks + 1, seq_len), rng.choice(["full", "causal"]))
        )
    return ranges, seq_len


def random_interval(rng, seq_len):
    a = rng.randrange(seq_len + 1)
    return a, rng.randint(a, seq_len)


def test_dense_equals_the_definition_and_pieces_are_disjoint_kernel_shapes():
    rng = random.Random(0)
    for _ in range(600):
        ranges, seq_len = random_mask(rng)
        mask = RangeMask(ranges, seq_len=seq_len)
        want = definition(ranges, seq_len)
        assert torch.equal(mask.dense(), want), (ranges, seq_len)
        cover = torch.zeros(seq_len, seq_len, dtype=torch.int64)
        for p in mask.pieces:
            assert p.kind == "full" or p.k_end - p.k_start == p.q_end - p.q_start, p  # aligned causal squares
            cover += definition([p], seq_len).long()
        assert cover.max() <= 1, (ranges, mask.pieces)  # disjoint
        assert torch.equal(cover.bool(), want)


def test_pair_counts_equal_the_dense_sums_over_random_intervals():
    rng = random.Random(1)
    for _ in range(300):
        ranges, seq_len = random_mask(rng)
        mask, dense = RangeMask(ranges, seq_len=seq_len), definition(ranges, seq_len)
        for _ in range(6):
            (a, b), (c, d) = random_interval(rng, seq_len), random_interval(rng, seq_len)
            assert mask.count((a, b), (c, d)) == int(dense[a:b, c:d].sum()), (ranges, a, b, c, d)
            # position sets of several (overlapping) intervals count each position once
            qs = [random_interval(rng, seq_len) for _ in range(3)]
            ks = [random_interval(rng, seq_len) for _ in range(2)]
            rows = sorted({q for x, y in qs for q in range(x, y)})
            cols = sorted({k for x, y in ks for k in range(x, y)})
            want = int(dense[rows][:, cols].sum()) if rows and cols else 0
            assert mask.count(qs, ks) == want
            assert mask.row_work(a, b) == int(dense[a:b].sum())


def test_block_classes_and_block_pieces_equal_dense_slices():
    rng = random.Random(2)
    for _ in range(300):
        ranges, seq_len = random_mask(rng)
        mask, dense = RangeMask(ranges, seq_len=seq_len), definition(ranges, seq_len)
        for _ in range(6):
            (a, b), (c, d) = random_interval(rng, seq_len), random_interval(rng, seq_len)
            if a == b or c == d:
                continue
            block = dense[a:b, c:d]
            want = "none" if not block.any() else "full" if block.all() else "partial"
            assert mask.block(a, b, c, d) == want
            got = torch.zeros_like(dense, dtype=torch.int64)
            for p in mask.block_pieces(a, b, c, d):
                assert p.kind == "full" or p.k_end - p.k_start == p.q_end - p.q_start, p
                assert a <= p.q_start < p.q_end <= b and c <= p.k_start < p.k_end <= d, p
                got += definition([p], seq_len).long()
            inside = torch.zeros_like(dense)
            inside[a:b, c:d] = block
            assert got.max() <= 1 and torch.equal(got.bool(), inside)


def test_constructors():
    bc = RangeMask.block_causal([2, 3, 1])
    rows = torch.tensor([2, 2, 5, 5, 5, 6])  # every token sees every token of its chunk and the ones before
    assert torch.equal(bc.dense(), torch.arange(6)[None, :] < rows[:, None])
    assert bc.boundaries() == (0, 2, 5, 6) and bc.seq_len == 6
    assert bc == RangeMask([(0, 2, 0, 2, "full"), (2, 5, 0, 5, "full"), (5, 6, 0, 6, "full")])
    assert hash(bc) == hash(RangeMask.chunk_window([2, 3, 1], None))

    window = RangeMask.chunk_window([2, 2, 2, 2], 1)  # chunk c sees chunks c-1 .. c
    chunk = torch.arange(8) // 2
    want = (chunk[None, :] <= chunk[:, None]) & (chunk[None, :] >= chunk[:, None] - 1)
    assert torch.equal(window.dense(), want)
    assert torch.equal(
        RangeMask.chunk_window([3, 1], 0).dense(), torch.block_diag(torch.ones(3, 3), torch.ones(1, 1)).bool()
    )

    clip = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    same = clip[None, :] == clip[:, None]
    assert torch.equal(RangeMask.packed([3, 2, 4]).dense(), same)
    assert torch.equal(RangeMask.packed([3, 2, 4], causal=True).dense(), same & torch.ones(9, 9).bool().tril())
    block = RangeMask.packed([3, 2, 4], causal="block", chunk_size=2)  # chunks of 2 inside each clip
    chunk = torch.tensor([0, 0, 1, 0, 0, 0, 0, 1, 1])
    assert torch.equal(block.dense(), same & (chunk[None, :] <= chunk[:, None]))

    assert frame_chunk_sizes(5, 2, 3) == [6, 6, 3]
    assert RangeMask.block_causal(frame_chunk_sizes(4, 2, 3)).boundaries() == (0, 6, 12)
    assert wf_mesh.RangeMask is RangeMask
    assert RangeMask([(0, 2, 0, 2, "full")]).ranges == (Range(0, 2, 0, 2, "full"),)
    assert RangeMask([], seq_len=3).count((0, 3), (0, 3)) == 0
    assert "RangeMask([(0, 2, 0, 2, 'full')" in repr(bc)


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: RangeMask([(0, 2, 0, 2, "diag")]), ValueError, r"range 0 \(0, 2, 0, 2, 'diag'\) has kind 'diag'"),
        (
            lambda: RangeMask([(0, 2, 0, 2, "full"), (3, 3, 0, 1, "full")]),
            ValueError,
            r"range 1 \(3, 3, 0, 1, 'full'\) is empty",
        ),
        (lambda: RangeMask([(0, 2, 5, 4, "causal")]), ValueError, r"is empty or reversed"),
        (
            lambda: RangeMask([(0, 2, 0, 9, "full")], seq_len=8),
            ValueError,
            r"range 0 \(0, 2, 0, 9, 'full'\) ends past seq_len=8",
        ),
        (lambda: RangeMask([(0, 2, -1, 2, "full")]), ValueError, r"range 0 k_start=-1 must be >= 0"),
        (lambda: RangeMask([(0, 2.5, 0, 2, "full")]), TypeError, r"range 0 q_end must be an int, got float 2.5"),
        (lambda: RangeMask([(0, 2, 0, 2)]), TypeError, r"range 0 must be \(q_start, q_end, k_start, k_end, kind\)"),
        (lambda: RangeMask([]), ValueError, r"no ranges and no seq_len"),
        (lambda: RangeMask("full"), TypeError, r"ranges must be a list"),
        (lambda: RangeMask([], seq_len=0), ValueError, r"seq_len=0 must be >= 1"),
        (lambda: RangeMask.block_causal([]), ValueError, r"chunk_sizes is empty"),
        (lambda: RangeMask.block_causal([4, 0]), ValueError, r"chunk_sizes\[1\]=0 must be >= 1"),
        (lambda: RangeMask.chunk_window([4, 4], -1), ValueError, r"window=-1 must be >= 0"),
        (lambda: RangeMask.packed([4, 4], causal="block"), ValueError, r"chunk_size=None goes with causal='block'"),
        (lambda: RangeMask.packed([4, 4], chunk_size=2), ValueError, r"chunk_size=2 goes with causal='block'"),
        (lambda: RangeMask.packed([4], causal="yes"), ValueError, r"causal='yes': use False, True or 'block'"),
        (lambda: RangeMask.block_causal([2, 2]).count((3, 1), (0, 4)), ValueError, r"queries: interval \(3, 1\) ends"),
        (lambda: RangeMask.block_causal([2, 2]).count("all", (0, 4)), TypeError, r"queries must be \(start, end\)"),
        (lambda: balance_by_work(RangeMask.block_causal([2]), 0), ValueError, r"parts=0 must be >= 1"),
        (lambda: balance_by_work([(0, 2, 0, 2, "full")], 2), TypeError, r"mask must be a wf_mesh.RangeMask"),
    ],
)
def test_misuse_names_the_values(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_contiguous_shards_of_sixteen_block_causal_chunks_at_cp4_give_1_71():
    mask = RangeMask.block_causal([4] * 16)
    work = rank_work(mask, contiguous_segments(64, 4))
    assert work == [16 * w for w in (10, 26, 42, 58)]  # chunk-pairs 1+2+3+4, 5+..+8, ...
    assert round(imbalance(work), 2) == 1.71


MASKS = {
    "block_causal": RangeMask.block_causal([4] * 16),
    "block_causal_uneven": RangeMask.block_causal([5, 3, 7, 2, 9, 4, 6, 8, 1, 3]),
    "packed": RangeMask.packed([37, 5, 20, 64, 11]),
    "packed_causal": RangeMask.packed([37, 5, 20, 64, 11], causal=True),
    "packed_block": RangeMask.packed([36, 12, 24, 60], causal="block", chunk_size=12),
    "window": RangeMask.chunk_window([8] * 12, 2),
    "window_wide": RangeMask.chunk_window([6] * 10, 5),
    "few_chunks": RangeMask.block_causal([16] * 4),  # fewer chunks than needed: cut
}


@pytest.mark.parametrize("parts", [2, 4, 8])
@pytest.mark.parametrize("name", sorted(MASKS))
def test_balanced_segments_partition_the_sequence_within_ten_percent(name, parts):
    mask = MASKS[name]
    segments = balance_by_work(mask, parts)
    positions = sorted(p for segs in segments for a, b in segs for p in range(a, b))
    assert positions == list(range(mask.seq_len))  # every token once
    for segs in segments:
        assert segs == sorted(segs) and all(a < b for a, b in segs)
        assert all(x[1] < y[0] for x, y in itertools.pairwise(segs))  # increasing, touching ones joined
    assert imbalance(rank_work(mask, segments)) <= 1.10
    assert segments == balance_by_work(mask, parts)  # deterministic


def test_whole_chunks_when_they_suffice():
    mask = MASKS["block_causal"]
    segments = balance_by_work(mask, 4)
    cuts = set(mask.boundaries())
    assert all(a in cuts and b in cuts for segs in segments for a, b in segs)
    assert imbalance(rank_work(mask, segments)) == 1.0
