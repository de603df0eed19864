"""viz: TopologyView and PlacementView (text and HTML), pure, plus one multi-process DTensor check."""

import math
import re
from html.parser import HTMLParser

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import wf_mesh
from wf_mesh import ParallelDims
from wf_mesh.testing import run_distributed
from wf_mesh.viz import PlacementView, TopologyView, parse_placement, show_topology

VOID = {"br", "hr", "img", "input", "meta", "link", "col", "wbr"}


class _Checker(HTMLParser):
    """Strict enough: every non-void tag closes in order; collects (tag, attrs, text) of td/tr."""

    def __init__(self):
        super().__init__()
        self.stack, self.cells, self.rows = [], [], []

    def handle_starttag(self, tag, attrs):
        if tag not in VOID:
            self.stack.append(tag)
        if tag in ("td", "tr"):
            (self.cells if tag == "td" else self.rows).append([dict(attrs), ""])

    def handle_endtag(self, tag):
        assert self.stack and self.stack.pop() == tag, f"unbalanced </{tag}>"

    def handle_data(self, data):
        if self.stack and self.stack[-1] == "td":
            self.cells[-1][1] += data


def parse_html(text: str) -> _Checker:
    checker = _Checker()
    checker.feed(text)
    checker.close()
    assert checker.stack == [], f"unclosed tags {checker.stack}"
    return checker


def background(attrs: dict) -> str | None:
    m = re.fullmatch(r"background:(.+)", attrs.get("style", ""))
    return m[1] if m else None


# ---- TopologyView: text -----------------------------------------------------------------------------
def test_topology_text_three_axes():
    assert str(TopologyView(ParallelDims(tp=2, cp=2, pp=2).resolve(8))) == (
        "world 8 = tp 2 x cp 2 x pp 2 x dp 1, order tp-cp-pp-dp (fastest first)\n"
        "2 rows (pp) x 4 columns (tp x cp): rank = row * 4 + column\n"
        "size-1 axes (every rank is its own group): dp\n"
        "\n"
        "  rank           tp (4 groups of 2)   cp (4 groups of 2)   pp (4 groups of 2)\n"
        "  pp0  0 1 2 3   0 0 1 1              0 1 0 1              0 1 2 3\n"
        "  pp1  4 5 6 7   2 2 3 3              2 3 2 3              0 1 2 3"
    )


def test_topology_text_size_one_axes():
    assert str(TopologyView(ParallelDims(cp=4, pp=2).resolve(8))) == (
        "world 8 = tp 1 x cp 4 x pp 2 x dp 1, order tp-cp-pp-dp (fastest first)\n"
        "2 rows (pp) x 4 columns (cp): rank = row * 4 + column\n"
        "size-1 axes (every rank is its own group): tp, dp\n"
        "\n"
        "  rank           cp (2 groups of 4)   pp (4 groups of 2)\n"
        "  pp0  0 1 2 3   0 0 0 0              0 1 2 3\n"
        "  pp1  4 5 6 7   1 1 1 1              0 1 2 3"
    )
    single = str(TopologyView(ParallelDims().resolve(1)))
    assert "size-1 axes (every rank is its own group): tp, cp, pp, dp" in single
    assert single.endswith("  rank\n  0")


def test_topology_text_one_axis_lists_groups_and_highlights():
    view = show_topology(ParallelDims(tp=2, cp=2, pp=2).resolve(16), "dp_cp", highlight=5)
    assert str(view) == (
        "world 16 = tp 2 x cp 2 x pp 2 x dp 2, order tp-cp-pp-dp (fastest first)\n"
        "4 rows (pp x dp) x 4 columns (tp x cp): rank = row * 4 + column\n"
        "* = rank 5\n"
        "\n"
        "  rank                   dp_cp (4 groups of 4)\n"
        "  pp0 dp0   0  1  2  3   0 1 0 1\n"
        "  pp1 dp0   4 5*  6  7   2 3 2 3\n"
        "  pp0 dp1   8  9 10 11   0 1 0 1\n"
        "  pp1 dp1  12 13 14 15   2 3 2 3\n"
        "\n"
        "dp_cp groups: 0=[0,2,8,10] 1=[1,3,9,11] 2=[4,6,12,14] 3=[5,7,13,15]"
    )


@pytest.mark.parametrize("order", ["tp-cp-pp-dp", "dp-pp-cp-tp", "cp-tp-dp-pp"])
def test_topology_group_numbers_match_groups(order):
    dims = ParallelDims(tp=2, cp=3, pp=2, dp=2, order=order).resolve(24)
    view = TopologyView(dims)
    assert view.axes == dims.axis_order  # four axes, fastest first
    ranks = view.grid.flatten().tolist()
    assert sorted(ranks) == list(range(24))
    for axis in [*dims.axis_order, "dp_cp", "tp_pp"]:
        groups = dims.groups(axis)
        numbers = view.group_ids(axis).flatten().tolist()
        assert all(r in groups[g] for r, g in zip(ranks, numbers))


def test_topology_large_world_is_cut():
    dims = ParallelDims(tp=8, cp=8, pp=16).resolve(100352)
    view = TopologyView(dims)
    text = str(view)
    lines = text.splitlines()
    assert len(lines) < 50 and max(map(len, lines)) <= 100
    assert "12544 rows (cp x pp x dp) x 8 columns (tp): rank = row * 8 + column" in text
    assert "showing 16 of 12544 rows and 8 of 8 columns (128 of 100352 ranks)" in text
    assert "dp (1024 groups of 98)" in text and "tp (12544 groups of 8)" in text
    assert "  cp7 pp1 dp0  120 121 122 123 124 125 126 127" in text
    cells = parse_html(view._repr_html_()).cells
    assert len(cells) == 4 * 128


def test_topology_wide_axis_cuts_columns():
    text = str(TopologyView(ParallelDims(tp=32).resolve(64), "tp"))
    assert "showing 2 of 2 rows and 16 of 32 columns (32 of 64 ranks)" in text
    assert "  dp0   0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 ...   0 0 0" in text
    assert "tp groups: 0=[0-31] 1=[32-63]" in text


def test_topology_bad_input():
    with pytest.raises(ValueError, match="resolve"):
        TopologyView(ParallelDims(tp=2))
    with pytest.raises(ValueError, match="unknown axis"):
        TopologyView(ParallelDims(tp=2).resolve(4), "xx")
    with pytest.raises(TypeError, match="ParallelDims or a ParallelMesh"):
        TopologyView((2, 2))


# ---- TopologyView: HTML -----------------------------------------------------------------------------
def test_topology_html_one_coloured_cell_per_rank():
    dims = ParallelDims(tp=2, cp=2, pp=2).resolve(16)
    page = parse_html(TopologyView(dims, "dp_cp", highlight=3)._repr_html_())
    colour = {int(text): background(attrs) for attrs, text in page.cells}
    assert sorted(colour) == list(range(16)) and len(page.cells) == 16
    groups = dims.groups("dp_cp")
    assert len({colour[g[0]] for g in groups}) == len(groups)  # distinct colour per group
    assert all(colour[r] == colour[g[0]] for g in groups for r in g)  # one colour inside a group
    highlighted = [text for attrs, text in page.cells if attrs.get("class") == "me"]
    assert highlighted == ["3"]
    assert 'title="rank 3: tp1 cp1 pp0 dp0, dp_cp group 1"' in TopologyView(dims, "dp_cp")._repr_html_()


def test_topology_html_default_view_has_a_grid_per_axis():
    dims = ParallelDims(tp=2, cp=2, pp=1, dp=4).resolve(16)
    html = TopologyView(dims)._repr_html_()
    page = parse_html(html)
    assert len(page.cells) == 3 * 16  # tp, cp, dp; pp has size 1
    for caption in ("tp (8 groups of 2)", "cp (8 groups of 2)", "dp (4 groups of 4)"):
        assert f"<caption>{caption}</caption>" in html
    assert "pp (" not in html and "size-1 axes (every rank is its own group): pp" in html


# ---- PlacementView: plans ---------------------------------------------------------------------------
VIDEO = (2, 16, 8, 44, 80)  # (B, C, T, H, W)


def test_planned_video_latent_over_dp_cp():
    view = PlacementView.plan(VIDEO, (2, 4), [Replicate(), Shard(2)], mesh_dim_names=("dp", "cp"), dim_names="BCTHW")
    assert str(view) == (
        "shape (2, 16, 8, 44, 80) on mesh dp=2 x cp=4, placements (R, S(2))\n"
        "8 ranks, 4 distinct slices (same slice = same index ranges)\n"
        "\n"
        "rank  dp  cp  slice  B  C    T  H  W         local shape\n"
        "   0   0   0      0  :  :  0:2  :  :  (2, 16, 2, 44, 80)\n"
        "   1   0   1      1  :  :  2:4  :  :  (2, 16, 2, 44, 80)\n"
        "   2   0   2      2  :  :  4:6  :  :  (2, 16, 2, 44, 80)\n"
        "   3   0   3      3  :  :  6:8  :  :  (2, 16, 2, 44, 80)\n"
        "   4   1   0      0  :  :  0:2  :  :  (2, 16, 2, 44, 80)\n"
        "   5   1   1      1  :  :  2:4  :  :  (2, 16, 2, 44, 80)\n"
        "   6   1   2      2  :  :  4:6  :  :  (2, 16, 2, 44, 80)\n"
        "   7   1   3      3  :  :  6:8  :  :  (2, 16, 2, 44, 80)"
    )
    # The same plan from short strings.
    short = PlacementView.plan(VIDEO, (2, 4), ["R", "S(2)"], mesh_dim_names=("dp", "cp"), dim_names="BCTHW")
    assert str(short) == str(view)


def _take(x: torch.Tensor, ranges) -> torch.Tensor:
    return x[tuple(slice(a, b) for a, b in ranges)]


@pytest.mark.parametrize("t", [8, 7, 5, 3, 1])
def test_uneven_time_follows_torch_chunk(t):
    shape = (2, 3, t, 4, 5)
    x = torch.arange(math.prod(shape)).reshape(shape)
    chunks = torch.chunk(x, 4, dim=2)
    view = PlacementView.plan(shape, (2, 4), ["R", "S(2)"], mesh_dim_names=("dp", "cp"))
    rows = view.rows()
    assert [r.rank for r in rows] == list(range(8))
    for r in rows:
        dp, cp = r.coords
        assert r.coords == (r.rank // 4, r.rank % 4)
        expected = chunks[cp] if cp < len(chunks) else x.narrow(2, 0, 0)
        assert r.local_shape == tuple(expected.shape)
        assert torch.equal(_take(x, r.ranges), expected)
        assert r.slice == cp


def test_two_axes_sharding_one_dim_chunk_twice():
    # DTensor applies placements left to right: the second Shard(0) chunks the first one's chunk.
    x = torch.arange(10 * 3).reshape(10, 3)
    view = PlacementView.plan(x.shape, (2, 3), ["S(0)", "S(0)"])
    for r in view.rows():
        a, b = r.coords
        inner = torch.chunk(torch.chunk(x, 2)[a], 3)
        expected = inner[b] if b < len(inner) else x[:0]
        assert torch.equal(_take(x, r.ranges), expected)
    assert str(view).splitlines()[3:] == [
        "rank  axis0  axis1  slice    d0  d1  local shape",
        "   0      0      0      0   0:2   :       (2, 3)",
        "   1      0      1      1   2:4   :       (2, 3)",
        "   2      0      2      2   4:5   :       (1, 3)",
        "   3      1      0      3   5:7   :       (2, 3)",
        "   4      1      1      4   7:9   :       (2, 3)",
        "   5      1      2      5  9:10   :       (1, 3)",
    ]


def test_four_axis_mesh_with_partial_and_two_sharded_dims():
    shape = (4, 6, 10)
    view = PlacementView.plan(
        shape, (2, 1, 2, 3), ["S(0)", "R", "P", "S(-1)"], mesh_dim_names=("dp", "pp", "cp", "tp")
    )
    text = str(view)
    assert "placements (S(0), R, P(sum), S(2))" in text
    assert "12 ranks, 6 distinct slices" in text
    assert "partial over cp: each rank holds a term; the value is their sum" in text
    assert "  11   1   0   1   2      5  2:4   :  8:10    (2, 6, 2)" in text
    rows = view.rows()
    assert [r.slice for r in rows] == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]
    assert rows[3].ranges == rows[0].ranges  # cp: same elements, partial terms


def test_large_planned_mesh_is_cut():
    view = PlacementView.plan((25088, 1024), (12544, 8), ["S(0)", "S(1)"], max_rows=8)
    lines = str(view).splitlines()
    assert len(lines) == 13
    assert lines[1] == "100352 ranks, 100352 distinct slices (same slice = same index ranges)"
    assert lines[-1] == "... 100344 more ranks"
    assert lines[-2] == "   7      0      7      7  0:2  896:1024     (2, 128)"


def test_parse_placement_forms():
    assert parse_placement("S(2)") == Shard(2) == parse_placement("Shard(dim=2)") == parse_placement("Shard(2)")
    assert parse_placement("R") == Replicate() == parse_placement("Replicate()")
    assert parse_placement("P") == Partial() == parse_placement("P(sum)")
    assert parse_placement("P(avg)") == Partial("avg")
    for bad in ["S", "S(x)", "Q", "R(1)", 3]:
        with pytest.raises(ValueError, match="unsupported placement"):
            parse_placement(bad)


def test_plan_bad_input():
    with pytest.raises(ValueError, match=r"placements \(S\(0\)\): 1 given for a 2-D mesh \(2, 2\)"):
        PlacementView.plan((4, 4), (2, 2), ["S(0)"])
    with pytest.raises(ValueError, match=r"S\(3\) on mesh axis cp: no dim 3 in \(4, 4\)"):
        PlacementView.plan((4, 4), 2, ["S(3)"], mesh_dim_names=("cp",))
    with pytest.raises(ValueError, match=r"ranks have shape \(4,\), but mesh_shape is \(2, 2\)"):
        PlacementView.plan((4, 4), (2, 2), ["R", "R"], ranks=[0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"dim_names \(B, C\): 2 given for a 3-D tensor \(1, 2, 3\)"):
        PlacementView.plan((1, 2, 3), 2, ["R"], dim_names="BC")
    with pytest.raises(TypeError, match="PlacementView.plan"):
        PlacementView(torch.zeros(2))


def test_placement_html_colours_per_slice():
    view = PlacementView.plan(VIDEO, (2, 4), ["R", "S(2)"], mesh_dim_names=("dp", "cp"), highlight=6)
    page = parse_html(view._repr_html_())
    rows = page.rows[1:]  # the first row is the header
    assert len(rows) == 8
    colours = [background(attrs) for attrs, _ in rows]
    assert len(set(colours)) == 4
    assert colours[:4] == colours[4:]  # dp replicas share their slice's colour
    assert [attrs.get("class") == "me" for attrs, _ in rows] == [i == 6 for i in range(8)]


# ---- DTensors on real processes ---------------------------------------------------------------------
SHAPE = (2, 3, 5, 4, 6)  # T=5 over cp=2: uneven (3, 2)


def _views_on_ranks():
    pm = wf_mesh.init_parallel(ParallelDims(cp=2))  # dp=2; root mesh ("dp", "pp", "cp", "tp") = (2, 1, 2, 1)
    x = torch.arange(math.prod(SHAPE), dtype=torch.float32).reshape(SHAPE)
    seq = wf_mesh.shard_sequence(x, seq_dim=2)
    full = distribute_tensor(x, pm.root, [Shard(0), Replicate(), Shard(2), Replicate()])
    partial = DTensor.from_local(torch.ones(3, 4), pm["cp"], [Partial()], run_check=False)
    views = [str(PlacementView(seq)), str(PlacementView(full, dim_names="BCTHW")), str(PlacementView(partial))]
    return views, seq.to_local(), full.to_local(), str(TopologyView(pm))


def test_dtensor_views_match_plans():
    dims = ParallelDims(cp=2).resolve(4)
    x = torch.arange(math.prod(SHAPE), dtype=torch.float32).reshape(SHAPE)
    for rank, (views, seq_local, full_local, topology) in enumerate(run_distributed(4, _views_on_ranks)):
        cp_ranks = dims.group_of("cp", rank)
        seq_plan = PlacementView.plan(SHAPE, 2, ["S(2)"], mesh_dim_names=("cp",), ranks=cp_ranks, highlight=rank)
        full_plan = PlacementView.plan(
            SHAPE, dims.mesh_shape, ["S(0)", "R", "S(2)", "R"], mesh_dim_names=dims.mesh_dim_names,
            dim_names="BCTHW", highlight=rank,
        )  # fmt: skip
        partial_plan = PlacementView.plan((3, 4), 2, ["P"], mesh_dim_names=("cp",), ranks=cp_ranks, highlight=rank)
        assert views == [str(seq_plan), str(full_plan), str(partial_plan)]
        # The planned ranges are where the DTensor's local data really comes from.
        (seq_row,) = [r for r in seq_plan.rows() if r.rank == rank]
        (full_row,) = [r for r in full_plan.rows() if r.rank == rank]
        assert torch.equal(seq_local, _take(x, seq_row.ranges))
        assert torch.equal(full_local, _take(x, full_row.ranges))
        assert f"* = rank {rank}" in topology
